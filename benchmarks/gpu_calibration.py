"""Measure what the cost model's compute parameters stand for, on a real accelerator.

The roofline (`shardemu/predict/roofline.py`) times a compiled piece from three
numbers per profile: the matmul rate (`peak_tflops * efficiency`), the fixed cost of
one matmul kernel (`matmul_latency_us`: the efficiency curve of small matmuls) and the
memory bandwidth achieved (`memory_gbps * memory_efficiency`). This script measures
them on the accelerator JAX finds, and times GPT layers (forward and backward, one
device) whose predicted times `benchmarks/roofline_check.py` compares with:

- matmuls: m x k x n products in bfloat16 and float32 (JAX's default precision, TF32 on
  NVIDIA tensor cores), 16 chained in one executable so that Python's dispatch is
  not timed; the median of 5 calls after 2 warm-ups;
- bandwidth: y = 2 x + 1 over 64 MiB to 4 GiB (bytes read plus written), one kernel a call;
- layers: `GPTBlock` forward and backward (`jax.vjp`) at several widths and batches,
  with XLA's cost analysis for that backend (FLOPs, bytes accessed);
- memory: the bytes XLA keeps per GPT layer for the backward on that backend (compiled,
  not run), which `benchmarks/memory_check.py` compares with the analytic model.

    python benchmarks/gpu_calibration.py --out benchmarks/results/gpu_calibration.json

It runs anywhere JAX runs; on a CPU the numbers describe the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CHAIN = 8  # loop iterations per call, two matmuls each


def _timed(fn: Any, *args: Any, calls: int = 5) -> float:
    """Median seconds of one call of the compiled `fn` (after two warm-ups)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmuls(dtype: str) -> list[dict[str, Any]]:
    """Seconds per m x k x n matmul: y <- (y @ a) @ b, CHAIN times in one executable."""
    rows = []
    sizes = (64, 256, 1024, 4096, 16384)
    for m in sizes:
        for k in sizes:
            for n in sizes:
                if (m * k + k * n + m * n) * 4 > 2**31:
                    continue
                key = jax.random.key(0)
                x = jax.random.normal(key, (m, k), dtype)
                a = (jax.random.normal(key, (k, n), dtype) / np.sqrt(k)).astype(dtype)
                b = (jax.random.normal(key, (n, k), dtype) / np.sqrt(n)).astype(dtype)

                @jax.jit
                def chain(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
                    return jax.lax.fori_loop(0, CHAIN, lambda _, y: (y @ a) @ b, x, unroll=True)

                seconds = _timed(chain, x, a, b) / (2 * CHAIN)
                flops = 2.0 * m * k * n
                rows.append({
                    "dtype": dtype, "m": m, "k": k, "n": n, "seconds": seconds,
                    "tflops": flops / seconds / 1e12,
                })  # fmt: skip
    return rows


def bandwidth() -> list[dict[str, Any]]:
    """Bytes read and written per second by an elementwise kernel, by array size."""
    rows = []
    for mib in (64, 256, 1024, 4096):  # large enough that dispatch is not timed
        x = jnp.ones((mib * 2**18,), jnp.float32)
        seconds = _timed(jax.jit(lambda x: 2 * x + 1), x, calls=10)  # one kernel: XLA
        # fuses a chain of elementwise ops into one, so each call times a single pass
        moved = 2 * x.nbytes
        rows.append({"bytes": moved, "seconds": seconds, "gbps": moved / seconds / 1e9})
    return rows


def layers(dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> list[dict[str, Any]]:
    """GPT layers forward and backward on one device, timed and cost-analysed."""
    from shardemu.models import custom_model
    from shardemu.models.gpt import GPTBlock

    rows = []
    for hidden, heads in ((768, 12), (1024, 16), (2048, 16), (4096, 32), (8192, 64)):
        for batch in (1, 4):
            for dtype in dtypes:
                cfg = custom_model("gpt", 1, hidden, heads, None, 2048).replace(param_dtype=dtype)
                seq = 2048
                block = GPTBlock(cfg)
                x = jnp.ones((batch, seq, hidden), dtype)
                mask = jnp.tril(jnp.ones((1, seq, seq), dtype=bool))
                params = block.init(jax.random.key(0), x, mask)

                @jax.jit
                def fwd_bwd(params: Any, x: jax.Array, block: Any = block, mask: Any = mask) -> Any:
                    (y, _), vjp = jax.vjp(lambda p, x: block.apply(p, x, mask), params, x)
                    return vjp((jnp.ones_like(y), None))

                compiled = fwd_bwd.lower(params, x).compile()
                cost = compiled.cost_analysis()
                rows.append({
                    "hidden": hidden, "heads": heads, "batch": batch, "seq": seq,
                    "dtype": dtype, "seconds": _timed(compiled, params, x),
                    "xla_flops": float(cost.get("flops", 0.0)),
                    "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                })  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def memory() -> list[dict[str, Any]]:
    """Bytes of temporaries XLA assigns per GPT layer (BF16, sequence 2048) in a
    forward and backward on this backend: the compiled step of 4 layers less that of 2,
    halved, so that what a step holds whatever its depth cancels. Compiled over shapes
    alone, nothing is allocated or run."""
    from shardemu.models import custom_model
    from shardemu.models.gpt import GPTBlock

    rows = []
    for hidden, heads in ((1024, 16), (2048, 16), (4096, 32)):
        for batch in (1, 4):
            seq, dtype = 2048, jnp.bfloat16
            block = GPTBlock(custom_model("gpt", 1, hidden, heads, None, seq).replace(
                param_dtype="bfloat16"))  # fmt: skip
            x = jax.ShapeDtypeStruct((batch, seq, hidden), dtype)
            mask = jax.ShapeDtypeStruct((1, seq, seq), jnp.bool_)
            one = jax.eval_shape(block.init, jax.random.key(0), x, mask)
            temp = {}
            for depth in (2, 4):

                def fwd_bwd(params: Any, x: jax.Array, mask: jax.Array, block: Any = block) -> Any:
                    def stack(params: Any, x: jax.Array) -> jax.Array:
                        for p in params:
                            x, _ = block.apply(p, x, mask)
                        return x

                    y, vjp = jax.vjp(stack, params, x)
                    return vjp(jnp.ones_like(y))

                compiled = jax.jit(fwd_bwd).lower([one] * depth, x, mask).compile()
                temp[depth] = compiled.memory_analysis().temp_size_in_bytes
            rows.append({"hidden": hidden, "heads": heads, "batch": batch, "seq": seq,
                         "dtype": "bfloat16", "temp_bytes": temp,
                         "kept_per_layer": (temp[4] - temp[2]) / 2})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_calibration.json")
    parser.add_argument(
        "--skip", nargs="*", default=(), choices=("matmuls", "bandwidth", "layers", "memory")
    )
    parser.add_argument("--layer-dtypes", nargs="+", default=("bfloat16", "float32"),
                        choices=("bfloat16", "float32"))  # fmt: skip
    args = parser.parse_args()
    device = jax.devices()[0]
    out: dict[str, Any] = {"device": device.device_kind, "platform": device.platform,
                           "jax": jax.__version__}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    sections = {"memory": memory, "bandwidth": bandwidth,
                "layers": lambda: layers(tuple(args.layer_dtypes)),
                "matmuls": lambda: matmuls("bfloat16") + matmuls("float32")}  # fmt: skip
    for name, measure in sections.items():
        if name not in args.skip:
            out[name] = measure()
            Path(args.out).write_text(json.dumps(out, indent=1))  # each section as it ends
            print(f"{name}: written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
