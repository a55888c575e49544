"""Time Llama layers as a PyTorch stack runs them, for the roofline to be checked against.

TorchTitan's Llama 3 layer (pytorch/torchtitan, torchtitan/models/llama/model.py of
December 2024, rewritten here, not imported): `nn.RMSNorm`, rotary embeddings through
complex multiplication, grouped-query attention with K and V repeated to the query
heads and `scaled_dot_product_attention` (causal; FlashAttention-2 on a GPU, PyTorch's
default), and a SwiGLU MLP; BF16 weights and activations on one device, no
checkpointing. Each row is a stack of `--layers` layers, forward and backward
(`torch.autograd.grad` of a random output gradient with respect to the input and
every weight), the median of 5 calls after 2 warm-ups (CUDA events): eager and each
layer `torch.compile`d (as TorchTitan compiles a block at a time) with the attention
kernel PyTorch picks (recorded: `default_sdpa`), and eager with FlashAttention-2 or
cuDNN's kernel forced.
`benchmarks/torch_llama_check.py` plans the same layers with shardemu and compares.

    python benchmarks/torch_llama_layers.py --out benchmarks/measured/torch_llama_layers.json

PyTorch is not a dependency of shardemu: this runs where it is installed (the lent GPU
machines have it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# Llama 3 8B (Dubey et al. 2024, Table 3): width 4096, 32 heads of 128, 8 key/value
# heads, SwiGLU of 14336, RMSNorm eps 1e-5, rotary theta 500000
WIDTH, HEADS, KV_HEADS, MLP, THETA = 4096, 32, 8, 14336, 500000.0
SHAPES = ((2, 8192), (1, 32768))  # (batch, sequence): TorchTitan's Tables 1 and 2
BACKENDS = {"flash2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        head = WIDTH // HEADS
        self.wq = nn.Linear(WIDTH, HEADS * head, bias=False)
        self.wk = nn.Linear(WIDTH, KV_HEADS * head, bias=False)
        self.wv = nn.Linear(WIDTH, KV_HEADS * head, bias=False)
        self.wo = nn.Linear(HEADS * head, WIDTH, bias=False)
        self.w1 = nn.Linear(WIDTH, MLP, bias=False)
        self.w2 = nn.Linear(MLP, WIDTH, bias=False)
        self.w3 = nn.Linear(WIDTH, MLP, bias=False)
        self.attention_norm = nn.RMSNorm(WIDTH, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(WIDTH, eps=1e-5)

    def attention(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head = WIDTH // HEADS
        q = self.wq(x).view(b, s, HEADS, head)
        k = self.wk(x).view(b, s, KV_HEADS, head)
        v = self.wv(x).view(b, s, KV_HEADS, head)
        q, k = rotary(q, freqs), rotary(k, freqs)
        repeat = HEADS // KV_HEADS  # TorchTitan's repeat_kv: expand, then reshape (a copy)
        k = k[:, :, :, None].expand(b, s, KV_HEADS, repeat, head).reshape(b, s, HEADS, head)
        v = v[:, :, :, None].expand(b, s, KV_HEADS, repeat, head).reshape(b, s, HEADS, head)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


def rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """TorchTitan's apply_rotary_emb: pairs as complex numbers times e^(i theta)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3).type_as(x)


def frequencies(seq: int) -> torch.Tensor:
    head = WIDTH // HEADS
    inv = 1.0 / THETA ** (torch.arange(0, head, 2, device="cuda").float() / head)
    angles = torch.outer(torch.arange(seq, device="cuda").float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


def timed(fn: Any) -> float:
    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    for _ in range(2):
        once()
    return statistics.median(once() for _ in range(5))


def default_backend(batch: int, seq: int) -> str:
    """The kernel `scaled_dot_product_attention` picks for this layer's (causal) core
    when none is forced (`torch._fused_sdp_choice`)."""
    q = torch.zeros(batch, HEADS, seq, WIDTH // HEADS, device="cuda", dtype=torch.bfloat16)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name


def measure(layers: int, batch: int, seq: int, compiled: bool, sdpa: str) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.cuda.empty_cache()  # the last row's arrays, freed when it returned
    torch.cuda.reset_peak_memory_stats()
    blocks = [Block().to("cuda", torch.bfloat16) for _ in range(layers)]
    calls = [torch.compile(b) if compiled else b for b in blocks]
    weights = [p for b in blocks for p in b.parameters()]
    freqs = frequencies(seq)
    x = torch.randn(batch, seq, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> Any:
        y = x
        for call in calls:
            y = call(y, freqs)
        return torch.autograd.grad(y, [x, *weights], grad)

    if sdpa == "default":
        seconds = timed(step)
    else:  # one backend forced

        def forced() -> Any:
            with sdpa_kernel(BACKENDS[sdpa]):
                return step()

        seconds = timed(forced)
    peak = torch.cuda.max_memory_allocated()
    return {"layers": layers, "batch": batch, "seq": seq, "compiled": compiled, "sdpa": sdpa,
            "default_sdpa": default_backend(batch, seq), "fwd_bwd_seconds": seconds,
            "peak_allocated_bytes": peak}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    settings = [(False, "default"), (True, "default"), (False, "flash2"), (False, "cudnn")]
    for compiled, sdpa in settings:
        for batch, seq in SHAPES:
            try:
                row = measure(args.layers, batch, seq, compiled, sdpa)
            except Exception as error:  # noqa: BLE001 - recorded, the other rows go on
                row = {"batch": batch, "seq": seq, "compiled": compiled, "sdpa": sdpa,
                       "error": f"{type(error).__name__}: {error}"[:400]}  # fmt: skip
            out["rows"].append(row)
            Path(args.out).write_text(json.dumps(out, indent=1))
            print(row, flush=True)


if __name__ == "__main__":
    main()
