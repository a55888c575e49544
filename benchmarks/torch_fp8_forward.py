"""Time a Llama layer's forward with FP8 projections, as the roofline's FP8 forward is checked.

`torch_layers.py`'s Llama 3 8B layer (BF16, local batch 2 x 8192, cuDNN attention),
forward only (`torch.no_grad`), with each of its seven projections computed on FP8
operands as `--precision fp8` plans them: per-tensor current scaling (each tensor's
amax, a scale, a cast to E4M3, for the input and the weight at every call), then
`torch._scaled_mm` (cuBLASLt) with the two inverse scales and a BF16 output; and the
same layer in BF16, in the same run. The median of 5 calls after 2 warm-ups (CUDA
events). The backward (E5M2 gradients) is not timed: it needs a hand-written autograd
function, and the forward alone already holds the quantization passes in question.

With `--compile`, three more rows: each block through `torch.compile` (Inductor fuses
the amax reductions and casts into its own kernels, next to the norms and the SwiGLU
product, as Transformer Engine's fused norm-and-cast kernels do) in BF16, in FP8, and in
FP8 with every weight cast once beforehand (`fp8_cached`: Transformer Engine's weight
cache after a step's first microbatch, `is_first_microbatch`), so that the step from
the emitted kernels to a fused stack is measured, not assumed.

    python benchmarks/torch_fp8_forward.py --out benchmarks/measured/torch_fp8_forward.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from kernel_rates import cuda_seconds  # this folder's: the one CUDA-event timer
from torch import nn
from torch_layers import LlamaBlock, frequencies

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in E4M3 scaled by its own amax, and the inverse scale (per-tensor current
    scaling, Transformer Engine's `Float8CurrentScaling`)."""
    scale = E4M3_MAX / x.abs().amax().float().clamp(min=1e-12)
    return (x.float() * scale).to(torch.float8_e4m3fn), scale.reciprocal()


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose product runs on FP8 operands; with `cached`, its
    weight is cast once here rather than at every call."""

    def __init__(self, linear: nn.Linear, cached: bool) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in]: its transpose is column-major, as cuBLASLt wants
        self.cast = quantized(self.weight.detach()) if cached else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, sx = quantized(rows)
        w8, sw = self.cast if self.cast is not None else quantized(self.weight)
        out = torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=torch.bfloat16)
        return out.reshape(*x.shape[:-1], -1)


def fp8(block: LlamaBlock, cached: bool) -> LlamaBlock:
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        setattr(block, name, Fp8Linear(getattr(block, name), cached))
    return block


# (row name, FP8 projections, weights cast once, through torch.compile)
ROWS = (("bf16", False, False, False), ("fp8", True, False, False))
COMPILED_ROWS = (
    ("bf16_compiled", False, False, True),
    ("fp8_compiled", True, False, True),
    ("fp8_cached_compiled", True, True, True),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also the torch.compile rows")
    args = parser.parse_args()
    batch, seq = 2, 8192
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": "llama3-8b", "batch": batch, "seq": seq, "layers": args.layers}  # fmt: skip
    for row, on_fp8, cached, compiled in ROWS + (COMPILED_ROWS if args.compile else ()):
        torch.manual_seed(0)
        blocks = [LlamaBlock().to("cuda", torch.bfloat16) for _ in range(args.layers)]
        blocks = [fp8(b, cached) for b in blocks] if on_fp8 else blocks
        blocks = [torch.compile(b) for b in blocks] if compiled else blocks
        freqs = frequencies(seq)
        x = torch.randn(batch, seq, 4096, device="cuda", dtype=torch.bfloat16)

        def forward(blocks: list = blocks, x: torch.Tensor = x, freqs: torch.Tensor = freqs):
            with torch.no_grad():
                for block in blocks:
                    x = block(x, freqs)
            return x

        out[f"{row}_fwd_seconds"] = cuda_seconds(forward)
        print(row, out[f"{row}_fwd_seconds"], flush=True)
        del blocks, x
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
