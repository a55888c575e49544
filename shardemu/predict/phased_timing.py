"""A phased step's time on the hardware, from its counted passes (`plan_phased.py`):
the whole step's timeline, or a long pipeline of passes timed from two shorter ones
(`periodic.py`), and the numbers the report gives of it.
"""

from __future__ import annotations

from typing import Any

from shardemu.accounting.assemble import repeat_passes
from shardemu.accounting.ledger import Event, Ledger
from shardemu.config import Parallelism, TrainConfig
from shardemu.models import Model
from shardemu.parallel.schedules import Schedule
from shardemu.predict.costmodel import Timeline
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import Overlap
from shardemu.predict.periodic import extrapolated, period_report, timed_step
from shardemu.predict.prediction import Prediction
from shardemu.predict.sparse import model_flops_sparse, sparse_compute, sparse_report


def timed_passes(
    events: list[Event],
    ledger: Ledger,
    sched: Schedule | None,
    hardware: Hardware,
    par: Parallelism,
    train_cfg: TrainConfig,
    model: Model,
    model_flops: float,
    report: dict[str, Any],
    overlap: Overlap,
    extrapolate: bool,
    band: bool = True,
) -> tuple[Timeline, Prediction]:
    """A counted step's timeline and prediction on `hardware`, their numbers added to
    `report`: the whole step's, or a long one's from two shorter steps (`periodic.py`)."""
    tokens, sparse, memory = train_cfg.tokens, train_cfg.sparsity, report["memory_per_device"]

    def events_of(schedule: Schedule | None) -> list[Event]:
        step = ledger.events if schedule is sched else repeat_passes(events, schedule)
        return (
            step if sparse is None else sparse_compute(step, hardware, model, train_cfg.seq, sparse)
        )

    timeline, prediction, short, ms = timed_step(
        events_of, sched, extrapolate, hardware, par, model_flops, tokens, memory, overlap, band
    )
    busy = timeline.stream_totals()
    if ms is not None:  # timed from two short steps, `short` the shorter
        m = sched.microbatches  # type: ignore[union-attr]
        busy = extrapolated(short.stream_totals(), busy, ms, m)  # type: ignore[union-attr]
        report["period"] = period_report(ms, m)
    report["overlap"] = {"pipe_sends": overlap.pipe_sends}  # phases are the buckets
    report.update(prediction.to_json() | sparse_report(hardware, sparse))
    report |= model_flops_sparse(model, tokens, model_flops, sparse)
    report["stream_busy_s"] = {
        f"stage{stage}/{stream}": seconds for (stage, stream), seconds in sorted(busy.items())
    }
    return timeline, prediction
