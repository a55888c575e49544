"""Bytes held by a tree of sharded arrays: per device (its largest shard) and over every
device that holds a copy or a shard. The ledger, the tiers and the planners all size
arrays with these two."""

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
