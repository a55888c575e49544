"""ledger.json, compact: each distinct piece of work once, and runs that place it.

A step's ledger repeats itself: a plan places the events of one counted microbatch (or
pass) in every slot of its schedule (`assemble.py`), and a run's steps do the same work
step after step. GPT-3 175B planned on an IPU-POD256 places 379k events; written one
dict per event that was a 157 MB file, and most of a plan's time went into writing it.

So the file holds `pieces`, every distinct event with its step, stage and microbatch
left out, and `runs`, each `[step, micro, stage, first, count]`: pieces `first` to
`first + count - 1` happened in that order at that step, microbatch (null outside a
pipeline) and pipeline stage. `read_events` expands it to the events it was written
from (equal, field for field), and `event_json` gives one event's dict, the form of
the earlier format (a plain list of them), which the reader still accepts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from shardemu.accounting.ledger import Event, Matmul, Phase
from shardemu.errors import ShardemuError

FORMAT = "shardemu-ledger"
VERSION = 2
# an event's fields other than the three a run places it by
_BODY = tuple(f for f in Event.__dataclass_fields__ if f not in ("step", "phase", "stage"))


class LedgerFileError(ShardemuError, ValueError):
    """A ledger.json that is not one shardemu wrote."""


def phase_json(phase: Phase) -> dict[str, Any]:
    layers = list(phase.layers) if phase.layers is not None else None
    return {
        "name": str(phase),
        "kind": phase.kind,
        "index": phase.index,
        "layers": layers,
        "micro": phase.micro,
    }


def event_json(event: Event) -> dict[str, Any]:
    """One event as a dict: its fields, its phase's fields and readable `name`."""
    return {"step": event.step, **_piece_json(event), "phase": phase_json(event.phase),
            "stage": event.stage}  # fmt: skip


def _piece_json(event: Event) -> dict[str, Any]:
    """An event without where it was placed: no step, stage or microbatch."""
    phase = phase_json(event.phase)
    del phase["name"], phase["micro"]
    body = {f: getattr(event, f) for f in _BODY}
    body["matmuls"] = [list(m) for m in event.matmuls]
    return {"phase": phase, **body}


def _body_key(event: Event) -> tuple[Any, ...]:
    phase = event.phase
    return (phase.kind, phase.index, phase.layers, *(getattr(event, f) for f in _BODY))


class _Encoder:
    """The pieces and runs of a compact ledger, built event by event or, for the
    events `Event.placed` makes of one list at a microbatch and stage, list by list."""

    def __init__(self) -> None:
        self.pieces: list[Event] = []
        self.by_key: dict[tuple[Any, ...], int] = {}
        self.by_origin: dict[int, int] = {}
        self.by_list: dict[int, tuple[Sequence[Event], list[tuple[int, int]]]] = {}
        self.runs: list[list[Any]] = []

    def index(self, e: Event, origin: Event | None) -> int:
        """`e`'s piece: matched by its origin once per origin, else by its fields."""
        index = self.by_origin.get(id(origin)) if origin is not None else None
        if index is None:
            key = _body_key(e)
            index = self.by_key.get(key)
            if index is None:
                index = self.by_key[key] = len(self.pieces)
                self.pieces.append(e)
            if origin is not None:
                self.by_origin[id(origin)] = index
        return index

    def run(self, where: tuple[Any, ...], first: int, count: int) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and tuple(last[:3]) == where and last[3] + last[4] == first:
            last[4] += count
        else:
            self.runs.append([*where, first, count])

    def event(self, e: Event) -> None:
        self.run((e.step, e.phase.micro, e.stage), self.index(e, e.__dict__.get("_origin")), 1)

    def placed(self, events: Sequence[Event], micro: int, stage: int) -> None:
        """The events `e.placed(micro, stage)` of `events` (each its own origin): their
        pieces found once per list (kept, so that its id stays its own), as runs."""
        known = self.by_list.get(id(events))
        if known is None:
            segments: list[tuple[int, int]] = []
            for e in events:
                i = self.index(e, e)
                if segments and sum(segments[-1]) == i:
                    segments[-1] = (segments[-1][0], segments[-1][1] + 1)
                else:
                    segments.append((i, 1))
            known = self.by_list[id(events)] = (events, segments)
        for first, count in known[1]:  # a list's events are of one step
            self.run((events[0].step, micro, stage), first, count)

    def doc(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "pieces": [_piece_json(p) for p in self.pieces],
            "runs": self.runs,
        }


def encode(events: Iterable[Event]) -> dict[str, Any]:
    """The compact form of `events`, in order. An event placed from another
    (`Event.placed`) is matched to its piece by that origin, once per origin; any other
    by its fields."""
    encoder = _Encoder()
    for e in events:
        encoder.event(e)
    return encoder.doc()


def encode_placed(
    before: Iterable[Event],
    placed: Iterable[tuple[Sequence[Event], int, int]],
    after: Iterable[Event],
) -> dict[str, Any]:
    """`encode` of `before`, then each (events, micro, stage) of `placed` as
    `Event.placed(micro, stage)` would place its events, then `after`: the same
    document, without placing a step's events one by one (`assemble.AssembledLedger`)."""
    encoder = _Encoder()
    for e in before:
        encoder.event(e)
    for events, micro, stage in placed:
        if events:
            encoder.placed(events, micro, stage)
    for e in after:
        encoder.event(e)
    return encoder.doc()


def write_ledger(path: str | Path, events: Iterable[Event] | dict[str, Any]) -> None:
    """`path`, holding `events` (or a document `encode` made of them), written whole to
    a temporary file and renamed over the old one, so a kill mid-write leaves the
    previous ledger."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    doc = events if isinstance(events, dict) else encode(events)
    # orjson: the same JSON as the standard library's, written about ten times faster
    partial.write_bytes(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS) + b"\n")
    partial.replace(path)


def _event(step: int, micro: int | None, stage: int, piece: dict[str, Any]) -> Event:
    p = piece["phase"]
    layers = tuple(p["layers"]) if p["layers"] is not None else None
    phase = Phase(p["kind"], p["index"], layers, micro)
    body = {f: piece[f] for f in _BODY if f in piece}  # a field added since: its default
    # [FLOPs, bytes, FP8, attention, share, fused]; a file written before FP8 has only the
    # first two, one written before causal shares the first four, before fused the five
    body["matmuls"] = tuple(
        Matmul(
            float(m[0]),
            int(m[1]),
            *(bool(x) for x in m[2:4]),
            *(float(x) for x in m[4:5]),
            *(bool(x) for x in m[5:6]),
        )  # fmt: skip
        for m in piece["matmuls"]
    )
    return Event(step=step, phase=phase, stage=stage, **body)


def _from_event_json(row: dict[str, Any]) -> Event:
    """An event of the earlier format (one dict per event)."""
    return _event(row["step"], row["phase"]["micro"], row["stage"], row)


def decode(doc: Any) -> list[Event]:
    """The events a ledger.json's contents hold, in order (either format)."""
    if isinstance(doc, list):
        return [_from_event_json(row) for row in doc]
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise LedgerFileError("not a shardemu ledger (no 'format': 'shardemu-ledger')")
    if doc.get("version") != VERSION:
        raise LedgerFileError(
            f"ledger format version {doc.get('version')!r}; this shardemu reads {VERSION}"
        )
    pieces = doc["pieces"]
    events: list[Event] = []
    for step, micro, stage, first, count in doc["runs"]:
        events += [_event(step, micro, stage, pieces[i]) for i in range(first, first + count)]
    return events


def read_events(path: str | Path) -> list[Event]:
    """The events of the ledger.json at `path`; none if there is no such file."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        return decode(orjson.loads(path.read_bytes()))
    except LedgerFileError as e:
        raise LedgerFileError(f"{path}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise LedgerFileError(f"{path}: not a shardemu ledger ({type(e).__name__}: {e})") from e
