"""A layer, or one matmul, timed on the target as one measured there was timed: a
layer's forward and backward, nothing recomputed, on one device
(`benchmarks/torch_layers_check.py` holds PyTorch's measured layers to it;
`tests/test_roofline.py` two of them); an m x k x n matmul as the roofline times it
(`benchmarks/matmul_fit.py` and `tests/test_roofline.py` hold the measured sweep to it)."""

from __future__ import annotations

import math

from shardemu.accounting.ledger import Matmul
from shardemu.config import Parallelism
from shardemu.models import Model
from shardemu.predict.hardware import Hardware
from shardemu.predict.resident_count import count_key, counted_microbatch
from shardemu.predict.roofline import compute_seconds, run_seconds


def layer_seconds(model: Model, microbatch_size: int, seq: int, hw: Hardware, precision: str,
                  attention: str, tensor: int = 1) -> float:  # fmt: skip
    """One layer's forward and backward on one device of `hw`, nothing recomputed: with
    `tensor` > 1, the computations of one of its tensor-parallel shards (Megatron-LM's,
    no sequence parallelism), its collectives left out."""
    par = Parallelism(tensor=tensor)
    key = count_key(model, par, microbatch_size, seq, "none", precision, attention)
    pieces = counted_microbatch(key).pieces
    events = pieces["forward"] + pieces["backward"]
    return sum(compute_seconds(e, hw) for e in events if e.kind == "compute")


# a measured matmul's dtype (`benchmarks/gpu_calibration.py`): the profile's precision
# it runs at (float32 as TF32), and its bytes an element
MATMUL_DTYPES = {"bfloat16": ("bf16", 2), "float32": ("fp32", 4)}


def matmul_seconds(m: int, k: int, n: int, itemsize: int, hw: Hardware) -> float:
    """One [m, k] x [k, n] matmul of `itemsize`-byte elements on a device of `hw`: its
    2 m k n FLOPs and the bytes of its operands and output, nothing else in the run."""
    flops = 2.0 * m * k * n
    return run_seconds(flops, (Matmul(flops, (m * k + k * n + m * n) * itemsize),), 0, hw)


def matmul_log_errors(rows: list[dict], hw: Hardware) -> list[float]:
    """log(predicted / measured) of each measured matmul (`gpu_calibration.py`'s rows:
    dtype, m, k, n, seconds) on `hw` at the row's precision."""
    at = {dtype: (hw.at_precision(precision), itemsize)
          for dtype, (precision, itemsize) in MATMUL_DTYPES.items()}  # fmt: skip
    errors = []
    for r in rows:
        profile, itemsize = at[r["dtype"]]
        predicted = matmul_seconds(r["m"], r["k"], r["n"], itemsize, profile)
        errors.append(math.log(predicted / r["seconds"]))
    return errors
