"""A searched layout checked for real: the same mesh, schedule, precision and sharding
rules on a scaled-down model, trained on virtual devices and compared with one device.

A prediction is only as good as the layout being runnable: a pipe the layers do not
split into, a tensor axis a dimension does not divide, a schedule the executor cannot
run, or a sharding rule that changes the maths would all show here. The model keeps
the family and gets tiny widths that every axis of the layout divides: 2 heads per
tensor device of width 8 (with grouped-query attention, a key/value head per tensor
device), one layer per pipeline chunk, a vocabulary of 64 per tensor device. Replicas
are capped at `VERIFY_REPLICAS` (data parallelism adds a gradient all-reduce, which two
replicas exercise) so the run fits one laptop. Both runs take the
same microbatches in the same precision: the sharded run must equal the one-device run
up to the reordering of sums (`TOLERANCE`). A resident layout keeps its ZeRO stage (the
pipelined engine runs every stage too) and the search's sequence parallelism.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardemu.config import ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.predict.layouts import Candidate, Space, meshes
from shardemu.predict.planning import plan_devices_needed

VERIFY_REPLICAS = 2
STEPS = 3
SEQ = 16
# largest relative loss difference accepted: float32 sums in another order drift by
# ~1e-7 a step (the demo's sharded vs one-device run); 16-bit ones by ~1e-5
# (tests/test_precision.py), with room for three steps; FP8 as BF16 (its amax is the
# whole tensor's: gpt-tiny on tensor=2 x replica=2 drifted 3.4e-4 in 5 steps)
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3, "fp16-mixed": 1e-3, "fp8": 1e-3}


def scaled_down(model_cfg: ModelConfig, c: Candidate) -> tuple[ModelConfig, Parallelism]:
    """The tiny model and the mesh that stand for `c` (module docstring)."""
    heads = 2 * c.tensor
    grouped = model_cfg.kv_heads != model_cfg.num_heads  # then 2 query heads a group
    chunks = c.pipe * c.virtual  # a layer each; split with its ends: two each, less the ends
    tiny = model_cfg.replace(
        name=f"{model_cfg.name}-scaled-down",
        num_layers=2 * chunks - 2 if c.ends_in_split else chunks,
        num_heads=heads,
        num_kv_heads=c.tensor if grouped else 0,
        embed_dim=8 * heads,
        mlp_dim=32 * heads,
        vocab_size=64 * c.tensor,
        max_positions=SEQ,
    )
    return tiny, verify_mesh(c.par)


def verify_mesh(par: Parallelism) -> Parallelism:
    """The mesh a layout on `par` is verified on: its pipe and tensor, at most
    `VERIFY_REPLICAS` replicas and as many context devices (each sequence split in
    two is the code path a larger context runs)."""
    return dataclasses.replace(
        par, replica=min(par.replica, VERIFY_REPLICAS), context=min(par.context, VERIFY_REPLICAS)
    )


def _settings(c: Candidate, par: Parallelism) -> tuple[TrainConfig, PhasedConfig | None]:
    size = min(c.microbatch_size, 2)
    if c.mode == "phased":
        phased = PhasedConfig(
            rts=min(c.rts, par.replica),
            activations=c.activations,  # type: ignore[arg-type]
            optimizer_on=c.optimizer_on,
            prefetch=c.prefetch,  # type: ignore[arg-type]
        )
        train = TrainConfig(steps=STEPS, batch=size * par.replica, seq=SEQ, precision=c.precision)
        return train, phased
    # interleaved 1F1B needs a multiple of pipe; pipe microbatches take every stage
    # through its warm-up, steady 1F1B and cool-down (2 * pipe took GPT-3 175B's winner
    # on 16 stages 50 s to check, pipe 27 s), and two accumulate
    micro = max(2, c.pipe)
    train = TrainConfig(
        steps=STEPS,
        batch=size * par.replica * micro,
        seq=SEQ,
        microbatches=micro,
        schedule=c.schedule,
        virtual=c.virtual,
        precision=c.precision,
        account_for_embedding_in_pipeline_split=c.ends_in_split,
        account_for_loss_in_pipeline_split=c.ends_in_split,
    )
    return train, None


def verify(
    model_cfg: ModelConfig, c: Candidate, out: Path, sequence_parallel: bool = False
) -> dict[str, Any]:
    """Train `c`'s scaled-down layout (with `sequence_parallel`, as the search planned
    it) and one device for `STEPS` steps (run directories under `out`); the losses,
    their largest relative difference and whether it is within `TOLERANCE`."""
    from shardemu.run.runner import train

    tiny, par = scaled_down(model_cfg, c)
    train_cfg, phased = _settings(c, par)
    if c.mode == "resident":
        train_cfg = dataclasses.replace(train_cfg, zero=c.zero, sequence_parallel=sequence_parallel)
    sharded = train(
        tiny,
        par,
        train_cfg,
        out / "sharded",
        devices=jax.devices()[: par.num_devices],
        phased=phased,
    )
    one = train(
        tiny,
        Parallelism(),
        dataclasses.replace(
            train_cfg,
            schedule="gpipe",
            virtual=1,
            account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False,
        ),
        out / "one-device",
        devices=jax.devices()[:1],
    )
    a, b = np.asarray(sharded.losses), np.asarray(one.losses)
    worst = float(np.max(np.abs(a - b) / np.abs(b)))
    return {
        "mesh": str(par),
        "model": dataclasses.asdict(tiny),
        "steps": STEPS,
        "batch": train_cfg.batch,
        "microbatches": train_cfg.microbatches,
        "losses": a.tolist(),
        "losses_one_device": b.tolist(),
        "max_rel_diff": worst,
        "tolerance": TOLERANCE[c.precision],
        "equal": worst <= TOLERANCE[c.precision],
        "run_dirs": [str(sharded.run_dir), str(one.run_dir)],
    }


def search_devices(
    model_cfg: ModelConfig, devices: int, batch: int, space: Space, seq: int | None = None
) -> int:
    """Virtual devices a search needs: a resident plan counts one context x tensor
    group, a phased plan one stage (context x tensor x replica), the winner's check runs
    its pipe x tensor x (replica and context, at most two each) (`verify_mesh`)."""
    phased = space.modes != "resident"
    return max(
        max(plan_devices_needed(p, phased), verify_mesh(p).num_devices)
        for p in meshes(model_cfg, devices, batch, space.max_tensor, space.context_sizes, seq)
    )
