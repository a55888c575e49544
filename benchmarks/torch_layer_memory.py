"""What a PyTorch GPU stack keeps per GPT layer for the backward, measured.

A Megatron-LM-style GPT layer (Shoeybi et al. 2019; the layer of Korthikanti et al.
2022, Figure 3: pre-norm, fused QKV, GELU MLP of width 4h, dropout 0.1 after the
softmax, the projection and the MLP) runs its forward in BF16 on the accelerator PyTorch
finds. The bytes it keeps are measured two ways:

- `allocated`: on CUDA, what the caching allocator holds after the forward of 4 layers
  less after 2, halved (`torch.cuda.memory_allocated`), so that the input and the
  output cancel;
- `saved`: the distinct storages autograd saves for the backward
  (`torch.autograd.graph.saved_tensors_hooks`), parameters left out, per layer; this
  runs on a CPU too.

Two attention cores: `plain` (scores, softmax and dropout as separate kernels, as
Megatron-LM's unfused path keeps them) and `sdpa` (`F.scaled_dot_product_attention`,
FlashAttention on a GPU). `benchmarks/memory_check.py` compares both with the analytic
model (`shardemu/predict/activations.py`). PyTorch is not a dependency of shardemu: this
script runs where it is installed (the lent GPU machines have it).

    python benchmarks/torch_layer_memory.py --out benchmarks/measured/torch_layer_memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DROPOUT = 0.1  # Megatron-LM's hidden and attention dropout (Korthikanti et al., Section 4.1)


class Layer(nn.Module):
    """One pre-norm GPT layer on [s, b, h] activations, as Megatron-LM lays them out."""

    def __init__(self, hidden: int, heads: int, core: str) -> None:
        super().__init__()
        self.heads, self.core = heads, core
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc_1, self.fc_2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = self.qkv(x).view(s, b, self.heads, 3 * h // self.heads).chunk(3, dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, a, s, h / a]
        if self.core == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) / (h // self.heads) ** 0.5
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
            ctx = F.dropout(probs, DROPOUT) @ v
        return self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.ln_1(x)), DROPOUT)
        return x + F.dropout(self.fc_2(F.gelu(self.fc_1(self.ln_2(x)))), DROPOUT)


def saved_bytes(layers: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in a forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layers(x)
    return sum(storages.values())


def measure(hidden: int, heads: int, batch: int, seq: int, core: str) -> dict[str, Any]:
    """One row: the per-layer bytes kept, by each measure this device offers."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kept: dict[int, dict[str, int]] = {}
    for depth in (2, 4):
        layers = nn.Sequential(*(Layer(hidden, heads, core) for _ in range(depth)))
        layers = layers.to(device, torch.bfloat16)
        x = torch.randn(seq, batch, hidden, device=device, dtype=torch.bfloat16)
        x.requires_grad_(True)
        kept[depth] = {"saved": saved_bytes(layers, x)}
        if device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            y = layers(x)
            torch.cuda.synchronize()
            kept[depth]["allocated"] = torch.cuda.memory_allocated() - before
            del y
        del layers, x
    per_layer = {k: (kept[4][k] - kept[2][k]) / 2 for k in kept[2]}
    return {"hidden": hidden, "heads": heads, "batch": batch, "seq": seq, "core": core,
            "dropout": DROPOUT, "device": device, "per_layer": per_layer}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/torch_layer_memory.json")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    rows = []
    for hidden, heads in ((1024, 16), (2048, 16), (4096, 32)):
        for batch in (1, 4):
            for core in ("plain", "sdpa"):
                rows.append(measure(hidden, heads, batch, args.seq, core))
                print(rows[-1], flush=True)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = {"device": name, "torch": torch.__version__, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
