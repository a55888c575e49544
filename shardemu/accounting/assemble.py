"""One assembler: a step's ledger from counted pieces and a pipeline schedule's slots.

Planners count the work of one microbatch (or one pass) once, as ledger events, and let
the schedule (`parallel/schedules.py`) say when each stage does it. A step is: the
events that happen once per step (`before`: the shared weights coming in), then every
slot of the schedule in time order (stages in order within a time step), each slot's
events tagged with its microbatch and its stage, then the events at the step's end
(`after`: gradient reductions and optimizer updates). The resident planner
(`predict/plan_resident.py`) and the phased planner's pipelined passes
(`predict/plan_phased.py`) both build their steps here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from shardemu.accounting.ledger import Event, Part
from shardemu.parallel.schedules import Schedule, Slot


def assemble(
    schedule: Schedule,
    slot_events: Callable[[Slot], Iterable[Event]],
    before: Iterable[Event] = (),
    after: Iterable[Event] = (),
) -> list[Event]:
    """`before`, then `slot_events(slot)` for each slot in (time, stage) order with its
    phases set to the slot's microbatch and its stage set to the slot's, then `after`."""
    step = list(before)
    for slot in schedule.in_order:
        step += [e.placed(slot.microbatch, slot.stage) for e in slot_events(slot)]
    return step + list(after)


def split_by_part(events: Iterable[Event]) -> dict[tuple[Part, int], list[Event]]:
    """One pass's events by (part of the schedule, stage): what happens once per step,
    in a forward slot, in a backward slot, or in the updates at the end."""
    parts: dict[tuple[Part, int], list[Event]] = defaultdict(list)
    for e in events:
        parts[(e.phase.part, e.stage)].append(e)
    return parts


def repeat_passes(events: list[Event], schedule: Schedule) -> list[Event]:
    """A step of `schedule.microbatches` passes from one pass's events: each stage's
    forward and backward parts repeated in the schedule's slots (the stages work on
    different passes at once, as pipeline stages work on microbatches: the IPU's
    pipelined phased execution), the shared-weight fetch before, the updates after,
    once each."""
    parts = split_by_part(events)
    stages = range(schedule.stages)
    return assemble(
        schedule,
        lambda slot: parts[(slot.kind, slot.stage)],
        before=[e for s in stages for e in parts[("once", s)]],
        after=[e for s in stages for e in parts[("update", s)]],
    )
