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

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from shardemu.accounting.ledger import Event, Ledger, Part, totals
from shardemu.accounting.ledger_file import encode_placed
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


class AssembledLedger(Ledger):
    """The ledger `assemble` makes, assembled when its events are first read: a plan
    whose prediction comes from shorter steps (`predict/periodic.py`) places its whole
    step's events only for a caller that reads them, and `compact` writes its
    ledger.json without placing them."""

    def __init__(
        self,
        schedule: Schedule,
        slot_events: Callable[[Slot], Sequence[Event]],
        before: Iterable[Event] = (),
        after: Iterable[Event] = (),
    ) -> None:
        self._schedule, self._slot_events = schedule, slot_events
        self._before, self._after = list(before), list(after)
        self._events: list[Event] | None = None

    @property
    def events(self) -> list[Event]:  # type: ignore[override]
        if self._events is None:
            self._events = assemble(self._schedule, self._slot_events, self._before, self._after)
        return self._events

    @property
    def schedule(self) -> Schedule:
        """The schedule whose slots `runs` gives, in its time order."""
        return self._schedule

    def runs(self) -> list[tuple[int | None, int | None, Sequence[Event]]]:
        """The step as runs of (microbatch, stage, events): `before` and `after` as they
        are (None, None), each slot's events with its microbatch and stage, none of them
        placed (a timeline sets each event's microbatch and stage as it goes:
        `costmodel.build_timeline`)."""
        slots = [(s.microbatch, s.stage, self._slot_events(s)) for s in self._schedule.in_order]
        return [(None, None, self._before), *slots, (None, None, self._after)]

    def step_totals(self, step: int) -> dict[str, Any]:
        """`Ledger.step_totals`, each slot's events totalled once per list of them
        (`summed`), not placed."""
        return self.summed(lambda events: totals(e for e in events if e.step == step))

    def summed(self, fn: Callable[[Sequence[Event]], Any]) -> Any:
        """The sum of `fn` (a number, or a dict of numbers or of such dicts) over the
        step's events, which `fn` adds up: over the placed events once read, else each
        slot's list once, times the slots that place it."""
        if self._events is not None:
            return fn(self._events)
        slots = [self._slot_events(s) for s in self._schedule.in_order]
        times = Counter(id(events) for events in slots)
        lists = {id(events): events for events in slots}
        out = _plus(fn(self._before), fn(self._after))
        for key, events in lists.items():
            out = _plus(out, fn(events), times[key])
        return out

    def compact(self) -> dict[str, Any]:
        """ledger.json's document of these events (`ledger_file.encode`): the slots'
        runs (`runs`), none placed."""
        slots = self.runs()[1:-1]
        placed = ((events, micro, stage) for micro, stage, events in slots)
        return encode_placed(self._before, placed, self._after)


def repeat_passes(events: list[Event], schedule: Schedule) -> list[Event]:
    """A step of `schedule.microbatches` passes from one pass's events: each stage's
    forward and backward parts repeated in the schedule's slots (the stages work on
    different passes at once, as pipeline stages work on microbatches: the IPU's
    pipelined phased execution), the shared-weight fetch before, the updates after,
    once each."""
    return passes_ledger(events, schedule).events


def passes_ledger(events: list[Event], schedule: Schedule) -> AssembledLedger:
    """`repeat_passes`, assembled when its events are first read."""
    parts = split_by_part(events)
    stages = range(schedule.stages)
    return AssembledLedger(
        schedule,
        lambda slot: parts[(slot.kind, slot.stage)],
        before=[e for s in stages for e in parts[("once", s)]],
        after=[e for s in stages for e in parts[("update", s)]],
    )


def split_by_part(events: Iterable[Event]) -> dict[tuple[Part, int], list[Event]]:
    """One pass's events by (part of the schedule, stage): what happens once per step,
    in a forward slot, in a backward slot, or in the updates at the end."""
    parts: dict[tuple[Part, int], list[Event]] = defaultdict(list)
    for e in events:
        parts[(e.phase.part, e.stage)].append(e)
    return parts


def _plus(a: Any, b: Any, times: int = 1) -> Any:
    """a + times * b, for numbers or (nested) dicts of them key by key."""
    if isinstance(b, dict):
        return {k: _plus(a.get(k, 0), b.get(k, 0), times) for k in {**a, **b}}
    return a + times * b
