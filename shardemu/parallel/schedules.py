"""Pipeline schedules as data: who runs what, when.

Each device (pipeline stage) runs an ordered program of forward (F) and backward (B)
operations on microbatches; `simulate` places them in time with unit durations under
the pipeline's dependencies (F of virtual stage j needs F of j-1 for that microbatch; B
of j needs B of j+1, and the last virtual stage's B needs its own F). Everything else
(bubble, activations held, transfers) is read off the resulting slot list, so the
formulas below are checks, not inputs:

- GPipe (Huang et al. 2019): all forwards, then all backwards. Bubble (p-1)/(m+p-1),
  each stage holds m microbatches of activations.
- 1F1B (PipeDream-Flush; Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training"): p-s-1 warm-up forwards on stage s, then one forward one backward. Same
  bubble, but stage s holds at most min(p-s, m) microbatches.
- Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters", Section 2.2.2): each device holds v model chunks (virtual
  stages s, s+p, ...); ops take 1/v of the time, bubble (p-1)/(v m + p - 1). Needs m
  divisible by p (Megatron-LM's requirement). A chunk runs a group of g microbatches
  before the device moves to its next chunk: g = p by default (depth-first), or any g
  from p to m (Megatron-Core's `microbatch_group_size_per_vp_stage`,
  `pipeline_parallel/schedules.py::get_schedule_table`), which Llama 3 used "to hide
  point-to-point communication" (Dubey et al. 2024, §3.3.2): more microbatches in
  flight between a chunk's forward and its next chunk's, and more warm-up forwards,
  (v - 1) g, held.

Symbols: p stages (devices), m microbatches, v virtual stages (chunks) per device, g
microbatches a group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Literal

from shardemu.config import SCHEDULES, ConfigError

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Slot:
    """One operation: at `time` (in op durations), `stage` (device) runs `kind` for
    `microbatch` on its model chunk `chunk` (virtual stage chunk * p + stage)."""

    time: int
    stage: int
    microbatch: int
    kind: Kind
    chunk: int = 0


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    microbatches: int
    virtual: int
    slots: tuple[Slot, ...]
    group: int | None = None  # interleaved: microbatches a chunk runs in turn (p by default)

    @cached_property
    def makespan(self) -> int:
        """Time slots from the first op to the last."""
        return 1 + max(s.time for s in self.slots)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of each device's time (every device does 2 m v ops)."""
        busy = 2 * self.microbatches * self.virtual
        return 1 - busy / self.makespan

    @cached_property
    def in_order(self) -> tuple[Slot, ...]:
        """The slots in time order, stages in order within a time step."""
        return tuple(sorted(self.slots, key=lambda s: (s.time, s.stage)))

    @cached_property
    def _peaks(self) -> dict[int, int]:
        held: dict[int, int] = dict.fromkeys(range(self.stages), 0)
        peak = dict(held)
        for slot in self.in_order:
            held[slot.stage] += 1 if slot.kind == "F" else -1
            peak[slot.stage] = max(peak[slot.stage], held[slot.stage])
        return peak

    def peak_activations(self, stage: int) -> float:
        """Most microbatches' activations `stage` holds at once (F done, B not yet), in
        units of a whole stage's activations (a chunk holds 1/v of them)."""
        return self._peaks.get(stage, 0) / self.virtual

    @property
    def p2p_transfers(self) -> int:
        """Point-to-point sends between devices: each F but the last virtual stage's
        sends activations on, each B but the first's sends gradients back."""
        last = self.stages * self.virtual - 1
        return (
            sum(
                1
                for s in self.slots
                if (s.kind == "F" and self.virtual_stage(s) < last)
                or (s.kind == "B" and self.virtual_stage(s) > 0)
            )
            if self.stages > 1
            else 0
        )

    def virtual_stage(self, slot: Slot) -> int:
        return slot.chunk * self.stages + slot.stage


Op = tuple[Kind, int, int]  # (kind, microbatch, chunk)


def programs(name: str, p: int, m: int, v: int, group: int | None = None) -> list[list[Op]]:
    """Each device's ordered operations (kind, microbatch, chunk): what it runs, not when
    (`group`: the interleaved schedule's g, p by default)."""
    if name == "gpipe":
        return [
            [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in reversed(range(m))]
            for _ in range(p)
        ]
    if name == "1f1b":
        v = 1
    # 1F1B and interleaved: Megatron-Core's order (`pipeline_parallel/schedules.py`:
    # `get_schedule_table`, `get_pp_rank_microbatches`): the k-th forward on a device is
    # the k-th (microbatch, chunk) of a table that runs each group of g microbatches
    # through chunk 0, then chunk 1, ... (the last group holds what is left); the k-th
    # backward is the same entry with its chunks in reverse. Warm-up: (p - s - 1) * 2 +
    # (v - 1) g forwards (p - s - 1 when v = 1). With g = p and m a multiple of p, the
    # k-th forward is microbatch (k // (p v)) p + k % p of chunk (k // p) % v: Megatron-
    # LM's 2021 order (forward_backward_pipelining_with_interleaving).
    g, total = group or p, m * v
    table = [
        (mb, chunk)
        for start in range(0, m, g)
        for chunk in range(v)
        for mb in range(start, min(start + g, m))
    ]

    fwd: list[Op] = [("F", mb, c) for mb, c in table]
    bwd: list[Op] = [("B", mb, v - 1 - c) for mb, c in table]
    programs = []
    for s in range(p):
        warm = min(total, (p - s - 1) * 2 + (v - 1) * g if v > 1 else p - s - 1)
        ops = fwd[:warm]
        for k in range(total - warm):
            ops += [fwd[warm + k], bwd[k]]
        ops += bwd[total - warm :]
        programs.append(ops)
    return programs


def simulate(programs: list[list[Op]], p: int, v: int) -> list[Slot]:
    """Place each device's program in time: an op starts at the first time step after
    its dependencies finished and its device's previous op ended. (A forward waits for
    its microbatch's forward on the virtual stage before; a backward for its own
    forward and the backward on the virtual stage after. Written out rather than as
    lists of dependencies: the 1T plan's 512-microbatch schedule steps 139k times.)"""
    last_virtual = p * v - 1
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, microbatch, virtual stage) -> end
    never = math.inf  # the end of an op not done
    pointers = [0] * p
    free_at = [0] * p
    slots: list[Slot] = []
    remaining = total = sum(len(prog) for prog in programs)
    time = 0
    while remaining:
        finished_now = []
        for s in range(p):
            if pointers[s] == len(programs[s]) or free_at[s] > time:
                continue
            kind, mb, chunk = programs[s][pointers[s]]
            j = chunk * p + s
            if kind == "F":
                ready = j == 0 or done.get(("F", mb, j - 1), never) <= time
            else:
                ready = done.get(("F", mb, j), never) <= time and (
                    j == last_virtual or done.get(("B", mb, j + 1), never) <= time
                )
            if ready:
                slots.append(Slot(time, s, mb, kind, chunk))
                finished_now.append(((kind, mb, j), time + 1))
                free_at[s] = time + 1
                pointers[s] += 1
                remaining -= 1
        done.update(finished_now)
        time += 1
        if time > 10 * (total + p):
            raise RuntimeError("pipeline schedule deadlocked: a program order is invalid")
    return slots


@lru_cache(maxsize=512)
def make_schedule(
    name: str, stages: int, microbatches: int, virtual: int = 1, group: int | None = None
) -> Schedule:
    """The schedule `name` for p stages, m microbatches, v chunks per device and, for
    the interleaved schedule, groups of `group` microbatches (p when None); made once
    per process: a search plans each schedule for several layouts."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise ConfigError(
            f"schedule needs positive stages, microbatches and virtual stages, got "
            f"{stages}, {microbatches}, {virtual}"
        )
    if name != "interleaved" and virtual != 1:
        raise ConfigError(f"{name} has one chunk per device; virtual stages need 'interleaved'")
    if name == "interleaved" and virtual == 1:
        raise ConfigError(
            "interleaved 1F1B needs TrainConfig.virtual >= 2 model chunks per stage (with one "
            "chunk it is plain 1f1b); use TrainConfig.virtual 2, or TrainConfig.schedule 1f1b"
        )
    if group is not None:
        _check_group(name, stages, microbatches, group)
    elif name == "interleaved" and microbatches % stages:
        fix = stages * -(-microbatches // stages)
        raise ConfigError(
            f"interleaved 1F1B needs microbatches divisible by stages (Megatron-LM's rule), "
            f"got m={microbatches}, p={stages}; use TrainConfig.microbatches {fix}"
        )
    slots = simulate(programs(name, stages, microbatches, virtual, group), stages, virtual)
    resolved = (group or stages) if name == "interleaved" else None
    return Schedule(name, stages, microbatches, virtual, tuple(slots), resolved)


def _check_group(name: str, p: int, m: int, g: int) -> None:
    """Megatron-Core's rules for its microbatch group (`schedules.py::
    forward_backward_pipelining_with_interleaving`): p <= g <= m, and a last group of
    at least p microbatches where g does not divide m (fewer would wait on each other)."""
    if name != "interleaved":
        raise ConfigError(
            f"TrainConfig.microbatch_group {g} groups an interleaved schedule's microbatches; "
            f"{name} has one chunk per stage: leave it out, or use TrainConfig.schedule "
            f"interleaved"
        )
    if not p <= g <= m:
        raise ConfigError(
            f"TrainConfig.microbatch_group {g} must lie between the {p} stages and the {m} "
            f"microbatches (Megatron-Core's rule)"
        )
    if 0 < m % g < p:
        raise ConfigError(
            f"TrainConfig.microbatch_group {g} leaves a last group of {m % g} of the {m} "
            f"microbatches, fewer than the {p} stages (Megatron-Core refuses it: its "
            f"microbatches would wait on each other); use a group that divides {m}, or "
            f"leaves at least {p}"
        )
