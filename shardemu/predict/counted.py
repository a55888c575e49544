"""A ledger counted from any function (`accounting/function.count`) timed on a hardware
profile: the same cost model the planners use (`costmodel.py`), with the precision said
outright, never assumed, since a function's arithmetic is its own.
"""

from __future__ import annotations

from jax.sharding import Mesh

from shardemu.accounting.ledger import Ledger
from shardemu.config import PRECISIONS, ConfigError
from shardemu.parallel.mesh import parallelism_of
from shardemu.predict.costmodel import Timeline
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap
from shardemu.predict.prediction import Prediction, predict


def predict_ledger(
    ledger: Ledger,
    hardware: Hardware,
    *,
    precision: str,
    mesh: Mesh,
    tokens: int = 0,
    model_flops: float | None = None,
    overlap: Overlap = DEFAULT_OVERLAP,
) -> tuple[Timeline, Prediction]:
    """Step 0 of `ledger`, counted on `mesh`, on `hardware` computing at `precision`
    (`fp32`, or a 16-bit one at that width's peak): its timeline and `Prediction`.
    Utilisation is `model_flops` over the peak; without them, every FLOP the ledger
    counts (so it is the hardware FLOPs utilisation). `tokens` per step give tokens/s."""
    if precision not in PRECISIONS:
        raise ConfigError(
            f"`precision` {precision!r} is not one of {', '.join(PRECISIONS)}: the peak the "
            f"counted matmuls run at"
        )
    events = ledger.step(0)
    if not events:
        raise ConfigError("the ledger has no step 0 to time: count a function first")
    flops = ledger.step_totals(0)["flops"] if model_flops is None else model_flops
    hw, par = hardware.at_precision(precision), parallelism_of(mesh)
    return predict(events, hw, par, flops, tokens, overlap=overlap)
