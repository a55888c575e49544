"""Block sparsity, static and dynamic (`wrapper.wrap_optax`, jaxpruner's API shape),
on the layers' dense kernels (`masks.py`)."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import NamedSharding

from shardemu.sparsity.masks import check_blocks, densities, sparse_leaves
from shardemu.sparsity.wrapper import SparseState, apply_masks, mask_counts, wrap_optax

__all__ = [
    "SparseState",
    "apply_masks",
    "check_blocks",
    "densities",
    "mask_counts",
    "opt_state_shardings",
    "sparse_leaves",
    "wrap_optax",
]


def opt_state_shardings(
    inner: optax.GradientTransformation, state: Any, param_shardings: Any, logical: Any,
    replicated: NamedSharding,
) -> Any:  # fmt: skip
    """Shardings of an optimizer state: each copy of the parameter tree sharded like the
    parameters, everything else replicated. A `SparseState`'s masks are sharded like
    their kernels (a dense leaf's scalar mask is replicated); `inner` is the wrapped
    transformation (optax's `tree_map_params` cannot see through `wrap_optax`)."""

    def params_like(shapes: Any) -> Any:
        return optax.tree_map_params(
            inner, lambda _, sh: sh, shapes, param_shardings,
            transform_non_params=lambda _: replicated,
        )  # fmt: skip

    if not isinstance(state, SparseState):
        return params_like(state)
    masks = jax.tree.map(
        lambda sparse, sh: sh if sparse else replicated, sparse_leaves(logical), param_shardings
    )
    return SparseState(params_like(state.inner), masks, replicated)
