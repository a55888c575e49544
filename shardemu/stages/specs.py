"""Where a stage's arrays live: its mesh (the `rts` sub-axis splitting a replica group
for replicated tensor sharding), its rules over that mesh, and the partition specs of
its weights as computed with and as stored (`Specs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec

from shardemu.config import ConfigError, Parallelism, PhasedConfig, TrainConfig
from shardemu.models import Model
from shardemu.parallel.rules import Rules, logical_to_spec, rules_or_default

RTS = "rts"
STAGE_AXES = ("pipe", "replica", RTS, "context", "tensor")
AXIS_LABELS = {RTS: "replica"}  # the ledger names the rts sub-axis as the user's axis


def stage_meshes(mesh: Mesh, rts: int) -> list[Mesh]:
    """One mesh per pipeline stage, over that stage's devices, with `replica` split
    into (replica / rts, rts); neighbouring replicas share a weight's rts shards, and
    each sequence is split over `context` (the rules say so: `megatron_rules`). The
    pipelined and phased engines split no experts: a mesh with `expert` > 1 is
    refused."""
    if mesh.shape.get("expert", 1) > 1:
        raise ConfigError(
            f"the pipelined and phased engines run expert = 1 (got expert="
            f"{mesh.shape['expert']}); expert parallelism runs on the resident engine "
            f"(shardemu.Trainer), or fold the expert devices into `replica`"
        )
    replica, context, tensor = (mesh.shape.get(a, 1) for a in ("replica", "context", "tensor"))
    # (pipe, replica, expert = 1, [context,] tensor): see mesh.py
    grid = mesh.devices.reshape(-1, replica, context, tensor)
    return [
        Mesh(
            grid[s].reshape(1, replica // rts, rts, context, tensor),
            STAGE_AXES,
            axis_types=(AxisType.Auto,) * len(STAGE_AXES),
        )
        for s in range(grid.shape[0])
    ]


def staged_rules(rules: Rules | None, model: Model, train: TrainConfig, par: Parallelism) -> Rules:
    """A staged engine's rules on its stage meshes (`stage_rules`): `rules` as given,
    or the default table for `train`'s sequence parallelism and `par`'s context and
    tensor sizes (`rules_or_default`)."""
    return stage_rules(
        rules_or_default(
            rules,
            train.sequence_parallel,
            context=par.context,
            tensor=par.tensor,
            kv_heads=model.cfg.kv_heads,
        )
    )


def stage_rules(rules: Rules) -> Rules:
    """`rules` on a stage mesh: whatever was split over `replica` is split over
    (replica, rts), i.e. over the same devices; `expert` is not on a stage mesh (the
    staged engines run expert = 1: `stage_meshes`)."""

    def split(axes: Any) -> Any:
        if axes is None:
            return None
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        out = tuple(
            n for a in names if a != "expert" for n in ((a, RTS) if a == "replica" else (a,))
        )
        return None if not out else out[0] if len(out) == 1 else out

    return tuple((name, split(axes)) for name, axes in rules)


def store_spec(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    sizes: dict[str, int],
    skip: int,
) -> PartitionSpec:
    """`spec` with mesh `axes` added to the largest dimension (past the first `skip`)
    whose shard they divide, preferring dimensions not split yet: how a weight is stored
    when spread over more devices. A tensor with no such dimension (BERT's 2-way NSP
    bias) is stored whole, as a real RTS implementation would keep a tiny bias."""
    n = math.prod(sizes[a] for a in axes)
    if n == 1:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))

    def shard(dim: int) -> int:
        e = entries[dim]
        names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        return shape[dim] // math.prod(sizes[a] for a in names)

    fits = [d for d in range(skip, len(shape)) if shard(d) % n == 0]
    if not fits:  # a tensor too small to split (BERT's 2-way NSP bias): stored whole
        return spec
    dim = max(fits, key=lambda d: (entries[d] is None, shard(d)))  # unsplit dims first
    e = entries[dim]
    entries[dim] = (*(() if e is None else (e,) if isinstance(e, str) else e), *axes)
    return PartitionSpec(*entries)


def tree_store_specs(
    specs: Any, shapes: Any, axes: tuple[str, ...], sizes: dict[str, int], skip: int
) -> Any:
    return jax.tree.map(
        lambda spec, s: store_spec(spec, s.shape, axes, sizes, skip),
        specs,
        shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


@dataclass
class Specs:
    """Partition specs of one phase's layers and of the shared weights, the same on
    every stage: computed, stored (rts), optimizer state (rts') and gradients (as
    stored, or as the optimizer state: ZeRO stage 2)."""

    layer_compute: Any
    layer_store: Any
    layer_opt: Any
    shared_compute: Any
    shared_store: Any
    shared_opt: Any
    act: PartitionSpec
    batch: dict[str, PartitionSpec]
    layer_grads: Any
    shared_grads: Any


def make_specs(
    layer_specs: Any,
    layer_shapes: Any,
    shared_specs: Any,
    shared_shapes: Any,
    rules: Rules,
    sizes: dict[str, int],
    cfg: PhasedConfig,
    model: Model,
    split_grads: bool = False,
) -> Specs:
    """The specs of `cfg`'s rts and rts'; with `split_grads` (ZeRO stage 2), the
    gradients leave the backward split as the optimizer state is, each replica's share
    reduce-scattered to it, where they are otherwise stored as the weights are."""
    rts_axes = (RTS,) if cfg.rts > 1 else ()
    if cfg.rts_opt in (1, cfg.rts):
        opt_axes = () if cfg.rts_opt == 1 else rts_axes
    else:  # all of replica (PhasedConfig.check_mesh allows nothing else)
        opt_axes = ("replica", RTS)
    layer_store = tree_store_specs(layer_specs, layer_shapes, rts_axes, sizes, skip=1)
    layer_opt = tree_store_specs(layer_specs, layer_shapes, opt_axes, sizes, skip=1)
    shared_store = tree_store_specs(shared_specs, shared_shapes, rts_axes, sizes, skip=0)
    shared_opt = tree_store_specs(shared_specs, shared_shapes, opt_axes, sizes, skip=0)
    return Specs(
        layer_compute=layer_specs,
        layer_store=layer_store,
        layer_opt=layer_opt,
        shared_compute=shared_specs,
        shared_store=shared_store,
        shared_opt=shared_opt,
        layer_grads=layer_opt if split_grads else layer_store,
        shared_grads=shared_opt if split_grads else shared_store,
        act=logical_to_spec(model.family.activation_axes, rules, "activations"),
        batch={
            k: logical_to_spec(axes, rules, f"batch array {k!r}")
            for k, axes in model.batch_axes.items()
        },
    )
