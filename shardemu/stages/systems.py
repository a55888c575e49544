"""Per-system pieces of weight streaming: what each CS-2 of a cluster computes on its own.

On a weight-streaming cluster (MISSION.md, "Weight streaming"; Cerebras, "Weight
streaming execution", docs.cerebras.net) every system receives each layer's whole
weights, runs its share of the batch, and sends its own weight gradients out; SwarmX sums
them on the way to MemoryX. Devices never all-reduce gradients between themselves. So
the pieces that produce weight gradients run under `shard_map` over the systems (the
batch's mesh axes): each device computes its share's gradients, returned stacked as
[systems, ...], and `swarmx-reduce` sums the stack in the host tier, where the
gradients land.

`keep-activations` keeps what a layer's backward needs from its forward except the
weights themselves (the vjp's residuals that *are* a weight), so the backward takes the
weights again from a second stream, as a CS-2 does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shardemu.numerics.optim import squared_norm
from shardemu.parallel.rules import named_shardings
from shardemu.sparsity import apply_masks
from shardemu.stages.pieces import Piece
from shardemu.stages.tiers import with_memory_kind

if TYPE_CHECKING:
    from shardemu.stages.stage import Stage


@dataclass(frozen=True, eq=False)
class VjpLayout:
    """How a layer stack's vjp is rebuilt from kept residuals and fresh weights: its
    tree structure, and per leaf the index of the weight leaf it is (-1: kept)."""

    treedef: Any
    weight_at: tuple[int, ...]


def _stack(tree: Any) -> Any:
    """One system's tree as its row of a [systems, ...] stack."""
    return jax.tree.map(lambda a: a[None], tree)


def _signature(*trees: Any) -> tuple:
    return tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(trees))


def per_system_builders(st: Stage) -> dict[Piece, Callable[[], Any]]:
    """The weight-streaming versions of a stage's gradient pieces (`fwd-acts`,
    `bwd-acts`, `bwd`, `head`, `embed-bwd`) and the host tier's `swarmx-reduce-*`."""
    model, mesh = st.model, st.mesh
    systems = PartitionSpec(st.act.spec[0])  # a stack's rows: one per system
    spec = lambda tree: jax.tree.map(lambda s: s.spec, tree)  # noqa: E731
    w_spec, shared_spec = spec(st.layer_compute), spec(st.shared_compute)
    act, mask, batch_spec = st.act.spec, st.mask.spec, spec(st.batch)
    layouts: dict[tuple, VjpLayout] = {}  # per one system's (weights, activation) shapes

    def per_system(fn: Any, in_specs: tuple, out_specs: Any) -> Any:
        """`fn` on each system's share; check_vma off so that a weight is the same
        traced value in the vjp's residuals as in the arguments (`fwd_acts`)."""
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def jitted(fn: Any, out_specs: Any) -> Any:
        """`fn` jitted with its outputs' shardings declared (those of its `shard_map`'s
        `out_specs`), so that a dry run for memory shapes it without compiling it
        (`Counter.outputs`): its compile then waits for the count, beside the others."""
        return jax.jit(fn, out_shardings=named_shardings(mesh, out_specs))

    def piece(fn: Any, in_specs: tuple, out_specs: Any) -> Any:
        """`fn` on each system's share, jitted (`per_system`, `jitted`)."""
        return jitted(per_system(fn, in_specs, out_specs), out_specs)

    def fwd_acts(w: Any, x: jax.Array, m: jax.Array) -> Any:
        y, vjp = st.layer_vjp(w, x, m)
        leaves, treedef = jax.tree.flatten(vjp)
        index = {id(leaf): j for j, leaf in enumerate(jax.tree.leaves(w))}
        weight_at = tuple(index.get(id(leaf), -1) for leaf in leaves)
        layouts[_signature(w, x)] = VjpLayout(treedef, weight_at)
        return y, [_stack(leaf) for leaf, j in zip(leaves, weight_at, strict=True) if j < 0]

    def bwd_acts(w: Any, kept: list, g: jax.Array) -> Any:
        layout = layouts[_signature(w, g)]  # recorded when the forward was traced
        weights, rest = jax.tree.leaves(w), iter(k[0] for k in kept)
        leaves = [weights[j] if j >= 0 else next(rest) for j in layout.weight_at]
        g_w, g_x = layout.treedef.unflatten(leaves)(g)
        return _stack(g_w), g_x

    def bwd(w: Any, x: jax.Array, m: jax.Array, g: jax.Array) -> Any:
        g_w, g_x = st.layer_vjp(w, x, m)[1](g)
        return _stack(g_w), g_x

    def head(shared: Any, x: jax.Array, batch: dict, counts: None, scale: jax.Array) -> Any:
        """Each system's share of the (scaled) loss and its gradients, normalised by the
        whole batch's counts (BERT's masked-token count is the batch's); the stage's
        `head` arguments, whose `counts` are always the batch's own here."""
        del counts

        def local(shared: Any, x: jax.Array, batch: dict, counts: Any, scale: Any) -> Any:
            loss, (g_s, g_x) = jax.value_and_grad(st.head_loss, argnums=(0, 1))(
                shared, x, batch, counts, scale
            )
            return loss[None], (_stack(g_s), g_x)

        in_specs = (shared_spec, act, batch_spec, PartitionSpec(), PartitionSpec())
        run = per_system(local, in_specs, (systems, (systems, act)))
        return run(shared, x, batch, model.loss_counts(batch), scale)

    def embed_bwd(shared: Any, batch: dict, g: jax.Array) -> Any:
        def local(shared: Any, batch: dict, g: jax.Array) -> Any:
            return _stack(jax.vjp(lambda s_: model.embed(s_, batch)[0], shared)[1](g)[0])

        return per_system(local, (shared_spec, batch_spec, act), systems)(shared, batch, g)

    return {
        Piece.FWD_ACTS: lambda: piece(fwd_acts, (w_spec, act, mask), (act, systems)),
        Piece.BWD_ACTS: lambda: piece(bwd_acts, (w_spec, systems, act), (systems, act)),
        Piece.BWD: lambda: piece(bwd, (w_spec, act, mask, act), (systems, act)),
        Piece.HEAD: lambda: jitted(head, (systems, (systems, act))),
        Piece.EMBED_BWD: lambda: jitted(embed_bwd, systems),
        Piece.SWARMX_REDUCE_LAYERS: lambda: _swarmx_reduce(st, "layers"),
        Piece.SWARMX_REDUCE_SHARED: lambda: _swarmx_reduce(st, "shared"),
    }


def _swarmx_reduce(st: Stage, part: str) -> Any:
    """Sum a stacked gradient tree over the systems in the host tier (with a sparse
    run's masks, drop the zero weights' gradients), and its squared norm. JAX will
    not compile selects over host-memory operands, so the sum works on device views
    (the same RAM on the CPU backend) and its results are left on the host."""
    store = st.layer_store if part == "layers" else st.shared_store
    host = NamedSharding(st.mesh, PartitionSpec(), memory_kind="pinned_host")

    def run(stacked: Any, masks: Any) -> Any:
        stacked, masks = jax.device_put((stacked, masks), jax.memory.Space.Device)
        g = jax.tree.map(lambda a: jnp.sum(a, axis=0), stacked)
        if masks is not None:
            g = apply_masks(g, masks)
        return g, squared_norm(g)

    return jax.jit(run, out_shardings=(with_memory_kind(store, "pinned_host"), host))
