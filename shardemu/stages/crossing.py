"""Arrays that cross from one pipeline stage to another when the stages live on
different processes (`run --processes` with pipe > 1).

In one process a stage-to-stage send is a `jax.device_put`. Across processes the CPU
client moves nothing between hosts by itself, and JAX's transfer server for that (the
`jax_cross_host_transfer_*` flags, jax 0.10.2) hung now and then here: a receiving
process waited for ever on a transfer its sender had issued (a phased run with
pipe = 2, every time in its backward; a checkpoint's copies of 117 arrays, at the
117th). So a crossing is a collective instead, on the gloo CPU collectives every
process already runs (`devices.settled`): one program over both stages' meshes,
stacked along `pipe`, whose input holds the source's shards and zeros on the other
stage, and which gives every stage the source's block (an all-gather over `pipe`,
then the source's row: selected, not summed, so every bit is the source's). The
ledger records what the target machine sends (`Executor.send`), not this mechanism.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardemu.devices import settled


def put(tree: Any, shardings: Any) -> Any:
    """`tree` on `shardings`, finished (`settled`): a device transfer, or, for an array
    whose stage lies on other processes than its destination's, a crossing."""
    if jax.process_count() == 1:
        return settled(jax.device_put(tree, shardings))

    def one(x: Any, sharding: Any) -> Any:
        if isinstance(x, jax.Array) and crosses_processes(x, sharding):
            return moved(x, sharding)
        return settled(jax.device_put(x, sharding))

    return jax.tree.map(one, tree, shardings)


def crosses_processes(x: jax.Array, sharding: NamedSharding) -> bool:
    """Whether moving `x` onto `sharding` takes a crossing: other devices, and some
    process holding one side but not the other (the same answer in every process)."""
    here, there = x.sharding.device_set, sharding.device_set
    if here == there:
        return False
    return {d.process_index for d in here} != {d.process_index for d in there}


def moved(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`x` on `sharding` (another stage's mesh of the same axes), by a crossing: laid
    out as `sharding` says on its own stage first, then copied over."""
    source: NamedSharding = x.sharding  # type: ignore[assignment]
    local = settled(jax.device_put(x, NamedSharding(source.mesh, sharding.spec)))
    both = [source.mesh, sharding.mesh]
    return restricted(gathered(local, both, 0), sharding)


def restricted(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`x` (replicated over `pipe` of stacked stage meshes: `gathered`) as the array of
    one stage's devices alone, laid out as `sharding`: its shards there, no copy."""
    shards = [s.data for s in x.addressable_shards if s.device in sharding.device_set]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards, dtype=x.dtype)


def gathered(x: jax.Array, meshes: Sequence[Mesh], stage: int) -> jax.Array:
    """`x`, which lies on `meshes[stage]`, on every one of `meshes` (each [1, ...] over
    `pipe`, all of the same axes): one array over them stacked along `pipe`,
    replicated over it, with `x`'s layout on each."""
    kind = x.sharding.memory_kind
    if kind not in (None, "device"):  # the host tier: gathered on the devices, put back
        on_devices = settled(jax.device_put(x, x.sharding.with_memory_kind("device")))
        out = gathered(on_devices, meshes, stage)
        return settled(jax.device_put(out, out.sharding.with_memory_kind(kind)))
    whole = stacked(meshes)
    target = on_mesh(x.sharding, whole)  # type: ignore[arg-type]
    own = {shard.device: shard.data for shard in x.addressable_shards}
    shards = [
        own[d] if d in own else jax.device_put(np.zeros(_block(x.shape, i), x.dtype), d)
        for d, i in target.addressable_devices_indices_map(x.shape).items()
    ]
    mixed = jax.make_array_from_single_device_arrays(x.shape, target, shards, dtype=x.dtype)
    return settled(_from_stage(whole, target.spec, stage)(mixed))


def stacked(meshes: Sequence[Mesh]) -> Mesh:
    """Stage meshes (each [1, ...] over `pipe`) stacked along `pipe`."""
    first = meshes[0]
    devices = np.concatenate([m.devices for m in meshes], axis=0)
    return Mesh(devices, first.axis_names, axis_types=first.axis_types)


def on_mesh(sharding: NamedSharding, mesh: Mesh) -> NamedSharding:
    """`sharding` on `mesh` (whose axes the stage meshes share), its memory kind kept
    and `pipe` dropped from its spec: a stage mesh's `pipe` has one device (a layer
    stack names it), and the stacked array is replicated over the stacked one."""
    spec = PartitionSpec(*(_without_pipe(axes) for axes in sharding.spec))
    return NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)


def _without_pipe(axes: Any) -> Any:
    if axes == "pipe":
        return None
    if isinstance(axes, tuple):
        kept = tuple(a for a in axes if a != "pipe")
        return kept or None
    return axes


@functools.lru_cache(maxsize=256)
def _from_stage(whole: Mesh, spec: PartitionSpec, stage: int) -> Any:
    """The jitted program that gives every stage of `whole` the block of `stage`."""

    def pick(block: jax.Array) -> jax.Array:
        return jax.lax.all_gather(block, "pipe")[stage]

    mapped = jax.shard_map(pick, mesh=whole, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(mapped)


def _block(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    """The shape of `shape`'s block at `index` (a slice of each dimension)."""
    return tuple(len(range(*i.indices(n))) for i, n in zip(index, shape, strict=True))
