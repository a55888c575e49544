"""The device mesh with named axes `pipe`, `replica`, `expert`, `tensor` (and `context`).

The physical order puts `tensor` innermost (adjacent devices) and `pipe` outermost,
following Megatron-LM's rank order (tensor-parallel ranks fastest, pipeline ranks
slowest; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters", Section 3.3): tensor parallelism exchanges the most data, so it gets the
closest links. `expert` (expert parallelism: a mixture of experts' experts) sits between
`replica` and `tensor`: its all-to-alls are the next heaviest. Axis types are `Auto` so
GSPMD propagates shardings from the parameter and activation annotations; the returned
object is a plain `jax.sharding.Mesh` built by `jax.make_mesh` (which on accelerators
may order devices by their physical topology).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from shardemu.config import ConfigError, Parallelism
from shardemu.devices import DeviceError

PIPE = "pipe"
TENSOR = "tensor"
REPLICA = "replica"
EXPERT = "expert"
CONTEXT = "context"
AXIS_NAMES: tuple[str, ...] = (PIPE, REPLICA, EXPERT, TENSOR)
# a mesh with context parallelism has `context` between `expert` and `tensor`: its
# all-gathers of keys and values are the next heaviest after tensor parallelism's
CONTEXT_AXIS_NAMES: tuple[str, ...] = (PIPE, REPLICA, EXPERT, CONTEXT, TENSOR)


def make_mesh(
    pipe: int = 1,
    tensor: int = 1,
    replica: int = 1,
    devices: Sequence[jax.Device] | None = None,
    expert: int = 1,
    context: int = 1,
) -> Mesh:
    """A `Mesh` of shape (pipe, replica, expert, tensor) over `devices` (default: all of
    JAX's); with `context` > 1, (pipe, replica, expert, context, tensor).

    The mesh must use every given device exactly once; pass `devices=jax.devices()[:k]`
    to build a mesh over a subset.
    """
    par = Parallelism(pipe=pipe, tensor=tensor, replica=replica, expert=expert, context=context)
    devs = list(jax.devices() if devices is None else devices)
    if par.num_devices != len(devs):
        raise DeviceError(
            f"mesh {par} needs {par.num_devices} device(s) but {len(devs)} were given; "
            f"change the mesh so pipe*tensor*replica*expert*context = {len(devs)}, or "
            f"start with {par.num_devices} devices (`devices` {par.num_devices}, or "
            f"shardemu.use_virtual_devices({par.num_devices}))"
        )
    if context > 1:
        names, shape = CONTEXT_AXIS_NAMES, (pipe, replica, expert, context, tensor)
    else:
        names, shape = AXIS_NAMES, (pipe, replica, expert, tensor)
    return jax.make_mesh(shape, names, (AxisType.Auto,) * len(names), devices=devs)


def mesh_from(par: Parallelism, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """`make_mesh` from a `Parallelism`."""
    return make_mesh(
        par.pipe, par.tensor, par.replica, devices=devices, expert=par.expert, context=par.context
    )


def parallelism_of(mesh: Mesh) -> Parallelism:
    """The `Parallelism` a mesh of shardemu's axes stands for (an axis it lacks: 1)."""
    unknown = [name for name in mesh.axis_names if name not in CONTEXT_AXIS_NAMES]
    if unknown:
        raise ConfigError(
            f"a mesh of shardemu's axes ({', '.join(CONTEXT_AXIS_NAMES)}), as shardemu.make_mesh "
            f"builds, is needed; this one has {', '.join(map(repr, unknown))}: rename them "
            f"(and the PartitionSpecs that name them)"
        )
    return Parallelism(**{name: int(size) for name, size in mesh.shape.items()})
