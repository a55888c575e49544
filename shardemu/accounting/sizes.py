"""Bytes held by a tree of sharded arrays: per device (its largest shard) and over every
device that holds a copy or a shard, and how many devices hold each byte. The ledger,
the tiers and the planners all size arrays with these."""

from __future__ import annotations

import math
from typing import Any

import jax


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded arrays (its largest shard)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def bytes_all_devices(tree: Any) -> int:
    """Bytes summed over every device holding a copy or a shard."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize * len(x.sharding.device_set)
        for x in jax.tree.leaves(tree)
    )


def copies(tree: Any) -> int:
    """How many devices hold each byte of a tree of sharded arrays: its devices over its
    distinct shards, the fewest of any leaf (an activation replicated over `tensor`:
    tensor; split over it, as sequence parallelism splits it: 1)."""
    return min((len(x.sharding.device_set) // _shards(x) for x in jax.tree.leaves(tree)), default=1)


def _shards(x: Any) -> int:
    """How many distinct shards `x`'s sharding cuts it into."""
    shard = x.sharding.shard_shape(x.shape)
    return math.prod(max(d // max(s, 1), 1) for d, s in zip(x.shape, shard, strict=True))
