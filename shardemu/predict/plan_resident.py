"""Abstract mode for resident training: weights and optimizer state stay on the devices,
microbatches flow through a pipeline schedule, gradients are all-reduced over `replica`.

The work of one microbatch is counted, not guessed: the phased planner's abstract step
on one pipeline stage's tensor devices (replica = 1, one layer a phase, activations kept,
or recomputed with `recompute="full"`, optimizer on the device) gives, per layer, the
forward and backward FLOPs and the tensor-parallel collectives XLA emits, and the
embedding, head and optimizer pieces likewise. A step's ledger is then assembled from
the schedule's slots (`parallel/schedule.py`): each F or B slot is its chunk's layers'
events, the first and last virtual stages add the embedding and head, and activations
(or their gradients) cross to the neighbouring stage point to point over `pipe`. After
its last backward each stage all-reduces its gradients over `replica` (ring: each device
sends 2 (r-1)/r of them; Thakur et al. 2005) and runs its optimizer update. Every event
is scaled to the stage's r * t devices (replicas do identical work). The cost model then
places the events (`costmodel.py`), so the pipeline bubble, exposed communication and
the data-parallel all-reduce come out of the timeline.

Memory per device: weights, gradients and two Adam moments (4x the stage's weight bytes)
plus the activations of the microbatches a stage holds at its peak (from the schedule)
times its layers' kept bytes (residuals, or only the layer inputs with recomputation).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

import jax
import jax.numpy as jnp

from shardemu.accounting import flops
from shardemu.accounting.ledger import Event, Ledger
from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.models import Model, param_count
from shardemu.parallel.mesh import mesh_from
from shardemu.parallel.schedules import make_schedule
from shardemu.phased.trainer import PhasedTrainer
from shardemu.predict.costmodel import Timeline, predict
from shardemu.predict.hardware import Hardware
from shardemu.predict.plan_phased import padded_for

Recompute = Literal["none", "selective", "full"]


def _scaled(e: Event, factor: float, replica: int, **changes: Any) -> Event:
    """`e` repeated `factor` times (layers of a chunk) on `replica` times the devices."""
    return dataclasses.replace(
        e,
        flops=e.flops * factor * replica,
        recompute_flops=e.recompute_flops * factor * replica,
        bytes=round(e.bytes * factor * replica),
        devices=e.devices * replica,
        **changes,
    )


def _pieces(events: list[Event]) -> dict[str, list[Event]]:
    """Compute and collective events of one microbatch by phase (transfers dropped:
    resident weights never leave the device)."""
    out: dict[str, list[Event]] = {}
    for e in events:
        if e.kind in ("compute", "collective"):
            out.setdefault(e.phase, []).append(e)
    return out


def _selective(
    pieces: dict[str, list[Event]], cfg: ModelConfig, par: Parallelism, b: int, seq: int,
    keep: int,
) -> int:  # fmt: skip
    """Selective recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation
    in Large Transformer Models", Section 4.2): keep everything but the attention core's
    s x s scores and probabilities, and recompute that core (Q K^T and probs V) in the
    backward pass. Adds its forward FLOPs (flops.py) to each layer's backward and returns
    the bytes a layer keeps per device without the two [b, A/t, s, s] tensors."""
    core = flops.layer_forward(cfg, b, seq)
    extra = core["attn_scores"] + core["attn_context"]
    backward = next(e for e in pieces["bwd0"] if e.kind == "compute")
    pieces["bwd0"] = [
        dataclasses.replace(e, flops=e.flops + extra, recompute_flops=e.recompute_flops + extra)
        if e is backward
        else e
        for e in pieces["bwd0"]
    ]
    itemsize = jnp.dtype(cfg.param_dtype).itemsize
    return max(keep - 2 * b * (cfg.num_heads // par.tensor) * seq * seq * itemsize, 0)


def plan_resident(
    model_cfg: ModelConfig,
    par: Parallelism,
    batch: int,
    seq: int,
    microbatch_size: int,
    hardware: Hardware,
    schedule: str = "1f1b",
    virtual: int = 1,
    recompute: Recompute = "full",
) -> tuple[dict[str, Any], Ledger, Timeline]:
    """Predict a resident (pipelined) step of `batch` sequences on `hardware`: the
    report, the step's ledger and its timeline. Needs `par.tensor` JAX devices (one
    stage's tensor group)."""
    t0 = time.perf_counter()
    model_cfg = padded_for(model_cfg, par)
    if recompute not in ("none", "selective", "full"):
        raise ConfigError(f"--recompute must be none, selective or full, got {recompute!r}")
    per_step = par.replica * microbatch_size
    if batch % per_step:
        raise ConfigError(
            f"--batch {batch} is not divisible by replica * --microbatch-size = {per_step}"
        )
    m = batch // per_step
    p, v, L = par.pipe, virtual, model_cfg.num_layers
    if L % (p * v):
        raise ConfigError(f"{L} layers do not split into pipe * virtual = {p * v} equal chunks")
    sched = make_schedule(schedule, p, m, v)
    per_chunk = L // (p * v)

    # one microbatch on one stage's tensor group, one layer a phase
    stage_par = Parallelism(tensor=par.tensor)
    mesh = mesh_from(stage_par, jax.devices()[: par.tensor])
    activations = "recompute" if recompute == "full" else "keep"
    phased = PhasedConfig(phases=L, activations=activations, optimizer_on="device")
    model = Model(model_cfg)
    trainer = PhasedTrainer(model, mesh, TrainConfig(batch=microbatch_size, seq=seq), phased)
    counted = Ledger()
    plan = trainer.plan(ledger=counted)
    pieces = _pieces(counted.events)
    row = plan["per_phase"][0]
    keep = row["activation_bytes_per_device"]  # per layer: residuals, or the layer input
    if recompute == "selective":
        keep = _selective(pieces, model_cfg, par, microbatch_size, seq, keep)
    layer_bytes = row["gathered_bytes_per_device"]
    shared_bytes = plan["host_bytes_per_device"]["weights"] - L * layer_bytes

    r, events = par.replica, []
    last_b: dict[int, str] = {}
    for slot in sorted(sched.slots, key=lambda s: (s.time, s.stage)):
        tag, s, vs = f"{slot.kind}{slot.microbatch}", slot.stage, sched.virtual_stage(slot)
        if slot.kind == "F":
            names = (["embed"] if vs == 0 else []) + ["fwd0"]
            names += ["head"] if vs == p * v - 1 else []
            send = vs < p * v - 1
        else:
            names = ["bwd0"] + (["bwd-embed"] if vs == 0 else [])
            send = vs > 0
            last_b[s] = tag
        for name in names:
            factor = per_chunk if name in ("fwd0", "bwd0") else 1
            events += [_scaled(e, factor, r, phase=tag, stage=s) for e in pieces[name]]
        if send and p > 1:
            itemsize = jnp.dtype(model_cfg.param_dtype).itemsize  # activations' dtype
            x_bytes = microbatch_size * seq * model_cfg.embed_dim * itemsize
            events.append(
                Event(
                    0,
                    tag,
                    "collective",
                    "activations",
                    bytes=x_bytes * r * par.tensor,
                    axis="pipe",
                    devices=r * par.tensor,
                    op="collective-permute",
                    group=2,
                    stage=s,
                )  # fmt: skip
            )
    for s in range(p):
        grads = layer_bytes * L // p + (shared_bytes if s in (0, p - 1) else 0)
        if r > 1:
            sent = 2 * (r - 1) / r * grads
            events.append(
                Event(
                    0,
                    last_b[s],
                    "collective",
                    "gradients",
                    bytes=round(sent * r * par.tensor),
                    axis="replica",
                    devices=r * par.tensor,
                    op="all-reduce",
                    group=r,
                    stage=s,
                )  # fmt: skip
            )
        events += [_scaled(e, L // p, r, phase=f"update{s}", stage=s) for e in pieces["update0"]]
    ledger = Ledger()
    ledger.events.extend(events)
    totals = ledger.step_totals(0)

    peak = max(sched.peak_activations(s) for s in range(p))
    device_bytes = 4 * (layer_bytes * L // p + shared_bytes) + round(peak * per_chunk * v * keep)
    timeline, prediction = predict(
        events, hardware, par, totals["model_flops"], batch * seq, {"device": device_bytes}
    )
    hardware_flops = sum(
        e.flops for e in events if e.kind == "compute" and e.carries != "optimizer_state"
    )
    step = prediction["step_time_s"]
    analytic = flops.training_step(model_cfg, batch, seq)
    return (
        {
            "model": model_cfg.name,
            "mesh": str(par),
            "devices": par.num_devices,
            "param_count": param_count(model.abstract_params()[0]),
            "batch": batch,
            "seq": seq,
            "microbatch_size": microbatch_size,
            "microbatches": m,
            "schedule": schedule,
            "virtual": v,
            "recompute": recompute,
            "bubble_fraction": sched.bubble_fraction,
            **totals,
            "model_flops_analytic": analytic,
            "model_flops_rel_err": totals["model_flops"] / analytic - 1,
            "executed_flops": hardware_flops,
            "tflops_per_device": hardware_flops / par.num_devices / step / 1e12 if step else 0.0,
            **prediction,
            "elapsed_s": time.perf_counter() - t0,
        },
        ledger,
        timeline,
    )
