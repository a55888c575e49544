"""What a search returns (`search.py`): a `SearchRow` for every layout it judged, with the
`Measures` of its planned (or extrapolated) step, and the `SearchResult` that ranks them;
`pareto`, the memory/time front of the ones that fit. Each `to_json()` is the JSON
`shardemu search` writes to search.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from shardemu.config import ConfigError, Parallelism
from shardemu.errors import CapacityError
from shardemu.predict.layouts import Candidate, Mode, Space
from shardemu.predict.prediction import Prediction

Status = Literal["planned", "extrapolated", "does not fit", "refused", "pruned"]


@dataclass(frozen=True)
class Measures:
    """A step a search row was judged by: its predicted time, bytes per device in each
    tier and whether they fit, throughput, utilisation, the time's breakdown and the
    microbatches (or passes) the plan it came from ran."""

    fits: bool
    step_time_s: float
    device_bytes: int
    host_bytes: int
    tokens_per_s: float
    utilisation: float
    breakdown: dict[str, float]
    planned_microbatches: int

    @classmethod
    def of(cls, prediction: Prediction, microbatches: int) -> Measures:
        memory = prediction.memory_per_device or {}
        return cls(
            fits=all(use.fits for use in memory.values()),
            step_time_s=prediction.step_time_s,
            device_bytes=memory["device"].bytes,
            host_bytes=memory["host"].bytes if "host" in memory else 0,
            tokens_per_s=prediction.tokens_per_s,
            utilisation=prediction.utilisation,
            breakdown=prediction.breakdown,
            planned_microbatches=microbatches,
        )


@dataclass(frozen=True)
class SearchRow:
    """One layout a search judged: its `candidate` (None where a whole mesh and mode
    was pruned before a microbatch size was chosen), `status`, why it was refused or
    pruned, and what it was judged by: `measures` of a planned or extrapolated step;
    `needed_bytes`, the device bytes a layout that does not fit needs; the least
    step time and device bytes the bounds put on a layout pruned without a plan."""

    label: str
    mode: Mode
    par: Parallelism
    precision: str
    status: Status
    candidate: Candidate | None = None
    microbatches: int | None = None
    reason: str | None = None
    measures: Measures | None = None
    needed_bytes: int | None = None
    device_bytes_at_least: int | None = None
    least_step_time_s: float | None = None
    screened_step_time_s: float | None = None  # a top row's step before its full plan

    @classmethod
    def of(cls, c: Candidate, status: Status, **judged: Any) -> SearchRow:
        return cls(c.label, c.mode, c.par, c.precision, status, c, **judged)

    @property
    def fits(self) -> bool:
        return self.measures is not None and self.measures.fits

    @property
    def step_time_s(self) -> float:
        assert self.measures is not None, f"{self.label} was not timed ({self.status})"
        return self.measures.step_time_s

    @property
    def device_bytes(self) -> int | None:
        return self.measures.device_bytes if self.measures else self.needed_bytes

    def to_json(self) -> dict[str, Any]:
        if self.candidate is not None:
            out = {"label": self.label, **self.candidate.settings()}
        else:
            out = {"label": self.label, "mode": self.mode, **dataclasses.asdict(self.par)}
            out["precision"] = self.precision
        if self.microbatches is not None:
            out["microbatches"] = self.microbatches
        out["status"] = self.status
        if self.measures is not None:
            out |= dataclasses.asdict(self.measures)
        elif self.status == "does not fit":
            out["fits"] = False
        extra = {
            "reason": self.reason,
            "device_bytes": self.needed_bytes,
            "device_bytes_at_least": self.device_bytes_at_least,
            "least_step_time_s": self.least_step_time_s,
            "screened_step_time_s": self.screened_step_time_s,
        }
        return out | {k: v for k, v in extra.items() if v is not None}


def pareto(rows: list[SearchRow]) -> list[SearchRow]:
    """The fitting layouts no other beats on both device memory and step time."""
    fitting = sorted((r for r in rows if r.fits), key=lambda r: (r.device_bytes, r.step_time_s))
    front, best = [], float("inf")
    for r in fitting:
        if r.step_time_s < best:
            front.append(r)
            best = r.step_time_s
    return front


@dataclass(frozen=True)
class SearchResult:
    """A search of `model`'s layouts on `devices` x `hardware` for a batch of `batch`
    sequences of `seq`: every row it judged (`candidates`), the `top` fitting ones
    planned whole, fastest first, and how long it took."""

    model: str
    hardware: str
    devices: int
    batch: int
    seq: int
    param_count: int
    space: Space
    top: tuple[SearchRow, ...]
    candidates: tuple[SearchRow, ...]
    elapsed_s: float

    @property
    def best(self) -> SearchRow:
        return self.top[0]

    @property
    def best_candidate(self) -> Candidate:
        assert self.best.candidate is not None
        return self.best.candidate

    @property
    def pareto(self) -> list[SearchRow]:
        return pareto(list(self.candidates))

    @property
    def counts(self) -> dict[str, int]:
        statuses = [r.status for r in self.candidates]
        return {
            "candidates": len(self.candidates),
            "fit": sum(r.fits for r in self.candidates),
            "pruned": statuses.count("pruned"),
            "do_not_fit": statuses.count("does not fit"),
            "refused": statuses.count("refused"),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "devices": self.devices,
            "batch": self.batch,
            "seq": self.seq,
            "param_count": self.param_count,
            "space": dataclasses.asdict(self.space),
            "counts": self.counts,
            "top": [r.to_json() for r in self.top],
            "best": self.best.to_json(),
            "best_candidate": dataclasses.asdict(self.best_candidate),
            "pareto": [r.to_json() for r in self.pareto],
            "candidates": [r.to_json() for r in self.candidates],
            "elapsed_s": self.elapsed_s,
        }


def judged_row(c: Candidate, m: int, measures: Measures, how: Status) -> SearchRow:
    """`c`'s row with the step it was judged by: `how` it was timed, if it fits."""
    return SearchRow.of(
        c, how if measures.fits else "does not fit", microbatches=m, measures=measures
    )


def refusal_row(c: Candidate, m: int, err: CapacityError | ConfigError) -> SearchRow:
    """`c`'s row when its planner refused it: a layout over a memory tier is kept with
    its device bytes (or their lower bound) and not timed (prune 2); a setting the
    planner refuses, with its reason."""
    if not isinstance(err, CapacityError):
        return SearchRow.of(c, "refused", microbatches=m, reason=str(err))
    needed = {"device_bytes_at_least" if err.at_least else "needed_bytes": err.needed}
    return SearchRow.of(c, "does not fit", microbatches=m, reason=str(err), **needed)


def mesh_pruned_row(par: Parallelism, precision: str, mode: Mode, reason: str) -> SearchRow:
    """A whole mesh and mode pruned at one precision (prune 1)."""
    label = f"p{par.pipe} t{par.tensor} r{par.replica} {precision} {mode}"
    return SearchRow(label, mode, par, precision, "pruned", reason=reason)
