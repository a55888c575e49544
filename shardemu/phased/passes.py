"""Gradient accumulation over passes of a phased pipeline: one pass counted, a step
assembled.

A phased step of a large batch runs it as K passes of one microbatch per replica. Each
stage streams its phases' weights in for every pass, and the stages work on different
passes at once, as pipeline stages work on microbatches (the IPU's pipelined phased
execution). The ledger of one pass (abstract mode) is split per stage into its forward
part (shared-weight fetch aside, which happens once per step), its backward part and the
optimizer updates; the step's ledger then repeats each stage's parts in the order of a
pipeline schedule over K microbatches (`parallel/schedule.py`), with phase tags made
unique per pass so the cost model's dependencies hold pass by pass, and ends with the
updates, once.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from shardemu.accounting.ledger import Event
from shardemu.parallel.schedules import Schedule, make_schedule


def _part(phase: str) -> str:
    if phase.startswith("update"):
        return "update"
    if phase == "shared":
        return "once"
    if phase in ("embed", "head") or phase.startswith("fwd"):
        return "F"
    return "B"  # bwd{i}, bwd-embed, bwd-shared


def accumulate_passes(
    events: list[Event], stages: int, passes: int, schedule: str = "1f1b"
) -> tuple[list[Event], Schedule]:
    """One step's events from one pass's, for `passes` passes on `stages` stages."""
    parts: dict[tuple[str, int], list[Event]] = defaultdict(list)
    for e in events:
        parts[(_part(e.phase), e.stage)].append(e)
    sched = make_schedule(schedule, stages, passes)
    step = [e for s in range(stages) for e in parts[("once", s)]]
    for slot in sorted(sched.slots, key=lambda s: (s.time, s.stage)):
        step += [
            dataclasses.replace(e, phase=f"{e.phase}@{slot.microbatch}")
            for e in parts[(slot.kind, slot.stage)]
        ]
    step += [e for s in range(stages) for e in parts[("update", s)]]
    return step, sched
