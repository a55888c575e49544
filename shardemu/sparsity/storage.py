"""The host tier's compressed layout of sparse weights: what streaming them moves.

A sparse kernel is stored block-COO, shard by shard: every non-zero block's `b x b`
values, and its coordinates (layer, block row, block column) as three int32s, the
layout of a block-sparse matrix in PopSparse (Li et al. 2023, "PopSparse: accelerated
block sparse matrix multiplication on IPU", section 3: non-zero blocks plus their
indices) and of the sparse weights MemoryX streams to a CS-2 (Cerebras, "Weight
streaming", 2022: only non-zero weights move). Dense leaves (biases, norms) are stored
whole. Blocks never cross shard boundaries (`masks.check_blocks`), so each device's
shard is compressed on its own.

JAX needs static shapes, so the arrays that really move hold the zeros too; the ledger
records the bytes of this layout instead, counted from the masks shard by shard (a
dynamic pattern's per-shard counts change from update to update, so nothing but the
masks can say them). A plan has no masks and counts each shard at its kernel's density.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardemu.accounting.sizes import bytes_all_devices
from shardemu.config import SparsityConfig
from shardemu.sparsity.masks import block_mask, densities, is_sparse, matrix_shape

INDEX_BYTES = 3 * 4  # (layer, block row, block column), int32 each


def block_bytes(block: int, itemsize: int) -> int:
    """Bytes one non-zero block takes: its values and its coordinates."""
    return block * block * itemsize + INDEX_BYTES


def compressed_bytes(weights: Any, masks: Any, logical: Any, cfg: SparsityConfig) -> int:
    """Bytes over all devices of `weights` (arrays or shapes with their shardings) in the
    compressed layout. `masks`: concrete masks (a real step) or their shapes (a plan)."""
    flat = jax.tree_util.tree_flatten_with_path(weights)[0]
    axes = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    density = densities(weights, logical, cfg)
    total = 0
    for (path, w), m, names in zip(flat, jax.tree.leaves(masks), axes, strict=True):
        if not is_sparse(path):
            total += bytes_all_devices(w)
            continue
        per_block = block_bytes(cfg.block, w.dtype.itemsize)
        concrete = isinstance(m, jax.Array | np.ndarray)
        mask = np.asarray(jax.device_get(m)) if concrete else None
        for index in w.sharding.devices_indices_map(w.shape).values():
            if mask is not None:
                count = int(block_mask(mask[index], names, cfg.block).sum())
            else:  # a plan: the shard's blocks at the kernel's density
                layers, rows, cols = matrix_shape(w.sharding.shard_shape(w.shape), names)
                count = round(density[path] * layers * rows * cols / cfg.block**2)
            total += count * per_block
    return total
