"""Which weights are sparse, their blocks, and block masks.

The sparse weights are the layers' dense kernels (attention query, key, value and out;
MLP in and out), as in Dietrich et al. 2021 ("Towards structured dynamic sparse
pre-training of BERT", section 3: embeddings, norms and biases stay dense). A stacked
kernel `(layers, *in, *out)` is a stack of matrices `(rows, cols)`: the embedding width
is alone on one side (in-projections `embed | heads, head_dim` or `embed | mlp`,
out-projections `heads, head_dim | embed` or `mlp | embed`). Blocks are `b x b` squares
of that matrix. A mask is a boolean array of the kernel's own shape (so it is sharded
like the kernel), constant over each block.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shardemu.config import ConfigError, SparsityConfig

SPARSE_KERNELS = (
    ("attn", "query"),
    ("attn", "key"),
    ("attn", "value"),
    ("attn", "out"),
    ("mlp", "fc_in"),
    ("mlp", "fc_out"),
)


def _names(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def is_sparse(path: tuple) -> bool:
    """A layer kernel that block sparsity applies to, in the whole parameter tree (the
    path starts with the stack: GPT's `blocks`, BERT's `layers`) or in a stack of layers
    alone (a pipeline stage's or a phase's layers): module, dense, `kernel`."""
    names = _names(path)
    return len(names) in (3, 4) and names[-1] == "kernel" and names[-3:-1] in SPARSE_KERNELS


def kernel_id(path: tuple) -> int:
    """A number that names a sparse kernel the same way in the whole tree and in a stack
    of layers alone: random draws are keyed by it and by the layer's index in the model,
    so a stage that holds layers 4..7 draws what the whole model draws for them."""
    return zlib.crc32("/".join(_names(path)[-3:]).encode())


def layer_uniforms(
    key: jax.Array,
    kernels: Sequence[tuple[tuple, int, int]],
    first_layer: jax.Array | int,
) -> list[jax.Array]:
    """Uniform scores `(layers, blocks)` for layers `first_layer ..` of each kernel
    `(path, layers, blocks)`, keyed by the kernel (`kernel_id`) and the layer's index in
    the model. Drawn as one batch, every kernel's rows at once, as many and as wide as
    the largest kernel's, each kernel's the first `layers` rows' first `blocks`: the
    values of its own draw (a threefry draw's element depends only on its key and its
    position, with JAX's default `jax_threefry_partitionable`), from three threefry
    hashes in the program instead of three a kernel, each of which XLA's CPU backend
    compiles into code of its own (a GPT layer's six kernels: 0.32 s to compile, 0.14 s
    batched)."""
    if not kernels:
        return []
    ids = jnp.asarray([kernel_id(path) for path, _, _ in kernels], jnp.uint32)
    index = first_layer + jnp.arange(max(layers for _, layers, _ in kernels))
    widest = max(blocks for _, _, blocks in kernels)

    def rows(leaf: jax.Array) -> jax.Array:
        keys = jax.vmap(lambda i: jax.random.fold_in(leaf, i))(index)
        return jax.vmap(lambda k: jax.random.uniform(k, (widest,)))(keys)

    draws = jax.vmap(lambda i: rows(jax.random.fold_in(key, i)))(ids)
    return [draws[j, :layers, :blocks] for j, (_, layers, blocks) in enumerate(kernels)]


def split_at(logical: tuple[str, ...]) -> int:
    """Where the kernel's input dimensions end (after `layers` and the inputs)."""
    return 2 if logical[1] == "embed" else len(logical) - 1


def matrix_shape(shape: tuple[int, ...], logical: tuple[str, ...]) -> tuple[int, int, int]:
    """(layers, rows, cols) of a stacked kernel."""
    at = split_at(logical)
    return shape[0], math.prod(shape[1:at]), math.prod(shape[at:])


def sparse_leaves(logical: Any) -> Any:
    """True for the leaves of a parameter tree (given by its logical axes) that are
    sparse."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: is_sparse(path), logical, is_leaf=lambda x: isinstance(x, tuple)
    )


def check_blocks(
    shapes: Any, logical: Any, specs: Any, axis_sizes: dict[str, int], block: int
) -> None:
    """Refuse a block size that does not divide a sparse kernel's rows or columns on
    each shard (a block must never cross a shard boundary)."""
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    axes = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, shape), names, spec in zip(flat, axes, spec_leaves, strict=True):
        if not is_sparse(path):
            continue
        at = split_at(names)
        for side, dims in (("rows", range(1, at)), ("columns", range(at, len(shape.shape)))):
            shards = math.prod(_shards(spec, d, axis_sizes) for d in dims)
            extent = math.prod(shape.shape[d] for d in dims) // shards
            if extent % block:
                label = " x ".join(f"{names[d]} {shape.shape[d]}" for d in dims)
                raise ConfigError(
                    f"SparsityConfig.block {block} does not divide the {side} of "
                    f"'{'/'.join(_names(path))}' {tuple(shape.shape)}: {label} is {extent} "
                    f"per shard; use a SparsityConfig.block that divides {extent}"
                )


def _shards(spec: PartitionSpec, dim: int, axis_sizes: dict[str, int]) -> int:
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(axis_sizes[n] for n in names)


def densities(shapes: Any, logical: Any, cfg: SparsityConfig) -> dict[tuple, float]:
    """Each sparse kernel's density, by path: `uniform` gives every kernel 1 - sparsity;
    `erk` gives kernel i a density proportional to (rows + cols) / (rows * cols), capped
    at 1, with the same number of weights kept in all (Evci et al. 2020, "Rigging the
    Lottery", section 3, Erdos-Renyi-Kernel without the kernel's spatial dimensions)."""
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    axes = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    sizes = {
        path: matrix_shape(s.shape, names)
        for (path, s), names in zip(flat, axes, strict=True)
        if is_sparse(path)
    }
    if not sizes:  # nothing to make sparse: refused, not a dense run in its place
        raise ConfigError(
            f"block sparsity ({cfg.distribution}) applies to GPT's and BERT's layer kernels "
            f"({', '.join('/'.join(k) for k in SPARSE_KERNELS)}), and this tree has none; "
            "drop the sparsity, or pass the tree of a model that has them"
        )
    if cfg.distribution == "uniform":
        return dict.fromkeys(sizes, cfg.density)
    count = {p: layers * r * c for p, (layers, r, c) in sizes.items()}
    raw = {p: (r + c) / (r * c) for p, (_, r, c) in sizes.items()}
    dense: set[tuple] = set()
    while True:  # the kernels whose ERK density would pass 1 are dense; rescale the rest
        kept = cfg.density * sum(count.values()) - sum(count[p] for p in dense)
        eps = kept / sum(count[p] * raw[p] for p in count if p not in dense)
        over = {p for p in count if p not in dense and eps * raw[p] > 1}
        if not over:
            return {p: 1.0 if p in dense else eps * raw[p] for p in count}
        dense |= over


def block_norms(kernel: jax.Array, logical: tuple[str, ...], block: int) -> jax.Array:
    """The L1 norm of every block, `(layers, blocks)`."""
    layers, rows, cols = matrix_shape(kernel.shape, logical)
    x = jnp.abs(kernel.reshape(layers, rows // block, block, cols // block, block))
    return x.sum(axis=(2, 4)).reshape(layers, -1)


def block_mask(mask: jax.Array, logical: tuple[str, ...], block: int) -> jax.Array:
    """The block-level view `(layers, blocks)` of an element mask (a block's first
    element stands for the block: masks are constant over blocks)."""
    layers, rows, cols = matrix_shape(mask.shape, logical)
    return mask.reshape(layers, rows, cols)[:, ::block, ::block].reshape(layers, -1)


def expand(
    active: jax.Array, shape: tuple[int, ...], logical: tuple[str, ...], block: int
) -> jax.Array:
    """An element mask of `shape` from a block mask `(layers, blocks)`."""
    layers, rows, cols = matrix_shape(shape, logical)
    grid = active.reshape(layers, rows // block, cols // block)
    return jnp.repeat(jnp.repeat(grid, block, axis=1), block, axis=2).reshape(shape)


def top_k(scores: jax.Array, k: jax.Array) -> jax.Array:
    """True for the `k` (per row, may be traced) largest scores of each row."""
    rank = jnp.argsort(jnp.argsort(-scores, axis=1, stable=True), axis=1, stable=True)
    return rank < k[:, None]


def initial_masks(
    params: Any, logical: Any, cfg: SparsityConfig, key: jax.Array, first_layer: int = 0
) -> Any:
    """A random pattern at each kernel's density (`densities`): the same number of
    blocks kept in every layer of a stack. Dense leaves get a scalar True. `params` may
    be a stack of layers alone that starts at the model's layer `first_layer`: it gets
    the whole model's pattern for those layers (ERK's densities do not depend on how
    many layers a stack has: every kernel's count scales alike)."""
    density = densities(params, logical, cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    axes = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    leaves = zip(flat, axes, strict=True)
    sparse = [(path, p, names) for (path, p), names in leaves if path in density]
    grids = [(path, *_block_grid(p.shape, names, cfg.block)) for path, p, names in sparse]
    drawn = layer_uniforms(key, grids, first_layer)
    masks = dict.fromkeys((path for path, _ in flat), jnp.ones((), bool))
    for (path, p, names), scores in zip(sparse, drawn, strict=True):
        layers, blocks = scores.shape
        active = top_k(scores, jnp.full((layers,), round(density[path] * blocks)))
        masks[path] = expand(active, p.shape, names, cfg.block)
    return treedef.unflatten(list(masks.values()))


def _block_grid(shape: tuple[int, ...], logical: tuple[str, ...], block: int) -> tuple[int, int]:
    """(layers, blocks a layer) of a stacked kernel in `block x block` blocks."""
    layers, rows, cols = matrix_shape(shape, logical)
    return layers, (rows // block) * (cols // block)
