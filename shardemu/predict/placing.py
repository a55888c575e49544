"""A step's events in the order a timeline places them, with everything that does not
depend on the hardware profile looked up once (`PlacingOrder`).

A plan places each of its steps three times, on its profile and at either end of its
band (`band.py`): the 1T-parameter plan's two short steps hold 66k and 131k events. What
an event waits on is the same on every profile: its stage, its stream, its phase (by
value, numbered), and which event it was placed from (`Event.placed`) or shares its
work with (`durations.rules_key`), whose rules and seconds are the profile's
(`costmodel.rules_of`). Each is numbered here, so that
placing indexes lists where it hashed tuples and `Phase` values for every event.
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
    """A step's events in placing order (`items`, each a `Placed`), the first event
    seen of each origin (`firsts`, whose rules stand for all its copies) and the
    origins themselves, and how many streams (per stage), (phase, stage) pairs, phases
    and stages the items number."""

    items: list[Placed]
    firsts: list[Event]
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


def _order(runs: Sequence[tuple[int | None, int | None, Sequence[Event]]]) -> PlacingOrder:
    origin_of: dict[int, int] = {}  # id(origin) -> its number
    firsts: list[Event] = []
    origins: list[Event] = []
    stream_names: list[str] = []  # each origin's stream
    streams: dict[tuple[int, str], int] = {}
    phase_stages: dict[tuple[int, int], int] = {}
    # phases are waited on by value; each event's is looked up by its object's id and
    # its microbatch (events keep their phases alive) and numbered once per distinct
    # value (`Phase.__hash__` is Python code)
    numbered: dict[Phase, int] = {}
    phase_of: dict[tuple[int, int | None], tuple[int, Phase]] = {}
    items: list[Placed] = []
    stages = 0
    for micro, slot_stage, run in runs:
        for e in run:
            origin = rules_key(e)
            o = origin_of.get(id(origin))
            if o is None:
                o = origin_of[id(origin)] = len(firsts)
                firsts.append(e)
                origins.append(origin)
                stream_names.append(stream_of(e))
            on = e.stage if slot_stage is None else slot_stage
            key = (id(e.phase), micro)
            known = phase_of.get(key)
            if known is None:
                at = e.phase if micro is None else e.phase.at(micro)
                known = phase_of[key] = (numbered.setdefault(at, len(numbered)), at)
            phase, at = known
            stream = streams.setdefault((on, stream_names[o]), len(streams))
            pair = phase_stages.setdefault((phase, on), len(phase_stages))
            items.append((stream, pair, phase, on, o, e, at))
            stages = max(stages, on + 1)
    counts = (len(streams), len(phase_stages), len(numbered), stages)
    return PlacingOrder(items, firsts, origins, *counts)
