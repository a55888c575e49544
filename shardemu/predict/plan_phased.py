"""Abstract mode: a phased training step counted on a mesh of any size, nothing allocated.

The same `PhasedTrainer` that trains for real runs one step on `ShapeDtypeStruct`s
(`stages/executor.py`): weights, optimizer state and batch are shapes with shardings,
transfers and the device tiers' bookkeeping happen on shapes, and only one layer of each
distinct piece is compiled (its counts are reused for every identical layer and every
identical pipeline stage). So GPT-3 175B on 256 virtual devices is planned on a laptop.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Literal

import jax

from shardemu.accounting import flops
from shardemu.accounting.assemble import passes_ledger
from shardemu.accounting.ledger import Event, Ledger
from shardemu.allocation import fewer_collections
from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.errors import CapacityError
from shardemu.models import Model, as_model, param_bytes, param_count
from shardemu.numerics.precision import arithmetic
from shardemu.parallel.mesh import mesh_from
from shardemu.parallel.rules import Rules
from shardemu.parallel.schedules import Schedule, make_schedule
from shardemu.phased import planner
from shardemu.phased.planner import PhasePlan
from shardemu.phased.trainer import PhasedTrainer
from shardemu.predict.durations import least_seconds, stream_of
from shardemu.predict.hardware import Hardware
from shardemu.predict.microbatch import Screen, choose_microbatch
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap
from shardemu.predict.phased_timing import timed_passes
from shardemu.predict.plan import Plan, require_no_experts
from shardemu.predict.prediction import require_fit
from shardemu.predict.roofline import least_training_step

VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def padded_for(model: Model, par: Parallelism) -> Model:
    """The model with its vocabulary padded as Megatron-LM pads it when the tensor axis
    does not divide it: to a multiple of 128 * tensor (Shoeybi et al. 2019; Megatron-LM
    `_vocab_size_with_padding`)."""
    if model.cfg.vocab_size % par.tensor == 0:
        return model
    return model.replace(vocab_size=model.cfg.pad_vocab(VOCAB_MULTIPLE * par.tensor).vocab_size)


def plan_devices(par: Parallelism) -> int:
    """Devices abstract planning needs: one pipeline stage's, tensor * replica (*
    context: each sequence split over it, as the phased engine runs it)."""
    return par.tensor * par.replica * par.context


@fewer_collections()
def plan_phased(
    model: Model | ModelConfig,
    par: Parallelism,
    train_cfg: TrainConfig,
    phased: PhasedConfig,
    rules: Rules | None = None,
    hardware: Hardware | None = None,
    microbatch_size: int | Literal["auto"] | None = None,
    overlap: Overlap = DEFAULT_OVERLAP,
    must_fit: bool = False,
    extrapolate: bool = True,
    band: bool = True,
) -> Plan:
    """Count one phased step in abstract mode (its report is the JSON `shardemu plan
    --json` prints); write nothing.
    The pipeline's stages are planned on one stage's devices (`plan_devices`); a
    vocabulary the tensor axis does not divide is padded (`padded_for`).
    With `hardware`, add the predicted step (`costmodel.py`, its pipeline sends as
    `overlap` says; each phase's gradients reduce after its backward). With
    `microbatch_size` b, the batch runs as passes of b sequences per replica, pipelined
    over the stages (`accounting/assemble.py`, a 1F1B schedule): one pass is counted;
    `"auto"` plans each candidate size on `hardware` and keeps the fastest that fits
    (`predict/microbatch.py`), reported under `microbatch_choice`. With `must_fit`
    and `hardware`, a step over a memory tier raises `CapacityError` before it is
    assembled and timed. A long pipelined step is timed from two short ones
    (`periodic.py`), unless `extrapolate` is False. Needs `plan_devices(par)` JAX
    devices (virtual CPU devices will do)."""
    t0 = time.perf_counter()
    model = as_model(model)
    require_no_experts(par)
    if overlap.tp_overlap != "none":
        raise ConfigError(
            f"Overlap.tp_overlap {overlap.tp_overlap} is for resident plans: a phased step "
            f"computes, then exchanges (bulk-synchronous); use Overlap.tp_overlap none"
        )
    if train_cfg.zero:
        raise ConfigError(
            f"TrainConfig.zero={train_cfg.zero} plans a resident step; a phased plan shards "
            f"the optimizer state over replicas with PhasedConfig.rts_opt (rts')"
        )
    if train_cfg.schedule != "1f1b":
        raise ConfigError(
            f"TrainConfig.schedule {train_cfg.schedule} plans a resident step; a phased "
            f"plan's passes go through the stages 1F1B: use TrainConfig.schedule 1f1b"
        )
    if microbatch_size == "auto":
        if hardware is None:
            raise ConfigError("choosing the microbatch size times each one: give `hardware`")

        def candidate(size: int) -> tuple[dict[str, Any], Plan]:
            planned = _counted(
                model, par, train_cfg, phased, rules, hardware, size, overlap, must_fit,
                extrapolate, band,
            )  # fmt: skip
            return planned.report, planned

        def screen(size: int) -> Screen:
            return _screen(model, par, train_cfg, phased, rules, hardware, size)

        dense = train_cfg.sparsity is None  # sparse layers can beat the dense peak
        _, planned = choose_microbatch(train_cfg.batch, par, candidate, screen if dense else None)
    else:
        planned = _counted(
            model,
            par,
            train_cfg,
            phased,
            rules,
            hardware,
            microbatch_size,
            overlap,
            must_fit,
            extrapolate,
            band,
        )
    planned.report["elapsed_s"] = time.perf_counter() - t0
    return planned


def _counted(
    model: Model,
    par: Parallelism,
    train_cfg: TrainConfig,
    phased: PhasedConfig,
    rules: Rules | None,
    hardware: Hardware | None,
    microbatch_size: int | None,
    overlap: Overlap,
    must_fit: bool = False,
    extrapolate: bool = True,
    band: bool = True,
) -> Plan:
    """`plan_phased`'s work at one microbatch size: the report, the step's ledger and
    (with `hardware`) its timeline, and its band unless `band` is False."""
    given_vocab = model.cfg.vocab_size
    hardware, model, passes, pass_cfg, sched = _setting(
        model, par, train_cfg, hardware, microbatch_size
    )
    # its memory first, by a dry run that lists the pieces the counted pass then compiles
    # two at a time (`planner.dry_run`): a plan that must fit is refused before any is
    _one_pass(model, par, pass_cfg, phased, rules, counting=False)
    if must_fit and hardware is not None:
        _require_fit(model, par, pass_cfg, phased, rules, sched, hardware)
    plan, events = _one_pass(model, par, pass_cfg, phased, rules)
    memory = _memory(plan, sched, phased)
    if phased.weight_streaming and hardware is not None:
        _check_activations_fit(memory["device"], hardware, pass_cfg, par, phased)
    ledger = Ledger(list(events)) if sched is None else passes_ledger(events, sched)
    totals = ledger.step_totals(0)
    analytic = flops.training_step(model, train_cfg.batch, train_cfg.seq)
    shapes, _ = model.abstract_params()
    report = {
        "model": model.name,
        "mesh": str(par),
        "devices": par.num_devices,
        "vocab_size": model.cfg.vocab_size,
        "param_count": param_count(shapes),
        "param_bytes": param_bytes(shapes),
        "batch": train_cfg.batch,
        "seq": train_cfg.seq,
        "tokens_per_step": train_cfg.tokens,
        "precision": train_cfg.precision,
        **totals,
        "model_flops_analytic": analytic,
        "model_flops_rel_err": totals["model_flops"] / analytic - 1,
        "passes": passes,
        "memory_per_device": memory,
        "plan": plan.to_json(),
    }
    if model.cfg.vocab_size != given_vocab:
        report["vocab_padded_from"] = given_vocab
    timeline = prediction = None
    if hardware is not None:
        timeline, prediction = timed_passes(
            events, ledger, sched, hardware, par, train_cfg, model, totals["model_flops"],
            report, overlap, extrapolate, band,
        )  # fmt: skip
    return Plan(report, ledger, timeline, prediction, plan)


def _screen(
    model: Model,
    par: Parallelism,
    train_cfg: TrainConfig,
    phased: PhasedConfig,
    rules: Rules | None,
    hardware: Hardware,
    microbatch_size: int,
) -> Screen:
    """A dense step at `microbatch_size` judged by a dry run for memory alone: its
    device bytes, and a step it cannot beat: its model FLOPs at the profile's rate
    (`roofline.least_step_seconds`), or the busiest stream's transfers (each stage's
    streams run their events one after another, `costmodel.build_timeline`, and the
    counted step moves the same bytes)."""
    hardware, model, _, pass_cfg, sched = _setting(model, par, train_cfg, hardware, microbatch_size)
    plan, events = _one_pass(model, par, pass_cfg, phased, rules, counting=False)

    def busy_of(step: Iterable[Event]) -> dict[tuple[int, str], float]:
        busy: dict[tuple[int, str], float] = defaultdict(float)
        for e in step:
            busy[(e.stage, stream_of(e))] += least_seconds(e, hardware, par)
        return busy

    # each event of the pass as often as the step repeats it, not placed one by one
    busy = busy_of(events) if sched is None else passes_ledger(list(events), sched).summed(busy_of)
    compute = least_training_step(model, train_cfg, par.num_devices, hardware)
    device = _memory(plan, sched, phased)["device"]
    fits = device <= hardware.device_memory_bytes
    return Screen(device, fits, max([compute, *busy.values()]))


def check_fit(
    model: Model,
    par: Parallelism,
    train_cfg: TrainConfig,
    phased: PhasedConfig,
    hardware: Hardware,
    microbatch_size: int | None = None,
    rules: Rules | None = None,
) -> None:
    """Judge a phased layout's step by its memory alone, as `plan_phased(...,
    must_fit=True)` does first: `CapacityError` when it does not fit `hardware`'s
    tiers. When it fits, the pieces its counted plan will count start compiling in
    the background (`planner.count_ahead`): a search judges the next layouts while
    they compile, and plans this one after."""
    hardware, model, _, pass_cfg, sched = _setting(model, par, train_cfg, hardware, microbatch_size)
    _require_fit(model, par, pass_cfg, phased, rules, sched, hardware)
    trainer = _trainer(model, par, pass_cfg, phased, rules)
    planner.count_ahead(trainer, trainer.layout())


def _setting(
    model: Model,
    par: Parallelism,
    train_cfg: TrainConfig,
    hardware: Hardware | None,
    microbatch_size: int | None,
) -> tuple[Hardware | None, Model, int, TrainConfig, Schedule | None]:
    """What a plan at one microbatch size runs: the hardware at the training's
    precision, the model with its vocabulary padded for the mesh, the number of passes,
    one pass's training settings and the passes' pipeline schedule (none for one)."""
    if hardware is not None:
        hardware = hardware.at_precision(arithmetic(model.cfg, train_cfg.precision))
    passes, pass_cfg = _passes(train_cfg, par, microbatch_size)
    sched = make_schedule("1f1b", par.pipe, passes) if passes > 1 else None
    return hardware, padded_for(model, par), passes, pass_cfg, sched


def _require_fit(
    model: Model,
    par: Parallelism,
    pass_cfg: TrainConfig,
    phased: PhasedConfig,
    rules: Rules | None,
    sched: Schedule | None,
    hardware: Hardware,
) -> None:
    """`CapacityError` unless the step's memory, from a dry run of one pass for memory
    alone (which compiles almost nothing), fits `hardware`'s tiers."""
    plan, _ = _one_pass(model, par, pass_cfg, phased, rules, counting=False)
    layout = (
        f"{par} phased in {plan.phases} phases (rts {phased.rts}, activations "
        f"{phased.activations}, optimizer on the {phased.optimizer_on})"
    )
    require_fit(_memory(plan, sched, phased), hardware, layout)


@functools.lru_cache(maxsize=128)
def _one_pass(
    model: Model,
    par: Parallelism,
    pass_cfg: TrainConfig,
    phased: PhasedConfig,
    rules: Rules | None,
    counting: bool = True,
) -> tuple[PhasePlan, tuple[Event, ...]]:
    """One pass counted (the phase plan and its events), once per process for each
    setting: a search and the microbatch choice plan the same pass at several numbers of
    passes. Not `counting`, its memory alone (`planner.dry_run`)."""
    ledger = Ledger()
    plan = _trainer(model, par, pass_cfg, phased, rules).plan(ledger=ledger, counting=counting)
    return dataclasses.replace(plan, step_totals=None), tuple(ledger.events)


@functools.lru_cache(maxsize=64)
def _trainer(
    model: Model,
    par: Parallelism,
    pass_cfg: TrainConfig,
    phased: PhasedConfig,
    rules: Rules | None,
) -> PhasedTrainer:
    """The abstract trainer of one pass: one stage's devices stand for every stage
    (identical stages count the same). Kept for the pass's counted plan after its memory
    alone, and its phase count found once: a search judges two groups of layouts (up
    to 48 settings) before it plans the first group's that fit."""
    stage = dataclasses.replace(par, pipe=1)
    mesh = mesh_from(stage, jax.devices()[: plan_devices(par)])
    return PhasedTrainer(model, mesh, pass_cfg, phased, rules, par.pipe)


def _memory(plan: PhasePlan, sched: Schedule | None, phased: PhasedConfig) -> dict[str, int]:
    """Bytes per device a step of `plan`'s passes in `sched` (one pass without it) holds
    in each tier: the device's peak with the passes in flight, the host's weights and
    optimizer state."""
    device = plan.device_high_water
    if sched is not None:
        device += _in_flight_activations(plan, sched, phased)
    return {"device": device, "host": plan.host_bytes}


def _check_activations_fit(
    device_peak: int,
    hardware: Hardware,
    pass_cfg: TrainConfig,
    par: Parallelism,
    phased: PhasedConfig,
) -> None:
    """Weight streaming keeps a system's activations on its device tier (MISSION.md:
    "activations stay on the wafer"): refuse a pass (`pass_cfg`: the sequences that go
    through the layers together) whose activations do not fit, suggesting only what the
    settings do not already do."""
    capacity = hardware.device_memory_bytes
    if device_peak > capacity:
        per_system = pass_cfg.batch // par.replica
        fixes = [
            "stream fewer sequences at a time (`microbatch_size`)" if per_system > 1 else "",
            "use more systems",
            "PhasedConfig.activations recompute" if phased.activations != "recompute" else "",
        ]
        raise CapacityError(
            f"weight streaming keeps each system's activations on its device: "
            f"{device_peak:,} bytes per system for {per_system} sequences of "
            f"{pass_cfg.seq} at a time, more than {hardware.name}'s {capacity:,}; "
            f"{', or '.join(f for f in fixes if f)}",
            needed=device_peak,
        )


def _passes(
    train_cfg: TrainConfig, par: Parallelism, microbatch_size: int | None
) -> tuple[int, TrainConfig]:
    """How many passes of `microbatch_size` sequences per replica make the batch, and
    the training settings of one pass (the whole batch in one pass without it)."""
    if microbatch_size is None:
        return 1, train_cfg
    per_pass = microbatch_size * par.replica
    if train_cfg.batch % per_pass:
        raise ConfigError(
            f"TrainConfig.batch {train_cfg.batch} is not divisible by `microbatch_size` * replica "
            f"= {per_pass}"
        )
    return train_cfg.batch // per_pass, dataclasses.replace(train_cfg, batch=per_pass)


def _in_flight_activations(plan: PhasePlan, sched: Schedule, phased: PhasedConfig) -> int:
    """Device bytes of the extra passes a stage holds at its peak in the pipeline
    schedule: their kept activations (none when they are offloaded to the host)."""
    if phased.activations == "offload":
        return 0
    per_stage: dict[int, int] = {}
    for row in plan.per_phase:
        per_stage[row.stage] = per_stage.get(row.stage, 0) + row.activation_bytes_per_device
    return max(round((sched.peak_activations(s) - 1) * kept) for s, kept in per_stage.items())
