"""A long pipelined step predicted from two short ones, as the search predicts it.

From m = p microbatches on, a 1F1B or interleaved step is its steady state repeated:
each microbatch more adds the same slots to every stage (Narayanan et al. 2021, section
2.2: (m + p - 1) slots of a microbatch; interleaved, a bubble of (p - 1) / v slots). Its
time and each part of its breakdown are then linear in m, so a longer step is timed
from two short ones, of m1 = p and m2 = p + 1 microbatches (1F1B) or g and 2g
(interleaved: microbatches in groups of g, p by default; a step whose last group is
short is planned whole), and extrapolated (`search.py` judges its layouts by the same
rule, from p and 2p). Tests hold every number of the report to the whole
step's (tests/test_periodic.py). The 1T-parameter plan of Narayanan et al. places 526k
events a step; its two short steps, 66k and 131k.

The whole step's ledger is still the plan's (assembled only where it is read:
`assemble.AssembledLedger`); its timeline, for trace.json and timeline.png, is the
longer short step's, and the report's `period` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger import Event
from shardemu.config import Parallelism
from shardemu.parallel.schedules import Schedule, make_schedule
from shardemu.predict.band import band_of
from shardemu.predict.costmodel import (
    Timeline,
    build_timeline,
    compute_busy,
    stage_breakdown,
    step_seconds,
)
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import Overlap
from shardemu.predict.prediction import Prediction, predict, prediction_of

PERIODIC = ("1f1b", "interleaved")


def short_steps(sched: Schedule) -> tuple[int, int] | None:
    """The microbatches (m1, m2) of the short steps a step of `sched` is predicted
    from: p and p + 1 for 1F1B, g and 2g for the interleaved schedule (it repeats
    every group of g microbatches, p by default); None where it is not periodic (an
    interleaved step whose last group is short) or not longer than m2."""
    p, m = sched.stages, sched.microbatches
    if sched.name not in PERIODIC:
        return None
    g = sched.group or p
    if sched.name == "interleaved" and m % g:
        return None
    ms = (p, p + 1) if sched.name == "1f1b" else (g, 2 * g)
    return ms if m > ms[1] else None


def shortened(sched: Schedule, microbatches: int) -> Schedule:
    """`sched`'s schedule over fewer microbatches (`short_steps`)."""
    return make_schedule(sched.name, sched.stages, microbatches, sched.virtual, sched.group)


def extrapolated(a: Any, b: Any, ms: tuple[int, int], m: int) -> Any:
    """The value at `m` of a quantity linear in the microbatches that is `a` at ms[0]
    and `b` at ms[1]: numbers, or dicts of them key by key (integers stay exact)."""
    if isinstance(b, dict):
        return {k: extrapolated(a.get(k, 0), v, ms, m) for k, v in b.items()}
    (m1, m2), steps = ms, m - ms[0]
    if isinstance(a, int) and isinstance(b, int):
        return a + (2 * steps * (b - a) + (m2 - m1)) // (2 * (m2 - m1))  # rounded
    return a + steps * (b - a) / (m2 - m1)


def periodic_prediction(
    steps: Sequence[Sequence[Event] | AssembledLedger],
    ms: tuple[int, int],
    m: int,
    hw: Hardware,
    par: Parallelism,
    model_flops: float,
    tokens: int,
    memory: dict[str, int] | None,
    overlap: Overlap,
    band: bool = True,
) -> tuple[Timeline, Timeline, Prediction]:
    """The timelines of the steps of ms[0] and ms[1] microbatches (`short_steps`), from
    their events, and the prediction of the m-microbatch step: the critical stage is
    the busiest at m, its breakdown each part extrapolated; with its band unless `band`
    is False (four more timelines)."""
    short, long = (build_timeline(events, hw, par, overlap) for events in steps)
    busy = extrapolated(compute_busy(short.spans), compute_busy(long.spans), ms, m)
    stage = max(busy, key=busy.get, default=0)
    parts = [
        stage_breakdown(t.spans, t.step_time_s, stage, b.get(stage, 0.0))
        for t, b in ((short, compute_busy(short.spans)), (long, compute_busy(long.spans)))
    ]
    step = extrapolated(short.step_time_s, long.step_time_s, ms, m)
    breakdown = extrapolated(*parts, ms, m)

    def step_at(profile: Hardware) -> float:
        a, b = (step_seconds(events, profile, par, overlap) for events in steps)
        return extrapolated(a, b, ms, m)

    ends = band_of(step_at, hw, step, (memory or {}).get("device")) if band else None
    prediction = prediction_of(step, breakdown, stage, hw, par, model_flops, tokens, memory, ends)
    return short, long, prediction


def timed_step(
    events_of: Callable[[Schedule | None], Sequence[Event] | AssembledLedger],
    sched: Schedule | None,
    extrapolate: bool,
    hw: Hardware,
    par: Parallelism,
    model_flops: float,
    tokens: int,
    memory: dict[str, int] | None,
    overlap: Overlap,
    band: bool = True,
) -> tuple[Timeline, Prediction, Timeline | None, tuple[int, int] | None]:
    """A step's timeline and prediction, its events those `events_of(schedule)` gives
    for `sched` (None: one pass): the whole step's, or with `extrapolate` a long
    periodic step's from two short ones (`short_steps`); then the shorter step's
    timeline and the short steps' microbatches (None, None when timed whole). `band`:
    whether the prediction holds its band."""
    ms = short_steps(sched) if extrapolate and sched is not None else None
    if sched is None or ms is None:
        timeline, prediction = predict(
            events_of(sched), hw, par, model_flops, tokens, memory, overlap, band
        )
        return timeline, prediction, None, None
    steps = [events_of(shortened(sched, k)) for k in ms]
    short, timeline, prediction = periodic_prediction(
        steps, ms, sched.microbatches, hw, par, model_flops, tokens, memory, overlap, band
    )
    return timeline, prediction, short, ms


def period_report(ms: tuple[int, int], m: int) -> dict[str, Any]:
    """What the report says of a step predicted from shorter ones."""
    return {
        "microbatches": m,
        "predicted_from": list(ms),
        "timeline_microbatches": ms[1],
        "rule": (
            f"from {ms[0]} microbatches on the step is its steady state repeated: its time, "
            f"breakdown and stream busy times extrapolated from the steps of {ms[0]} and "
            f"{ms[1]}; trace.json and timeline.png show the {ms[1]}-microbatch step; the "
            f"counts and ledger.json are the whole step's"
        ),
    }
