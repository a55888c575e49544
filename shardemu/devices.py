"""Virtual CPU devices: real JAX devices, as many as asked, on one machine.

XLA's CPU backend can present N devices (`jax_num_cpu_devices`), but only if told before
the backend starts; afterwards the count is fixed for the life of the process (JAX
refuses the setting then). This module turns that rule into a clear error instead of a
silent wrong count.
"""

from __future__ import annotations

import jax

from shardemu.errors import DeviceError

# Past 2048 virtual CPU devices XLA refuses to compile in one process ("Multiprocess
# computations aren't implemented on the CPU backend"; measured with jax 0.10.2).
MAX_VIRTUAL_DEVICES = 2048


def use_virtual_devices(n: int) -> list[jax.Device]:
    """Make JAX present `n` virtual CPU devices and return them.

    Must run before any JAX computation in the process (the backend reads the count
    once). Once the backend has started, a call returns its first `n` CPU devices if it
    has that many (so a test suite started with 8 devices can run a 4-device command in
    process), and refuses otherwise. The CPU platform is selected explicitly, so on a
    machine with an accelerator this still gives CPU devices; to use real accelerators,
    skip this call and pass `jax.devices()` to `make_mesh`.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise DeviceError(f"use_virtual_devices needs a positive device count, got {n!r}")
    if n > MAX_VIRTUAL_DEVICES:
        raise DeviceError(
            f"{n} virtual devices are more than the {MAX_VIRTUAL_DEVICES} that XLA's CPU "
            f"backend compiles for in one process; use a smaller mesh (plans count a "
            f"representative stage: `shardemu plan` without --phased needs only --mesh tensor)"
        )
    try:
        jax.config.update("jax_num_cpu_devices", n)
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
