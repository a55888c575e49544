"""Measure the rates of the two kernels the roofline does not time as plain matmuls.

- Fused attention (FlashAttention): one kernel computes softmax(Q K^T) V without
  writing the [s, s] scores, at a rate below a plain matmul's (FlashAttention-2 reaches
  about 35% of an H100's BF16 peak, FlashAttention-3 75%: Shah et al. 2024,
  "FlashAttention-3", abstract). Timed forward and forward+backward, causal and not,
  head width 128, sequences 2k to 128k, through PyTorch's `scaled_dot_product_attention`
  (its FlashAttention-2 and cuDNN backends: what TorchTitan's Llama runs call) and
  JAX's `jax.nn.dot_product_attention(implementation="cudnn")`.
- FP8 matmuls: E4M3 operands, BF16 output, per-tensor scales (`torch._scaled_mm`,
  cuBLASLt: what torchao's float8 training calls), and the same shapes in BF16, so that
  the FP8 speed-up over BF16 is measured in one run (with and without cuBLAS's fast
  accumulation, which torchao uses for the forward's products); JAX's FP8 `dot` likewise.

Each kernel is timed as the median of 5 calls after 2 warm-ups (CUDA events for
PyTorch, the wall clock around `block_until_ready` for JAX). The file holds seconds and
shapes only; what the cost model derives from them is computed in the repository
(`shardemu/predict/profiles.py` cites the file). Each stack runs in its own process
(`--stack`), so that neither allocator holds the other's memory:

    cd benchmarks/measured
    python ../kernel_rates.py --stack torch --out kernel_rates_torch.json
    python ../kernel_rates.py --stack jax --out kernel_rates_jax.json

PyTorch is not a dependency of shardemu: its stack runs where it is installed (the lent
GPU machines have it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HEAD_WIDTH = 128  # Llama 2 / 3's head width (Touvron et al. 2023; Dubey et al. 2024)
HEADS = 32  # Llama 3 8B's query heads
TOKENS = 65536  # batch x sequence of each attention shape (one sequence past it)
SEQUENCES = (2048, 8192, 32768, 131072)
# m x k x n of Llama 3 8B's projections at 16k tokens (h 4096, MLP 14336) and a square one
MATMULS = ((16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (8192, 8192, 8192))


def attention_shapes() -> Iterator[tuple[int, int, bool]]:
    """(batch, sequence, causal): non-causal left out at 128k (its time adds nothing)."""
    for seq in SEQUENCES:
        for causal in (True, False):
            if causal or seq < 131072:
                yield max(1, TOKENS // seq), seq, causal


class Record:
    """The measured rows, written to `path` after each one, so that a run stopped by its
    time limit keeps what it measured; a kernel that fails is recorded with its error."""

    def __init__(self, path: str, header: dict[str, Any]) -> None:
        self.path, self.rows = Path(path), {**header, "attention": [], "matmuls": []}
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(
        self, section: str, shape: dict[str, Any], measure: Callable[[], dict[str, float]]
    ) -> None:
        try:
            row = {**shape, **measure()}
        except Exception as error:  # noqa: BLE001 - a backend that cannot run this shape
            row = {**shape, "error": f"{type(error).__name__}: {error}"[:400]}
        self.rows[section].append(row)
        self.path.write_text(json.dumps(self.rows, indent=1))
        print(row, flush=True)


def _median(seconds: Callable[[], float]) -> float:
    for _ in range(2):
        seconds()
    return statistics.median(seconds() for _ in range(5))


def cuda_seconds(fn: Callable[[], Any]) -> float:
    """Median seconds of `fn` on PyTorch's CUDA device (CUDA events around each call;
    `_median`), what every PyTorch row here and in `torch_layers.py` is timed by."""
    import torch

    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    return _median(once)


def torch_rates(out: str) -> None:
    """Attention and matmul rows through PyTorch on its CUDA device."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    timed = cuda_seconds
    record = Record(out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__})
    for backend, name in (
        (SDPBackend.FLASH_ATTENTION, "flash2"),
        (SDPBackend.CUDNN_ATTENTION, "cudnn"),
    ):
        for batch, seq, causal in attention_shapes():

            def measure(batch: int = batch, seq: int = seq, causal: bool = causal,
                        backend: Any = backend) -> dict[str, float]:  # fmt: skip
                shape = (batch, HEADS, seq, HEAD_WIDTH)
                q, k, v = (
                    torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(3)
                )
                grad = torch.randn_like(q)
                with sdpa_kernel(backend):

                    def fwd() -> Any:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    def fwd_bwd() -> Any:
                        return torch.autograd.grad(fwd(), (q, k, v), grad)

                    return {"fwd_seconds": timed(fwd), "fwd_bwd_seconds": timed(fwd_bwd)}

            record.add("attention", {"impl": f"torch-{name}", "batch": batch, "heads": HEADS,
                                     "seq": seq, "head_width": HEAD_WIDTH, "causal": causal},
                       measure)  # fmt: skip
    for m, k, n in MATMULS:

        def matmul(m: int = m, k: int = k, n: int = n) -> dict[str, float]:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # column-major
            one = torch.ones((), device="cuda")
            a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()

            def fp8(fast: bool) -> float:
                return timed(lambda: torch._scaled_mm(
                    a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast))  # fmt: skip

            return {"bf16_seconds": timed(lambda: a @ b), "fp8_seconds": fp8(False),
                    "fp8_fast_accum_seconds": fp8(True)}  # fmt: skip

        record.add("matmuls", {"m": m, "k": k, "n": n}, matmul)


def jax_rates(out: str) -> None:
    """Attention and matmul rows through JAX on its first device."""
    import jax
    import jax.numpy as jnp

    def timed(fn: Any, *args: Any) -> float:
        def once() -> float:
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            return time.perf_counter() - start

        return _median(once)

    record = Record(out, {"device": jax.devices()[0].device_kind, "jax": jax.__version__})
    for batch, seq, causal in attention_shapes():

        def measure(batch: int = batch, seq: int = seq, causal: bool = causal) -> dict[str, float]:
            shape = (batch, seq, HEADS, HEAD_WIDTH)
            q, k, v, g = (
                jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(4)
            )

            def attend(q: Any, k: Any, v: Any) -> Any:
                return jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn"
                )

            fwd_bwd = jax.jit(lambda q, k, v, g: jax.vjp(attend, q, k, v)[1](g))
            return {"fwd_seconds": timed(jax.jit(attend), q, k, v),
                    "fwd_bwd_seconds": timed(fwd_bwd, q, k, v, g)}  # fmt: skip

        record.add("attention", {"impl": "jax-cudnn", "batch": batch, "heads": HEADS, "seq": seq,
                                 "head_width": HEAD_WIDTH, "causal": causal}, measure)  # fmt: skip
    for m, k, n in MATMULS:

        def matmul(m: int = m, k: int = k, n: int = n) -> dict[str, float]:
            a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
            b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
            a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
            fp8 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
            return {
                "bf16_seconds": timed(jax.jit(jnp.dot), a, b),
                "fp8_seconds": timed(fp8, a8, b8),
            }

        record.add("matmuls", {"m": m, "k": k, "n": n}, matmul)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stack", choices=("torch", "jax"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    (torch_rates if args.stack == "torch" else jax_rates)(args.out)
    print(f"written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
