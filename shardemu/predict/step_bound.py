"""A lower bound of a step's time from its events, none placed: what the search's prune
6 (`search.py`) compares with the layouts it has timed, at a fraction of a timeline's
cost (each slot's list of events summed once, times the slots that run it).

The timeline (`costmodel.py`) runs each stream of a stage one event at a time, so a step
lasts at least any stream's busy time: a stage's computations, each collective axis's
(FSDP's weight gathers, a data-parallel reduction), and, longer than the computations
alone, their chain: in each gap between two computations, the longest collective that
waits for the first and holds the second (a slot's own tensor- or context-parallel
collectives, which read what it computed). Where `Overlap.tp_overlap` chunks
collectives behind the matmuls, their seconds are not the events' own, and the
computations alone bound it.

A pipeline adds its fill and drain: a stage starts its first slot only after the first
microbatch's forward crossed the stages before it (each one's first slot, then its send),
and once the stage's last slot ends, the last microbatch's backward still crosses
them (each one's last slot). So a stage's chain lasts from at least the earlier stages'
first slots' chains to at most the step's end less their last slots' chains
(Narayanan et al. 2021, section 2.2: the (p - 1) slots of 1F1B's bubble), where every
stage's first slot is the same microbatch's forward of its first chunk and its last the
same microbatch's backward of it, as in GPipe, 1F1B and the interleaved schedule.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger import Event
from shardemu.config import Parallelism
from shardemu.parallel.schedules import Slot
from shardemu.predict.costmodel import EventRules, rules_of
from shardemu.predict.durations import rules_key
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap


def busy_streams(
    steps: AssembledLedger,
    hw: Hardware,
    par: Parallelism,
    overlap: Overlap = DEFAULT_OVERLAP,
    lists: dict[int, dict[str, float]] | None = None,
) -> dict[tuple[int, str], float]:
    """Busy seconds of `steps` by (stage, stream; "chain": the computations' chain;
    "pipeline": that chain with the fill and drain before and after it), each a lower
    bound of its step time (module docstring): the search takes the largest. `lists`
    keeps each slot list's seconds by the list's id, for steps that share their lists
    (`resident_step.StepLedgers`) and are kept alive while it is used."""
    chained = overlap.tp_overlap == "none"

    rules: dict[int, EventRules] = {}  # by `rules_key`: the chunks' copies timed once

    def seconds(events: Sequence[Event]) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        gap, after = 0.0, None  # the longest held collective since `after`'s computation
        for e in events:
            key = rules_key(e)
            r = rules.get(id(key))
            if r is None:
                r = rules[id(key)] = rules_of(key, hw, par, overlap)
            if r.stream == "compute":
                out["chain"] += gap + r.seconds
                gap, after = 0.0, e.phase
            elif not chained:
                continue
            elif r.holds and r.after_compute and not r.pipe and e.phase is after:
                gap = max(gap, r.seconds)
            out[r.stream] += r.seconds
        out["chain"] += gap
        return out

    runs = steps.runs()
    slots = list(zip(steps.schedule.in_order, (events for _, _, events in runs[1:-1]), strict=True))
    per_list = {} if lists is None else lists
    for _, events in slots:  # each list once
        if id(events) not in per_list:
            per_list[id(events)] = seconds(events)
    busy: dict[tuple[int, str], float] = defaultdict(float)
    # each list's seconds times the slots that run it on each stage
    for (stage, key), n in Counter((slot.stage, id(events)) for slot, events in slots).items():
        for stream, value in per_list[key].items():
            busy[(stage, stream)] += n * value
    chains = {stage: busy[(stage, "chain")] for stage in range(par.pipe)}  # the slots' alone
    for s, extra in _fill_and_drain(slots, per_list, par.pipe).items():
        busy[(s, "pipeline")] = chains[s] + extra
    for e in (e for _, stage, events in runs if stage is None for e in events):
        for stream, value in seconds((e,)).items():  # before and after the slots
            busy[(e.stage, stream)] += value
    return dict(busy)


def _fill_and_drain(
    slots: list[tuple[Slot, Sequence[Event]]], per_list: dict[int, dict[str, float]], p: int
) -> dict[int, float]:
    """Per stage, the chains of the earlier stages' first and last slots (module
    docstring); none where the schedule's first and last slots are not those."""
    first: dict[int, tuple[Slot, Sequence[Event]]] = {}
    last: dict[int, tuple[Slot, Sequence[Event]]] = {}
    for slot, events in slots:
        first.setdefault(slot.stage, (slot, events))
        last[slot.stage] = (slot, events)
    starts = {(s.kind, s.microbatch, s.chunk) for s, _ in first.values()}
    ends = {(s.kind, s.microbatch, s.chunk) for s, _ in last.values()}
    if len(first) != p or len(starts) != 1 or len(ends) != 1:
        return {}
    (start_kind, _, start_chunk), (end_kind, _, end_chunk) = *starts, *ends
    if (start_kind, start_chunk, end_kind, end_chunk) != ("F", 0, "B", 0):
        return {}
    out, fill, drain = {}, 0.0, 0.0
    for s in range(p):
        out[s] = fill + drain
        fill += per_list[id(first[s][1])].get("chain", 0.0)
        drain += per_list[id(last[s][1])].get("chain", 0.0)
    return out
