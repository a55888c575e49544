"""Block sparsity as an optax transformation, in jaxpruner's shape (`wrap_optax`).

jaxpruner (Lee et al. 2023) is not installable here; its API is followed instead: the
wrapped transformation's state holds the masks (`SparseState`), every update is masked
so that zero weights stay exactly zero, and in `dynamic` mode the pattern is updated
under `lax.cond` on the update steps:

- every `steps // updates` steps (after the first), prune the fraction
  `pr(t) = prune_ratio * 0.5 * (1 + cos(pi * t / steps))` of each layer's non-zero
  blocks, smallest L1 norm first (Dietrich et al. 2021, section 3.2: magnitude pruning
  with a cosine-decayed prune ratio);
- regrow as many zero blocks, chosen at random (Dietrich et al.) or by the largest
  gradient L1 norm (RigL, Evci et al. 2020); so the number of non-zero blocks is
  unchanged;
- regrown weights start at zero, and so do their optimizer moments (RigL, section 3).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shardemu.config import SparsityConfig
from shardemu.sparsity.masks import (
    block_mask,
    block_norms,
    expand,
    initial_masks,
    layer_uniforms,
    top_k,
)


class SparseState(NamedTuple):
    inner: optax.OptState
    masks: Any  # a bool array per sparse kernel, shaped like it; a scalar True elsewhere
    count: jax.Array  # steps done
    first_layer: jax.Array  # the model's index of the first layer these masks cover


class SparseTransformation(optax.GradientTransformation):
    """`wrap_optax`'s result: a `GradientTransformation` that names the one it wraps
    (`inner`), since optax's `tree_map_params` cannot see through the wrapper."""

    inner: optax.GradientTransformation


def update_interval(cfg: SparsityConfig, steps: int) -> int:
    return max(1, steps // cfg.updates)


def wrap_optax(
    tx: optax.GradientTransformation, cfg: SparsityConfig, logical: Any, steps: int, seed: int
) -> SparseTransformation:
    """`tx` on the non-zero weights only. `logical` names the parameters' axes (it
    finds the sparse kernels and their matrix view); `steps` is the run's length (the
    update schedule); `seed` draws the initial pattern and random regrowth."""
    key = jax.random.key(seed)
    interval = update_interval(cfg, steps)

    def init(params: Any) -> SparseState:
        return init_state(tx, params, cfg, logical, seed)

    def update(grads: Any, state: SparseState, params: Any = None) -> tuple[Any, SparseState]:
        if params is None:
            raise ValueError("a sparse optimizer needs params in update()")
        old, inner = state.masks, state.inner
        new = old
        if cfg.mode == "dynamic":
            t = state.count
            due = (t > 0) & (t % interval == 0) & (t // interval <= cfg.updates)
            first = state.first_layer
            new = jax.lax.cond(
                due,
                lambda: _updated(params, grads, old, t, cfg, logical, steps, key, first),
                lambda: old,
            )
            regrown = jax.tree.map(lambda n, o: n & ~o, new, old)
            inner = optax.tree_map_params(
                tx,
                lambda v, r: jnp.where(r, jnp.zeros_like(v), v),
                inner,
                regrown,
                transform_non_params=lambda v: v,
            )
        # a sparse kernel has no gradient for its zero weights
        masked = jax.tree.map(lambda g, m: jnp.where(m, g, jnp.zeros_like(g)), grads, old)
        updates, inner = tx.update(masked, inner, params)
        # weights kept by the old and new patterns move; every other weight goes to (or
        # stays at) exactly zero: p + (-p) == 0
        keep = jax.tree.map(lambda n, o: n & o, new, old)
        updates = jax.tree.map(lambda u, p, k: jnp.where(k, u, -p), updates, params, keep)
        return updates, state._replace(inner=inner, masks=new, count=state.count + 1)

    wrapped = SparseTransformation(init, update)
    wrapped.inner = tx
    return wrapped


def init_state(
    tx: optax.GradientTransformation,
    params: Any,
    cfg: SparsityConfig,
    logical: Any,
    seed: int,
    first_layer: int = 0,
) -> SparseState:
    """`wrap_optax(tx, ...)`'s fresh state; of a stack of layers alone that starts at
    the model's layer `first_layer` (a pipeline stage's or a phase's), the state the
    whole model's has for those layers: the same masks, and the same regrowth draws."""
    key = jax.random.fold_in(jax.random.key(seed), 0)
    masks = initial_masks(params, logical, cfg, key, first_layer)
    return SparseState(
        tx.init(params), masks, jnp.zeros([], jnp.int32), jnp.asarray(first_layer, jnp.int32)
    )


def _updated(
    params: Any,
    grads: Any,
    masks: Any,
    t: jax.Array,
    cfg: SparsityConfig,
    logical: Any,
    steps: int,
    key: jax.Array,
    first_layer: jax.Array,
) -> Any:
    """The masks after one prune-and-regrow at step `t`."""
    ratio = cfg.prune_ratio * 0.5 * (1 + jnp.cos(math.pi * t / steps))
    axes = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    flat_p, treedef = jax.tree_util.tree_flatten_with_path(params)
    flat_m = jax.tree.leaves(masks)
    leaves = zip(flat_p, jax.tree.leaves(grads), flat_m, axes, strict=True)
    # the dense leaves (a scalar mask) stay as they are
    sparse = [(path, p, g, m, names) for (path, p), g, m, names in leaves if m.ndim > 0]
    active = [block_mask(m, names, cfg.block) for _, _, _, m, names in sparse]
    if cfg.regrow == "gradient":
        scores = [block_norms(g, names, cfg.block) for _, _, g, _, names in sparse]
    else:
        draws = jax.random.fold_in(key, 1 + t)  # 0 drew the initial pattern
        grids = [(path, *a.shape) for (path, *_), a in zip(sparse, active, strict=True)]
        scores = layer_uniforms(draws, grids, first_layer)
    new = dict(zip((path for path, _ in flat_p), flat_m, strict=True))
    for (path, p, _, _, names), a, score in zip(sparse, active, scores, strict=True):
        nnz = a.sum(axis=1)
        k = jnp.minimum(jnp.floor(ratio * nnz).astype(jnp.int32), a.shape[1] - nnz)
        prune = a & top_k(jnp.where(a, -block_norms(p, names, cfg.block), -jnp.inf), k)
        grow = ~a & top_k(jnp.where(a, -jnp.inf, score), k)
        new[path] = expand((a & ~prune) | grow, p.shape, names, cfg.block)
    return treedef.unflatten(list(new.values()))


def apply_masks(params: Any, masks: Any) -> Any:
    """`params` with every masked weight exactly zero."""
    return jax.tree.map(lambda p, m: jnp.where(m, p, jnp.zeros_like(p)), params, masks)


def mask_counts(masks: Any) -> tuple[jax.Array, jax.Array]:
    """(non-zero, total) weights over the sparse kernels."""
    sparse = [m for m in jax.tree.leaves(masks) if m.ndim > 0]
    return sum(m.sum() for m in sparse), sum(m.size for m in sparse)
