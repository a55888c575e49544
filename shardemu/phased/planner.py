"""Planning a phased run: how many phases, and the phase plan as data.

Every answer comes from a dry run: one step of the phased program (`program.py`) in
abstract mode, on shapes, with device tiers of unbounded capacity that record their
high-water mark. The phase count for a memory budget is the fewest phases whose dry run
fits; the plan's rows say per phase what it stores, gathers, keeps and moves.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardemu.accounting.count import Listed
from shardemu.accounting.ledger import Ledger
from shardemu.accounting.sizes import bytes_per_device
from shardemu.errors import CapacityError, ConfigError
from shardemu.phased.program import StepOutput, run_step
from shardemu.phased.state import Layout
from shardemu.stages.tiers import Tier

if TYPE_CHECKING:
    from shardemu.phased.trainer import PhasedTrainer


def phase_slices(num_layers: int, phases: int, stages: int = 1) -> tuple[tuple[int, int], ...]:
    """[start, end) layers of each phase: equal phases, a whole number per stage."""
    if phases < 1 or num_layers % phases or phases % stages:
        raise ConfigError(
            f"PhasedConfig.phases {phases} must divide the model's {num_layers} layers and be "
            f"a multiple of pipe={stages}; use one of {valid_phase_counts(num_layers, stages)}"
        )
    n = num_layers // phases
    return tuple((i * n, (i + 1) * n) for i in range(phases))


def valid_phase_counts(num_layers: int, stages: int) -> list[int]:
    return [n for n in range(stages, num_layers + 1, stages) if num_layers % n == 0]


@dataclass
class DryRun:
    """One abstract step: its events, the device tiers it used, the program's output."""

    ledger: Ledger
    tiers: list[Tier]
    output: StepOutput
    pieces: list[Listed]  # not counting: what the counted step will count (`Executor`)

    @property
    def device_peak(self) -> int:
        return max(t.high_water for t in self.tiers)


def dry_run(trainer: PhasedTrainer, layout: Layout, counting: bool = True) -> DryRun:
    """One step of `trainer`'s program with `layout`, in abstract mode, once per
    trainer, layout and `counting`. Not counting, it is the step's memory alone: its
    transfers and device tiers, and no computation events; it compiles only the
    pieces that do not declare their outputs' shardings (`Executor.counting`), so a
    layout that does not fit is found out before its pieces are compiled. Counting
    after such a run, its pieces are compiled first, two at a time."""
    key = (layout.slices, counting)
    if key in trainer.dry_runs:
        return trainer.dry_runs[key]
    if counting and (memory := trainer.dry_runs.get((layout.slices, False))) is not None:
        trainer.counter.count_all(memory.pieces)
    ledger = Ledger()
    tiers = [Tier(f"device (stage {s})", None) for s in range(trainer.par.pipe)]
    ex = trainer.executor(ledger, tiers, real=False, counting=counting)
    state = trainer.abstract_state(layout)
    output = run_step(ex, layout, trainer.cfg, state, trainer.abstract_batches())
    run = trainer.dry_runs[key] = DryRun(ledger, tiers, output, ex.pieces)
    return run


def count_ahead(trainer: PhasedTrainer, layout: Layout) -> None:
    """Start compiling in the background the pieces that `layout`'s counted step will
    count, as its dry run for memory alone listed them (`dry_run`): a search judges
    other layouts' memory while they compile."""
    memory = trainer.dry_runs.get((layout.slices, False))
    if memory is None:
        raise ValueError("count_ahead follows a dry run for memory alone of the same layout")
    trainer.counter.count_ahead(memory.pieces)


def fewest_phases_that_fit(trainer: PhasedTrainer, capacity: int) -> int:
    """The largest phases whose step fits `capacity` bytes per device: tried in
    abstract mode, for memory alone, fewest phases first. A phase's backward holds its
    layers' weights gathered on its devices and, beside them, the gradients it writes
    (`PhasedTrainer.backward_bytes_per_layer`), so a count whose phases need more than
    `capacity` for those alone cannot fit and is not dry-run: GPT-3 on a 900 MB IPU fits
    one layer a phase, and counting there took eleven dry runs; at rts 1 not even one
    layer fits (its FP16 weights and gradients over tensor 8 are 906 MB), which is
    known without a dry run."""
    layers, pipe = trainer.model.cfg.num_layers, trainer.par.pipe
    counts = valid_phase_counts(layers, pipe)
    peak, what = 0, "need"
    for n in counts:
        floor = layers // n * trainer.backward_bytes_per_layer
        if floor > capacity:
            peak, what = floor, "need at least (a layer's weights and its gradients)"
            continue
        peak, what = dry_run(trainer, trainer.layout(n), counting=False).device_peak, "need"
        if peak <= capacity:
            return n
    raise CapacityError(
        f"no phase count fits PhasedConfig.device_memory {capacity:,}: even {counts[-1]} "
        f"phases of one layer {what} {peak:,} bytes per device; raise "
        f"PhasedConfig.device_memory, add tensor sharding, use PhasedConfig.rts, or "
        f"PhasedConfig.activations recompute",
        needed=peak,
    )


@dataclass(frozen=True)
class PhaseRow:
    """One phase of a plan: its stage and [start, end) layers, its weights' bytes per
    device as stored and as gathered, the activation bytes it keeps for its backward,
    how often its weights come in per step and what it writes back to the host tier."""

    phase: int
    stage: int
    layers: tuple[int, int]
    fetches: int
    writes: tuple[str, ...]
    weight_bytes_per_device: int
    gathered_bytes_per_device: int
    activation_bytes_per_device: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"layers": list(self.layers), "writes": list(self.writes)}


@dataclass(frozen=True)
class PhasePlan:
    """A phased step as data: the settings it ran with, the device tier's peak, the
    host tier's bytes, a row per phase and the step's ledger totals (`Ledger.
    step_totals`). `to_json` is what `shardemu plan --json` prints under `plan`."""

    phases: int
    layers_per_phase: int
    rts: int
    rts_optimizer: int
    activations: str
    optimizer_on: str
    weight_streaming: bool
    device_memory: int | None
    device_high_water: int
    host_weight_bytes: int
    host_optimizer_bytes: int
    per_phase: tuple[PhaseRow, ...]
    step_totals: dict[str, Any] | None  # None in a plan's report: its totals are the step's

    @property
    def host_bytes(self) -> int:
        """The host tier per device: weights and optimizer state."""
        return self.host_weight_bytes + self.host_optimizer_bytes

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["host_weight_bytes"], out["host_optimizer_bytes"]
        if self.step_totals is None:
            del out["step_totals"]
        host = {"weights": self.host_weight_bytes, "optimizer_state": self.host_optimizer_bytes}
        return out | {
            "host_bytes_per_device": host,
            "per_phase": [row.to_json() for row in self.per_phase],
        }


def phase_rows(trainer: PhasedTrainer, layout: Layout, output: StepOutput) -> tuple[PhaseRow, ...]:
    """A row per phase of `layout`, from its dry run's `output`."""
    cfg, state = trainer.cfg, trainer.abstract_state(layout)
    fetches = (1 if cfg.activations == "keep" else 2) + (cfg.optimizer_on == "device")
    writes = ("gradients",) + (
        ("weights", "optimizer_state") if cfg.optimizer_on == "device" else ()
    )
    return tuple(
        PhaseRow(
            phase=i,
            stage=layout.stage_of(i).index,
            layers=layout.slices[i],
            fetches=fetches,
            writes=writes,
            weight_bytes_per_device=bytes_per_device(state.layers[i]),
            gathered_bytes_per_device=output.forward.gathered_bytes[i],
            activation_bytes_per_device=output.forward.activation_bytes[i],
        )
        for i in range(len(layout.slices))
    )


def plan(trainer: PhasedTrainer, layout: Layout, counting: bool = True) -> tuple[PhasePlan, Ledger]:
    """The phase plan of `layout`, from one dry run, and that step's ledger. Not
    `counting`, its memory alone (`dry_run`): the ledger has no computation."""
    run = dry_run(trainer, layout, counting)
    state, cfg = trainer.abstract_state(layout), trainer.cfg
    report = PhasePlan(
        phases=len(layout.slices),
        layers_per_phase=layout.layers_per_phase,
        rts=cfg.rts,
        rts_optimizer=cfg.rts_opt,
        activations=cfg.activations,
        optimizer_on=cfg.optimizer_on,
        weight_streaming=cfg.weight_streaming,
        device_memory=cfg.device_memory,
        device_high_water=run.device_peak,
        **host_tier_bytes(state, layout),
        per_phase=phase_rows(trainer, layout, run.output),
        step_totals=run.ledger.step_totals(0),
    )
    return report, run.ledger


def host_tier_bytes(state: Any, layout: Layout) -> dict[str, int]:
    """The host tier of a device of the stage holding the most: its own phases' layers
    and their optimizer state, and on the first stage the shared weights, where
    `PhasedTrainer` stores them. (Every stage's layers summed, as before 2026-11-26,
    charged each device a whole pipeline's: GPT-3 on an IPU-POD256 at pipe 8, 76.5 GB
    an IPU against 9.9.)"""
    weights = Counter({0: bytes_per_device(state.shared)})
    optimizer = Counter({0: bytes_per_device(state.opt_shared)})
    for i, (layers, opt) in enumerate(zip(state.layers, state.opt_layers, strict=True)):
        stage = layout.stage_of(i).index
        weights[stage] += bytes_per_device(layers)
        optimizer[stage] += bytes_per_device(opt)
    most = max(weights, key=lambda stage: weights[stage] + optimizer[stage])
    return {"host_weight_bytes": weights[most], "host_optimizer_bytes": optimizer[most]}
