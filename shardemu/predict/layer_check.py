"""One layer timed on the target as a layer measured there is timed: its forward and
backward, nothing recomputed, on one device (`benchmarks/torch_layers_check.py` holds
PyTorch's measured layers to it; `tests/test_roofline.py` two of them)."""

from __future__ import annotations

from shardemu.config import Parallelism
from shardemu.models import Model
from shardemu.predict.hardware import Hardware
from shardemu.predict.resident_count import count_key, counted_microbatch
from shardemu.predict.roofline import compute_seconds


def layer_seconds(model: Model, microbatch_size: int, seq: int, hw: Hardware, precision: str,
                  attention: str) -> float:  # fmt: skip
    """One layer's forward and backward on one device of `hw`, nothing recomputed."""
    key = count_key(model, Parallelism(), microbatch_size, seq, "none", precision, attention)
    pieces = counted_microbatch(key).pieces
    events = pieces["forward"] + pieces["backward"]
    return sum(compute_seconds(e, hw) for e in events if e.kind == "compute")
