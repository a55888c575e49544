"""Virtual CPU devices: real JAX devices, as many as asked, on one machine.

XLA's CPU backend can present N devices (`jax_num_cpu_devices`), but only if told before
the backend starts; afterwards the count is fixed for the life of the process (JAX
refuses the setting then). This module turns that rule into a clear error instead of a
silent wrong count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardemu.errors import DeviceError

# Past 2048 virtual CPU devices XLA refuses to compile in one process ("Multiprocess
# computations aren't implemented on the CPU backend"; measured with jax 0.10.2).
MAX_VIRTUAL_DEVICES = 2048


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# freed memory kept for reuse before glibc gives it back to the kernel
KEEP_FREED_BYTES = 1 << 30


def reuse_host_memory() -> bool:
    """Let XLA's CPU runtime reuse freed memory instead of mapping fresh pages each step.

    An executable allocates its temporaries (one block per device per step, 125 MB per
    device for the overhead benchmark's GPT at tensor=8) from the thread that runs it.
    glibc serves a block that large from a thread's arena with mmap and unmaps it on
    free, so every step the kernel maps and zeroes every page again: measured with
    perf, a third of that step's CPU time was page faults and `sys` time was 0.8 s of a
    1.5 s step. With one arena, no mmap and a 1 GiB trim threshold the blocks come back
    from the heap already mapped (`sys` 0.04 s; steps 20-25% faster on every mesh in
    interleaved runs, within the noise in others). One arena makes XLA's compiler
    threads share a lock: compiling took about 10% longer, and the test suite's
    compile-bound files 25-30% longer, so only stepping processes ask for it.
    Must run before the backend starts its threads: an arena is picked per thread on
    its first allocation. Returns False where the C library is not glibc (nothing set).
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, KEEP_FREED_BYTES))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def use_virtual_devices(n: int, reuse_memory: bool = False) -> list[jax.Device]:
    """Make JAX present `n` virtual CPU devices and return them.

    Must run before any JAX computation in the process (the backend reads the count
    once). Once the backend has started, a call returns its first `n` CPU devices if it
    has that many (so a test suite started with 8 devices can run a 4-device command in
    process), and refuses otherwise. The CPU platform is selected explicitly, so on a
    machine with an accelerator this still gives CPU devices; to use real accelerators,
    skip this call and pass `jax.devices()` to `make_mesh`. `reuse_memory` tunes the
    C library's allocator for XLA's per-step buffers (`reuse_host_memory`): for
    processes that step (`shardemu run`, the timing benchmarks), not for those that
    mostly compile, which it slows.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise DeviceError(f"use_virtual_devices needs a positive device count, got {n!r}")
    if n > MAX_VIRTUAL_DEVICES:
        raise DeviceError(
            f"{n} virtual devices are more than the {MAX_VIRTUAL_DEVICES} that XLA's CPU "
            f"backend compiles for in one process; use a smaller mesh (plans count a "
            f"representative stage: a resident plan needs only the mesh's tensor devices)"
        )
    try:
        jax.config.update("jax_num_cpu_devices", n)
        if reuse_memory:  # the backend has not started: its threads are not made yet
            reuse_host_memory()
    except RuntimeError:  # the backend already started: its device count is fixed
        have = jax.devices("cpu")
        if len(have) >= n:
            return list(have[:n])
        raise DeviceError(
            f"the JAX backend already started with {len(have)} CPU device(s), so "
            f"use_virtual_devices({n}) cannot take effect. Call it before any JAX "
            f"operation (first thing after `import jax`), or start a new process; "
            f"in a test suite, set the count once in conftest.py"
        ) from None
    jax.config.update("jax_platforms", "cpu")
    return list(jax.devices())


def settled(tree: Any) -> Any:
    """`tree`, finished computing when this process shares its mesh with others.

    Across processes (`run --processes`) the gloo CPU collectives of programs in flight
    together can wait on each other for ever: a phased run with rts 2 hung with every
    XLA CPU thread of both processes inside a gloo all-reduce (gdb, jax 0.10.2), its
    prefetch and its gradient transfers dispatched asynchronously side by side. One
    program at a time, issued in the same order by every process, cannot. One process
    keeps JAX's asynchronous dispatch, where XLA's in-process rendezvous orders them.
    """
    if jax.process_count() > 1:
        jax.block_until_ready(tree)
    return tree


def host_value(x: jax.Array) -> float:
    """The scalar `x` as a Python float in every process, wherever it lies. Across
    processes a pipeline stage's values live on its own process's devices alone: the
    first process that holds `x` sends it to the others (`broadcast_one_to_all`, a sum
    over every device, which every process calls here in the same order)."""
    # decided on what every process knows alike, so that all take the same branch
    holders = {d.process_index for d in x.sharding.device_set}
    if len(holders) == jax.process_count():  # a shard here: a scalar's shard is whole
        return float(x.addressable_shards[0].data)
    source = min(holders)
    mine = jax.process_index() == source
    value = np.float32(x.addressable_shards[0].data if mine else 0.0)
    return float(multihost_utils.broadcast_one_to_all(value, is_source=mine))
