"""A step's events in the order a timeline places them, with everything that does not
depend on the hardware profile looked up once (`PlacingOrder`).

A plan places each of its steps three times, on its profile and at either end of its
band (`band.py`): the 1T-parameter plan's two short steps hold 66k and 131k events. What
an event waits on is the same on every profile: its stage, its stream, its phase (by
value), and the event whose rules it has (`durations.rules_key`: the one it was placed
from or shares its work with), whose stream and seconds are the profile's
(`costmodel.rules_of`). Each is numbered here once, so that placing indexes lists where
it hashed tuples and `Phase` values for every event.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger import Event, Phase
from shardemu.predict.durations import rules_key, stream_of

# one event to place: (its stream's number (per stage), its (phase, stage) number, its
# phase's number, its stage, its origin's number, the event, its phase at its microbatch)
Placed = tuple[int, int, int, int, int, Event, Phase]


@dataclass(frozen=True, eq=False)
class PlacingOrder:
    """A step's events in placing order (`items`, each a `Placed`), the events whose
    rules they have (`origins`, by number: `durations.rules_key`), and how many streams
    (per stage), (phase, stage) pairs, phases and stages the items number."""

    items: list[Placed]
    origins: list[Event]
    streams: int
    phase_stages: int
    phases: int
    stages: int


# an assembled step's order, kept while the step lives: placed on three profiles
_ORDERS: weakref.WeakKeyDictionary[AssembledLedger, PlacingOrder] = weakref.WeakKeyDictionary()


def placing_order(events: Sequence[Event] | AssembledLedger) -> PlacingOrder:
    """`events`' `PlacingOrder`: an assembled step's slots as they are, each event set
    to its slot's microbatch and stage (never copied), or the events in program order;
    an assembled step's order made once."""
    if isinstance(events, AssembledLedger):
        order = _ORDERS.get(events)
        if order is None:
            order = _ORDERS[events] = _order(events.runs())
        return order
    return _order([(None, None, events)])


class _Numbering:
    """The numbers `_order` gives: origins (by `rules_key`), streams per stage, phases by
    value, and (phase, stage) pairs."""

    def __init__(self) -> None:
        self.origin_of: dict[int, int] = {}  # id(rules_key) -> its number
        self.origins: list[Event] = []
        self.streams: dict[tuple[int, str], int] = {}
        self.pairs: dict[tuple[int, int], int] = {}
        # phases are waited on by value; each event's is looked up by its object's id
        # and its microbatch (events keep their phases alive) and numbered once per
        # distinct value (`Phase.__hash__` is Python code)
        self.numbered: dict[Phase, int] = {}
        self.phase_of: dict[tuple[int, int | None], tuple[int, Phase]] = {}

    def template(self, run: Sequence[Event], slot_stage: int | None) -> list[tuple]:
        """(stream, stage, origin, event) of each event of `run` on `slot_stage` (None:
        each event's own stage): what does not change with the microbatch."""
        out = []
        for e in run:
            key = rules_key(e)
            o = self.origin_of.get(id(key))
            if o is None:
                o = self.origin_of[id(key)] = len(self.origins)
                self.origins.append(key)
            on = e.stage if slot_stage is None else slot_stage
            stream = self.streams.setdefault((on, stream_of(key)), len(self.streams))
            out.append((stream, on, o, e))
        return out

    def phase(self, e: Event, micro: int | None, on: int) -> tuple[int, int, Phase]:
        """(phase number, (phase, stage) number, the phase at `micro`) of `e` on `on`."""
        key = (id(e.phase), micro)
        known = self.phase_of.get(key)
        if known is None:
            at = e.phase if micro is None else e.phase.at(micro)
            known = self.phase_of[key] = (self.numbered.setdefault(at, len(self.numbered)), at)
        phase, at = known
        return phase, self.pairs.setdefault((phase, on), len(self.pairs)), at


def _order(runs: Sequence[tuple[int | None, int | None, Sequence[Event]]]) -> PlacingOrder:
    """The order of `runs`: each list's template made once per stage it runs on (a
    step's slots share a few lists over every microbatch), and within a run each
    distinct (phase, stage) numbered once (a slot's events share its phase)."""
    n = _Numbering()
    templates: dict[tuple[int, int | None], list[tuple]] = {}
    items: list[Placed] = []
    for micro, slot_stage, run in runs:
        template = templates.get((id(run), slot_stage))
        if template is None:
            template = templates[(id(run), slot_stage)] = n.template(run, slot_stage)
        local: dict[tuple[int, int], tuple[int, int, Phase]] = {}
        for stream, on, o, e in template:
            phased = local.get((id(e.phase), on))
            if phased is None:
                phased = local[(id(e.phase), on)] = n.phase(e, micro, on)
            phase, pair, at = phased
            items.append((stream, pair, phase, on, o, e, at))
    stages = 1 + max((on for on, _ in n.streams), default=-1)
    counts = (len(n.streams), len(n.pairs), len(n.numbered), stages)
    return PlacingOrder(items, n.origins, *counts)
