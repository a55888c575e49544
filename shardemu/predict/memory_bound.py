"""A resident layout's least device bytes with nothing compiled: the microbatch's
weights, optimizer state and layer input from their shapes, and what a layer keeps for
its backward from its traced (not compiled) forward. A search judges memory first
(`search.py`, `resident_memory.device_bytes_at_least`), and most layouts that do not fit
would compile only to find that out.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.sharding import NamedSharding

from shardemu.accounting.count import PROCESS_COUNTER
from shardemu.accounting.matmuls import compute_itemsize, squeezed
from shardemu.accounting.sizes import bytes_per_device, copies
from shardemu.predict.resident_count import (
    CountKey,
    Microbatch,
    one_stage,
    optimizer_state,
    shared_reads,
)
from shardemu.stages.pieces import Piece


@functools.lru_cache(maxsize=256)
def memory_bound(key: CountKey) -> Microbatch:
    """`counted_microbatch`'s bytes (`count_key`), with nothing compiled and no pieces.
    Exact, but for what a layer keeps for its backward without full
    recomputation: those residuals' shardings are XLA's choice, made as it compiles, so
    each counts at least its bytes over the `tensor` x `context` devices (the most it
    is split over), or exactly where the piece declares its sharding. (The vjp of GPT-3
    175B's layer at tensor 8: at least 1.22 GB a device, 2.49 GB counted.)"""
    model, tensor, microbatch_size, seq, full, precision, fused_attention, rules, context = key
    built, st, shared, layer, batch, settings = one_stage(
        model, tensor, microbatch_size, seq, precision, rules, context
    )
    # traced through the process counter, whose count of the microbatch then reuses it
    embed = (shared, batch)
    leaves, tree = PROCESS_COUNTER.outputs(
        Piece.EMBED, st.fn(Piece.EMBED), st.mesh, embed, settings, embed
    )
    x, mask = tree.unflatten(leaves)  # shardings declared: nothing compiled
    if full:
        keep = bytes_per_device(x)
    else:
        leaves, tree = PROCESS_COUNTER.traced(
            Piece.FWD_KEEP, st.fn(Piece.FWD_KEEP), st.mesh, (layer, x, mask), settings
        )
        _, vjp = tree.unflatten(leaves)
        scores = (microbatch_size, model.cfg.num_heads, seq, seq)
        keep = sum(
            _bytes_at_least(leaf, tensor * context)
            for leaf in jax.tree.leaves(vjp)
            if not (fused_attention and squeezed(leaf.shape) == squeezed(scores))
        )
    opt = (
        bytes_per_device(optimizer_state(built.tx_layers, layer, st.layer_opt)),
        bytes_per_device(optimizer_state(built.tx_shared, shared, st.shared_opt)),
    )
    return Microbatch(
        {},
        bytes_per_device(layer),
        bytes_per_device(shared),
        keep,
        opt,
        bytes_per_device(x),
        copies(x),
        reads=shared_reads(st, shared, batch),
        weight_itemsize=compute_itemsize(layer),
    )


def _bytes_at_least(leaf: Any, devices: int) -> int:
    """Bytes a device holds of a traced output: its shard's where its sharding is
    declared, else at least its bytes over all `devices`."""
    if isinstance(leaf.sharding, NamedSharding):
        return bytes_per_device(leaf)
    return math.prod(leaf.shape) * leaf.dtype.itemsize // devices
