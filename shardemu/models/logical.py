"""Shapes and logical axes of a Flax model's parameters, from its annotations alone.

`logical_params` reads a Flax linen module annotated with `nn.with_logical_partitioning`
(its `init` traced over example inputs with `jax.eval_shape`: nothing allocated), or a
Flax NNX module annotated with `nnx.with_partitioning` (an instance, or a function that
builds one, evaluated abstractly with `nnx.eval_shape`), and returns two trees of the
same structure: `jax.ShapeDtypeStruct`s and tuples of logical names, one per dimension.
The rules helpers (`parallel/rules.py`: `resolve_specs`, `param_table`) take them as
they take shardemu's own models', and so does `Family`, whose engines read a model's
parameters the same way (`Model.abstract_params`).

Every dimension needs a name (None: never split). A spec shorter than its parameter's
rank is ambiguous (which dimension does `('embed', 'kv')` leave out of a 3-D kernel?),
so it is refused, every such parameter in one message, not padded by a guess. The one
exception is exact: under a layer stack (`layers.layer_stack`), whose leading axis
shardemu adds, a spec one name short is the layer's own and gets `layers` in front (Flax
NNX's bridge to linen does not add the scan's axis name to its metadata).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

from shardemu.errors import ShardingError
from shardemu.parallel.rules import is_logical_axes

if TYPE_CHECKING:
    from flax import nnx

LAYERS = "layers"  # the logical name of a layer stack's leading axis


def _tuples(specs: Any) -> Any:
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _linen(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    boxed = jax.eval_shape(lambda rng: module.init(rng, *args, **kwargs), jax.random.key(0))
    boxed = boxed.get("params", boxed)
    return nn.unbox(boxed), _tuples(nn.get_partition_spec(boxed))


def _is_nnx(module: Any) -> bool:
    """Whether `module` is an NNX module, without importing NNX (a tenth of a second of
    every command's start) where no model is one: a user's NNX module has imported it."""
    nnx_module = sys.modules.get("flax.nnx")
    return nnx_module is not None and isinstance(module, nnx_module.Module)


def _nnx(module: nnx.Module | Callable[[], nnx.Module]) -> tuple[Any, Any]:
    from flax import nnx  # noqa: PLC0415 (see `_is_nnx`)

    with nnx.use_eager_sharding(False):  # no mesh is needed to read the names
        if not isinstance(module, nnx.Module):
            module = nnx.eval_shape(module)
        state = nnx.state(module, nnx.Param)
    shapes = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
        nnx.to_pure_dict(state),
    )
    logical = _tuples(nnx.to_pure_dict(nnx.get_partition_spec(state)))
    return shapes, logical


def logical_params(module: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """(shapes, logical axes) of `module`'s parameters: a linen module with example
    `args` (and `kwargs`) for its `__call__`, or an NNX module or a function that builds
    one (no arguments). Refuses parameters whose names do not match their rank."""
    if isinstance(module, nn.Module):
        shapes, logical = _linen(module, args, kwargs)
    elif _is_nnx(module) or callable(module):
        if args or kwargs:
            raise ShardingError(
                "an NNX module's parameters need no example inputs: pass the module, or a "
                "function that builds it (lambda: MyModel(rngs=nnx.Rngs(0)))"
            )
        shapes, logical = _nnx(module)
    else:
        raise ShardingError(
            f"logical_params takes a Flax linen module (with example inputs) or an NNX "
            f"module, got a {type(module).__name__}"
        )
    require_named(shapes, logical)
    return shapes, logical


def stacked(logical: Any, shapes: Any) -> Any:
    """`logical` of a layer stack's parameters, each spec one name short (the layer's
    own, from NNX's bridge) given the stack's leading `layers` axis."""

    def one(axes: tuple, shape: jax.ShapeDtypeStruct) -> tuple:
        if len(axes) == len(shape.shape) - 1 and LAYERS not in axes:
            return (LAYERS, *axes)
        return axes

    return jax.tree.map(one, logical, shapes, is_leaf=is_logical_axes)


def require_named(shapes: Any, logical: Any, what: str = "") -> None:
    """Refuse, in one message, every parameter whose logical names do not match its
    rank (a name per dimension; None for one never split)."""
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_axes = jax.tree.leaves(logical, is_leaf=is_logical_axes)
    bad = [
        f"{jax.tree_util.keystr(path, simple=True, separator='/')} {tuple(leaf.shape)} named {axes}"
        for (path, leaf), axes in zip(flat_shapes, flat_axes, strict=True)
        if len(axes) != len(leaf.shape)
    ]
    if bad:
        raise ShardingError(
            f"{what}{len(bad)} parameter(s) do not name each of their dimensions: "
            f"{'; '.join(bad)}. Give every dimension a logical name (None for one never "
            f"split) in nn.with_logical_partitioning / nnx.with_partitioning; a shorter "
            f"spec is not padded, since it cannot say which dimension it leaves out"
        )
