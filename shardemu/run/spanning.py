"""Checkpoints of pipeline stages that live on different processes.

orbax writes an array across processes only when it is a global array, one that spans
every process (it refuses an array whose devices all belong to one process: jax 0.10.2,
orbax's `Cannot serialize host local jax.Array`). A pipeline stage's weights live on its
own devices, which with `run --processes` may all be one process's. So a checkpoint
holds each stage's arrays copied onto every stage (`crossing.gathered`: an all-gather
over `pipe`) as one array over the stage meshes stacked along `pipe`, replicated over
it; orbax writes one replica. A restore reads that array and keeps, of each, the shards
of the stage its template lies on.

The copies cost one transfer of the state to each other stage at each save: what
joining separate processes' stages takes here, where a multi-host framework writes
each host's stages itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from shardemu.stages.crossing import gathered, on_mesh, restricted, stacked


def needed(meshes: Sequence[Mesh]) -> bool:
    """Whether a stage's arrays can lie on some processes only: several stages, and
    several processes."""
    return len(meshes) > 1 and jax.process_count() > 1


def spanning(tree: Any, meshes: Sequence[Mesh]) -> Any:
    """Each array of `tree` (on one stage's mesh) on every stage, as one array over
    the stacked meshes, replicated over `pipe`."""
    return jax.tree.map(lambda x: gathered(x, meshes, _stage_of(x.sharding, meshes)), tree)


def spanning_template(tree: Any, meshes: Sequence[Mesh]) -> Any:
    """`spanning`'s arrays as shapes: what a restore reads into."""
    whole = stacked(meshes)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_mesh(x.sharding, whole)),
        tree,
    )


def on_stages(tree: Any, template: Any) -> Any:
    """Each array of `tree` (from `spanning`) on its `template` leaf's stage alone."""
    return jax.tree.map(lambda x, like: restricted(x, like.sharding), tree, template)


def _stage_of(sharding: NamedSharding, meshes: Sequence[Mesh]) -> int:
    devices = sharding.device_set
    for s, mesh in enumerate(meshes):
        if set(mesh.devices.flat) == devices:
            return s
    raise ValueError(f"an array on {sorted(d.id for d in devices)} lies on no stage's mesh")
