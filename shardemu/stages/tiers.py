"""Memory tiers: the device tier (per device, in HBM / in-processor memory) and the host
tier (streaming memory: IPU-M2000 DDR, Cerebras MemoryX, host DRAM).

Host-tier arrays are real JAX arrays whose sharding has `memory_kind="pinned_host"`;
bringing one in is a real `jax.device_put` to `memory_kind="device"` (both kinds exist
on the CPU backend, and the same calls move real bytes on GPUs and TPUs). The device
tier tracks what it holds per device, its high-water mark, and refuses to exceed its
capacity; the executor (`executor.py`) moves arrays between the tiers and records every
transfer in the ledger with its bytes over all devices. Host-tier capacity (terabytes of
streaming memory in the source systems) is reported by the plan, not enforced.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import NamedSharding

from shardemu.errors import CapacityError


def with_memory_kind(shardings: Any, kind: str) -> Any:
    """`shardings` (a tree of them) in memory `kind`."""
    return jax.tree.map(
        lambda s: _in_kind(s, kind), shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
    )


@functools.lru_cache(maxsize=4096)
def _in_kind(sharding: NamedSharding, kind: str) -> NamedSharding:
    """One sharding in memory `kind`, made once: JAX checks the kind each time it makes
    one (a phased search moved 880k leaves between tiers, 11 s of its 90 under a
    profiler)."""
    return sharding.with_memory_kind(kind)


class Tier:
    """What a tier holds, by name, in bytes per device, against a capacity."""

    def __init__(self, name: str, capacity_bytes: int | None) -> None:
        self.name = name
        self.capacity = capacity_bytes
        self.held: dict[str, int] = {}
        self.high_water = 0

    @property
    def used(self) -> int:
        return sum(self.held.values())

    def admit(self, key: str, nbytes: int, phase: object) -> None:
        if self.capacity is not None and self.used + nbytes > self.capacity:
            raise CapacityError(
                f"phase '{phase}': the {self.name} tier needs {self.used + nbytes:,} bytes per "
                f"device ({nbytes:,} for {key!r} on top of {self.used:,} held) but its "
                f"capacity is {self.capacity:,}; use more phases (PhasedConfig.phases), more "
                f"tensor sharding, or a larger PhasedConfig.device_memory"
            )
        self.held[key] = nbytes
        self.high_water = max(self.high_water, self.used)

    def release(self, key: str) -> None:
        del self.held[key]
