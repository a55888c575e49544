"""Time transformer layers as a PyTorch stack runs them, for the roofline to be checked.

- `--model llama3-8b`: TorchTitan's Llama 3 layer (pytorch/torchtitan,
  torchtitan/models/llama/model.py of December 2024, rewritten here, not imported):
  `nn.RMSNorm`, rotary embeddings through complex multiplication, grouped-query
  attention with K and V repeated to the query heads, and a SwiGLU MLP; BF16, local
  batch 2 x 8192 and 1 x 32768 (TorchTitan's Tables 1 and 2), causal.
- `--model llama3-405b-tp8`: the same layer as Llama 3 405B's shard on one of its
  8 tensor-parallel GPUs (Dubey et al. 2024, Table 3 and Section 3.3.2: width 16384,
  128 heads of 128, 8 key/value heads, SwiGLU of 53248, TP 8): 16 query heads, one
  key/value head and an MLP of 6656 a GPU, the input and output replicated (no
  sequence parallelism, no collective), BF16, one sequence of 8192 (its local batch:
  16M tokens over DP 64 x 32 microbatches at 8,192 GPUs).
- `--model bert-large`: the BERT-Large layer as NVIDIA's BERT runs it (post-LN,
  biases, GELU MLP of 4h: Devlin et al. 2019), FP16, 256 sequences of 128 a GPU (its
  phase 1), no mask; with dropout 0 (as shardemu's layers) and 0.1 (as BERT's).

Attention is `scaled_dot_product_attention` (cuDNN's kernel or FlashAttention-2 on a
GPU). Each row is a stack of `--layers` layers, forward and backward
(`torch.autograd.grad` of a random output gradient with respect to the input and every
weight), no checkpointing, one device, the median of 5 calls after 2 warm-ups (CUDA
events): eager and each layer `torch.compile`d (as TorchTitan compiles a block at a
time) with the attention kernel PyTorch picks (recorded: `default_sdpa`), and eager
with FlashAttention-2 or cuDNN's kernel forced. `benchmarks/torch_layers_check.py`
counts the same layers with shardemu and compares.

    cd benchmarks/measured
    python ../torch_layers.py --model llama3-8b --out torch_llama_layers.json
    python ../torch_layers.py --model bert-large --out torch_bert_layers.json

PyTorch is not a dependency of shardemu: this runs where it is installed (the lent GPU
machines have it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from kernel_rates import cuda_seconds  # this folder's: the one CUDA-event timer
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
THETA = 500000.0  # Llama 3's rotary base (Dubey et al. 2024, Table 3)


@dataclass(frozen=True)
class LlamaShape:
    """A Llama layer's widths on one GPU: the model's width, its query and key/value
    heads there, their width and the SwiGLU MLP's there (a tensor-parallel shard
    divides the heads and the MLP, Shoeybi et al. 2019)."""

    width: int
    heads: int
    kv_heads: int
    mlp: int
    head: int = 128


# Llama 3 8B and 405B (Dubey et al. 2024, Table 3); 405B's heads and MLP over TP 8
LLAMA3_8B = LlamaShape(4096, 32, 8, 14336)
LLAMA3_405B_TP8 = LlamaShape(16384, 128 // 8, 8 // 8, 53248 // 8)


class LlamaBlock(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = s = shape
        self.wq = nn.Linear(s.width, s.heads * s.head, bias=False)
        self.wk = nn.Linear(s.width, s.kv_heads * s.head, bias=False)
        self.wv = nn.Linear(s.width, s.kv_heads * s.head, bias=False)
        self.wo = nn.Linear(s.heads * s.head, s.width, bias=False)
        self.w1 = nn.Linear(s.width, s.mlp, bias=False)
        self.w2 = nn.Linear(s.mlp, s.width, bias=False)
        self.w3 = nn.Linear(s.width, s.mlp, bias=False)
        self.attention_norm = nn.RMSNorm(s.width, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(s.width, eps=1e-5)

    def attention(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads, kv_heads, head = self.shape.heads, self.shape.kv_heads, self.shape.head
        q = self.wq(x).view(b, s, heads, head)
        k = self.wk(x).view(b, s, kv_heads, head)
        v = self.wv(x).view(b, s, kv_heads, head)
        q, k = rotary(q, freqs), rotary(k, freqs)
        repeat = heads // kv_heads  # TorchTitan's repeat_kv: expand, then reshape (a copy)
        k = k[:, :, :, None].expand(b, s, kv_heads, repeat, head).reshape(b, s, heads, head)
        v = v[:, :, :, None].expand(b, s, kv_heads, repeat, head).reshape(b, s, heads, head)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class BertBlock(nn.Module):
    """BERT-Large's layer (width 1024, 16 heads, MLP 4096, layer norm eps 1e-12)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(1024, 3 * 1024), nn.Linear(1024, 1024)
        self.up, self.down = nn.Linear(1024, 4096), nn.Linear(4096, 1024)
        self.norm1, self.norm2 = nn.LayerNorm(1024, eps=1e-12), nn.LayerNorm(1024, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, _: Any) -> torch.Tensor:
        b, s, _h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 16, 64).permute(2, 0, 3, 1, 4)
        p = self.dropout.p if self.training else 0.0
        core = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        x = self.norm1(x + self.dropout(self.out(core.transpose(1, 2).reshape(b, s, -1))))
        return self.norm2(x + self.dropout(self.down(F.gelu(self.up(x)))))


@dataclass(frozen=True)
class Family:
    """A model's layer as measured: its block, dtype, width, query heads on the GPU and
    their width, shapes and whether its attention is causal; `dropouts` the block's
    dropout rates measured (Llama: none)."""

    block: Callable[[float], nn.Module]
    dtype: torch.dtype
    width: int
    heads: int
    head: int
    shapes: tuple[tuple[int, int], ...]  # (batch, sequence)
    causal: bool
    dropouts: tuple[float, ...] = (0.0,)


FAMILIES = {
    "llama3-8b": Family(lambda _: LlamaBlock(LLAMA3_8B), torch.bfloat16, 4096, 32, 128,
                        ((2, 8192), (1, 32768)), True),
    "llama3-405b-tp8": Family(lambda _: LlamaBlock(LLAMA3_405B_TP8), torch.bfloat16, 16384,
                              16, 128, ((1, 8192),), True),
    "bert-large": Family(BertBlock, torch.float16, 1024, 16, 64, ((256, 128),), False, (0.0, 0.1)),
}  # fmt: skip


def rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """TorchTitan's apply_rotary_emb: pairs as complex numbers times e^(i theta)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3).type_as(x)


def frequencies(seq: int, head: int = 128) -> torch.Tensor:
    inv = 1.0 / THETA ** (torch.arange(0, head, 2, device="cuda").float() / head)
    angles = torch.outer(torch.arange(seq, device="cuda").float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


def default_backend(family: Family, batch: int, seq: int) -> str:
    """The kernel `scaled_dot_product_attention` picks for this layer's core when none
    is forced (`torch._fused_sdp_choice`)."""
    shape = (batch, family.heads, seq, family.head)
    q = torch.zeros(shape, device="cuda", dtype=family.dtype)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=family.causal)).name


def measure(family: Family, layers: int, shape: tuple[int, int], compiled: bool, sdpa: str,
            dropout: float) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    torch.cuda.empty_cache()  # the last row's arrays, freed when it returned
    torch.cuda.reset_peak_memory_stats()
    batch, seq = shape
    blocks = [family.block(dropout).to("cuda", family.dtype) for _ in range(layers)]
    calls = [torch.compile(b) if compiled else b for b in blocks]
    weights = [p for b in blocks for p in b.parameters()]
    freqs = frequencies(seq, family.head) if family.causal else None
    x = torch.randn(batch, seq, family.width, device="cuda", dtype=family.dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> Any:
        y = x
        for call in calls:
            y = call(y, freqs)
        return torch.autograd.grad(y, [x, *weights], grad)

    if sdpa == "default":
        seconds = cuda_seconds(step)
    else:  # one backend forced

        def forced() -> Any:
            with sdpa_kernel(BACKENDS[sdpa]):
                return step()

        seconds = cuda_seconds(forced)
    peak = torch.cuda.max_memory_allocated()
    return {"layers": layers, "batch": batch, "seq": seq, "compiled": compiled, "sdpa": sdpa,
            "dropout": dropout, "default_sdpa": default_backend(family, batch, seq),
            "fwd_bwd_seconds": seconds, "peak_allocated_bytes": peak}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    family = FAMILIES[args.model]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": args.model, "rows": []}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    settings = [(False, "default", d) for d in family.dropouts] + [
        (True, "default", 0.0), (False, "flash2", 0.0), (False, "cudnn", 0.0)]  # fmt: skip
    for compiled, sdpa, dropout in settings:
        for shape in family.shapes:
            try:
                row = measure(family, args.layers, shape, compiled, sdpa, dropout)
            except Exception as error:  # noqa: BLE001 - recorded, the other rows go on
                failed = f"{type(error).__name__}: {error}"[:400]
                row = {"batch": shape[0], "seq": shape[1], "compiled": compiled, "sdpa": sdpa,
                       "dropout": dropout, "error": failed}  # fmt: skip
            out["rows"].append(row)
            Path(args.out).write_text(json.dumps(out, indent=1))
            print(row, flush=True)


if __name__ == "__main__":
    main()
