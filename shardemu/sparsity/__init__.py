"""Block sparsity, static and dynamic (`wrapper.wrap_optax`, jaxpruner's API shape),
on the layers' dense kernels (`masks.py`)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from shardemu.config import TrainConfig
from shardemu.sparsity.masks import check_blocks, densities, sparse_leaves
from shardemu.sparsity.wrapper import (
    SparseState,
    SparseTransformation,
    apply_masks,
    init_state,
    mask_counts,
    wrap_optax,
)

__all__ = [
    "SparseState",
    "SparseTransformation",
    "apply_masks",
    "check_blocks",
    "densities",
    "init_state",
    "mask_counts",
    "opt_state_shardings",
    "sparse_counts",
    "sparse_leaves",
    "sparse_optimizer",
    "wrap_optax",
]


def sparse_optimizer(
    tx: optax.GradientTransformation,
    train: TrainConfig,
    shapes: Any,
    logical: Any,
    specs: Any,
    axis_sizes: dict[str, int],
) -> optax.GradientTransformation:
    """`tx` wrapped for `train.sparsity` (`tx` itself for a dense run), once the block
    size is checked against the parameters' shards (`specs` over `axis_sizes`)."""
    sparse = train.sparsity
    if sparse is None:
        return tx
    check_blocks(shapes, logical, specs, axis_sizes, sparse.block)
    return wrap_optax(tx, sparse, logical, train.steps, train.seed)


def sparse_counts(opt_states: list[Any]) -> dict[str, float]:
    """`density` (non-zero / all weights of the sparse kernels) and `zero_weights`, read
    from the masks in the optimizer states of a model's parts (one for the resident
    engine; a stage's or a phase's each for the others); empty for a dense run."""
    if not isinstance(opt_states[0], SparseState):
        return {}
    counts = [jax.jit(mask_counts)(o.masks) for o in opt_states]
    nonzero, total = (sum(int(c[i]) for c in counts) for i in (0, 1))
    return {"density": nonzero / total, "zero_weights": total - nonzero}


def opt_state_shardings(
    tx: optax.GradientTransformation, state: Any, param_shardings: Any, replicated: Any
) -> Any:
    """Shardings of `tx`'s state (`state`: its shapes): each copy of the parameter tree
    sharded like the parameters, everything else replicated. A `SparseState`'s masks are
    sharded like their kernels (a dense leaf's scalar mask is replicated)."""

    def params_like(inner: optax.GradientTransformation, shapes: Any) -> Any:
        return optax.tree_map_params(
            inner,
            lambda _, sh: sh,
            shapes,
            param_shardings,
            transform_non_params=lambda _: replicated,
        )

    if not isinstance(state, SparseState):
        return params_like(tx, state)
    masks = jax.tree.map(
        lambda m, sh: replicated if m.ndim == 0 else sh, state.masks, param_shardings
    )
    return SparseState(params_like(tx.inner, state.inner), masks, replicated, replicated)
