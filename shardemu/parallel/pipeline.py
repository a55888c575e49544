"""GPipe over the `pipe` mesh axis, executed for real.

The stacked layer parameters [L, ...] are split over `pipe` in contiguous blocks (the
rules map `layers` to `pipe`), so reshaping them to [p, L/p, ...] puts stage s's layers
on pipe slice s with no data movement. Activations travel in a stage buffer

    buf_pbsd  [p, mb, s, d]   sharded (pipe, replica, -, -): row s is stage s's input

and each of the m + p - 1 iterations (i) injects microbatch t into row 0, (ii) runs all
stages at once (a vmap whose stage axis GSPMD keeps on `pipe`, so each pipe slice runs
only its stage), (iii) collects the last stage's output, and (iv) rolls the buffer one
row down, which XLA lowers to a collective-permute between `pipe` neighbours. This is
the stage-stacked formulation of maxtext's `layers/pipeline.py`. Differentiating the
loop runs the iterations backwards: all forwards, then all backwards, i.e. GPipe
(Huang et al. 2019). Each iteration also shifts the microbatch ids alongside the
activations, so the executed order can be compared with `schedule.make_schedule`.

The embedding and the head are not stage-partitioned: their parameters are replicated
over `pipe` (Megatron-LM likewise keeps the tied embedding on the first and last stage).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.models import Model
from shardemu.parallel.microbatch import merge, split
from shardemu.parallel.rules import constrain
from shardemu.parallel.schedules import SCHEDULES, make_schedule

BUF_AXES = ("stages", "batch", "sequence", "embed")


def to_stages(layer_params: Any, logical: Any, stages: int) -> Any:
    """[L, ...] leaves -> [p, L/p, ...], pinned with the stage axis on `pipe`."""

    def one(w: jax.Array, axes: tuple) -> jax.Array:
        w = w.reshape(stages, w.shape[0] // stages, *w.shape[1:])
        return constrain(w, ("stages", None, *axes[1:]))

    return jax.tree.map(one, layer_params, logical, is_leaf=lambda x: isinstance(x, tuple))


def gpipe(
    model: Model, stage_params: Any, x_mbsd: jax.Array, mask: jax.Array, stages: int
) -> tuple[jax.Array, jax.Array]:
    """Run m microbatches [m, mb, s, d] through p stages. Returns the last stage's
    outputs [m, mb, s, d] and the executed order: ids [m + p - 1, p], the microbatch
    each stage ran at each iteration (-1: bubble)."""
    m = x_mbsd.shape[0]
    per_example_mask = mask.shape[0] != 1  # BERT's padding mask travels with its examples
    masks = split(mask, m) if per_example_mask else mask

    def run_stage(params: Any, x_bsd: jax.Array, mask_s: jax.Array) -> jax.Array:
        return model.apply_layers(params, x_bsd, mask_s)

    all_stages = jax.vmap(
        run_stage, in_axes=(0, 0, 0 if per_example_mask else None), spmd_axis_name="pipe"
    )

    def iteration(carry: tuple, t: jax.Array) -> tuple[tuple, jax.Array]:
        buf, mask_buf, ids, outs = carry
        fresh = t < m
        src = jnp.minimum(t, m - 1)
        buf = buf.at[0].set(jnp.where(fresh, x_mbsd[src], 0))
        ids = ids.at[0].set(jnp.where(fresh, t, -1))
        if per_example_mask:
            mask_buf = mask_buf.at[0].set(jnp.where(fresh, masks[src], False))
        out = constrain(
            all_stages(
                stage_params, constrain(buf, BUF_AXES), mask_buf if per_example_mask else masks
            ),
            BUF_AXES,
        )
        k = t - (stages - 1)  # microbatch leaving the last stage now
        slot = jnp.maximum(k, 0)
        outs = outs.at[slot].set(jnp.where(k >= 0, out[stages - 1], outs[slot]))
        if per_example_mask:
            mask_buf = jnp.roll(mask_buf, 1, axis=0)
        return (jnp.roll(out, 1, axis=0), mask_buf, jnp.roll(ids, 1), outs), ids

    buf = jnp.zeros((stages, *x_mbsd.shape[1:]), x_mbsd.dtype)
    mask_buf = jnp.zeros((stages, *masks.shape[1:]), bool) if per_example_mask else jnp.zeros(())
    init = (buf, mask_buf, jnp.full((stages,), -1, jnp.int32), jnp.zeros_like(x_mbsd))
    (_, _, _, outs), order = jax.lax.scan(iteration, init, jnp.arange(m + stages - 1))
    return outs, order


# Pipeline schedules executed for real, by name (`TrainConfig.schedule`); the others in
# `schedules.py` are planned (`shardemu plan --schedule`) but not executed yet.
EXECUTORS = {"gpipe": gpipe}


def executor_for(schedule: str) -> Any:
    """The executed pipeline called `schedule`, or an error naming the ones there are."""
    if schedule not in EXECUTORS:
        raise ConfigError(
            f"pipeline schedule {schedule!r} is not executed for real; executed: "
            f"{', '.join(EXECUTORS)} (every schedule in {', '.join(SCHEDULES)} can be planned "
            f"with `shardemu plan --schedule`)"
        )
    return EXECUTORS[schedule]


def pipelined_loss_sums(
    model: Model, logical: Any, params: Any, batch: dict, stages: int, microbatches: int,
    schedule: str = "gpipe",
) -> tuple[tuple[jax.Array, ...], jax.Array]:  # fmt: skip
    """The model's loss terms with its layers run as the pipeline `schedule`; also the
    executed order."""
    x_bsd, mask = model.embed(params, batch)
    key = model.stack_key
    stage_params = to_stages(params[key], logical[key], stages)
    run = executor_for(schedule)
    y_mbsd, order = run(model, stage_params, split(x_bsd, microbatches), mask, stages)
    outputs = model.head(params, merge(y_mbsd))
    return model.loss_sums(outputs, batch), order


def stage_plan(model: Model, shapes: Any, stages: int) -> list[dict[str, Any]]:
    """Per stage: its layers [start, end), parameters and bytes (all tensor shards).
    Embedding and head parameters are replicated on every stage (`shared_params`)."""
    stack = jax.tree.leaves(shapes[model.stack_key])
    layers = stack[0].shape[0]
    per_layer = sum(math.prod(x.shape[1:]) for x in stack)
    per_layer_bytes = sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in stack)
    shared = [x for k, v in shapes.items() if k != model.stack_key for x in jax.tree.leaves(v)]
    shared_params = sum(math.prod(x.shape) for x in shared)
    shared_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in shared)
    n = layers // stages
    return [
        {
            "stage": s,
            "layers": [s * n, (s + 1) * n],
            "layer_params": n * per_layer,
            "shared_params": shared_params,
            "param_bytes": n * per_layer_bytes + shared_bytes,
        }
        for s in range(stages)
    ]


def transfer_bytes(model: Model, train: TrainConfig, par: Parallelism) -> int:
    """Bytes sent between pipeline stages per step, all devices: each point-to-point
    transfer of the GPipe schedule (activations forward, their gradients backward) moves
    one microbatch's activations [b, s, d]; every tensor device of a stage holds a full
    copy (activations are replicated over `tensor` between layers) and sends it, in every
    replica and accumulation step."""
    sched = make_schedule(train.schedule, par.pipe, train.microbatches)
    itemsize = jnp.dtype(model.cfg.param_dtype).itemsize
    activation = train.microbatch_size(par) * train.seq * model.cfg.embed_dim * itemsize
    return sched.p2p_transfers * activation * par.tensor * par.replica * train.grad_accum
