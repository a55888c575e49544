"""Counting any jitted function: a user's own step, lowered on a shardemu mesh.

`count(fn, *args, mesh=...)` compiles `fn` once over the abstract `args`, to the end of
XLA's HLO passes (`optimized.py`; nothing is allocated or run), and returns the ledger
of one call: XLA's FLOPs per device, its kernels' matmuls and memory traffic, and
every collective in the compiled HLO with its bytes per mesh axis (`count.py`,
`collectives.py`), as the engines count their own pieces. The mesh is the global mesh
while `fn` is traced, so a bare `PartitionSpec` constraint resolves on it; with
`rules`, the function's `constrain` calls (and Flax's logical constraints,
`nn.with_logical_constraint`) resolve through that rules table. `predict/counted.py`
times such a ledger on a hardware profile.

Flax's `DenseGeneral` with multi-dimensional features and logically partitioned
kernels cannot be traced under a global mesh (google/flax#3676: it constrains the
kernel at its flat init shape against its full-rank names); `count` says so instead of
XLA's error. The engines set no global mesh and run such modules.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh

from shardemu.accounting.count import COUNT_OPTIONS, Counter, abstract, piece_events
from shardemu.accounting.ledger import Ledger, Phase
from shardemu.accounting.optimized import optimized
from shardemu.errors import ConfigError
from shardemu.parallel.mesh import parallelism_of
from shardemu.parallel.rules import Rules, activation_rules


def _require_array(x: Any) -> None:
    """An argument the compiler can take as a shape and a dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ConfigError(
            f"count takes arrays or jax.ShapeDtypeStruct arguments, got a {type(x).__name__}; "
            f"pass a value's shape and dtype as jax.ShapeDtypeStruct(shape, dtype, sharding=...)"
        )


def _refuse_flax_3676(err: ValueError) -> None:
    """A clear error for Flax's multi-dimensional `DenseGeneral` under a mesh."""
    frames = {frame.name for frame in traceback.extract_tb(err.__traceback__)}
    if "kernel_init_wrap" in frames:
        raise ConfigError(
            "a Flax DenseGeneral with multi-dimensional features and logically partitioned "
            "kernels cannot be traced under a global mesh, which count sets (google/flax#3676: "
            "its kernel is constrained at its flat init shape); write that projection as "
            "self.param(...) and jnp.einsum, or run the model on shardemu's engines, which "
            "set no global mesh"
        ) from None


def count(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Mesh,
    rules: Rules | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
) -> Ledger:
    """The ledger of one call of `fn(*args)` on `mesh` (a shardemu mesh: axes `pipe`,
    `replica`, `tensor`, as `shardemu.make_mesh` builds). `args` are arrays or
    `jax.ShapeDtypeStruct`s, their shardings (or `in_shardings`, as `jax.jit` takes
    them) the layout they arrive in. One `step` event of computation and one event per
    (collective, mesh axes, group size)."""
    parallelism_of(mesh)  # refuses a mesh of other axis names
    jax.tree.map(_require_array, args)
    shapes = abstract(args)
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
    with contextlib.ExitStack() as context:
        if rules is not None:
            context.enter_context(activation_rules(mesh, rules))
            context.enter_context(nn.logical_axis_rules(rules))
        context.enter_context(jax.set_mesh(mesh))
        try:
            compiled = optimized(jitted, shapes, mesh, COUNT_OPTIONS)
        except ValueError as err:
            _refuse_flax_3676(err)
            raise
    # a counter of its own: its keys are a piece's name and signature, and two user
    # functions may share both
    counted = Counter().count_compiled(getattr(fn, "__name__", "fn"), compiled, mesh, shapes)
    return Ledger(piece_events(counted, 0, Phase("step"), 0))
