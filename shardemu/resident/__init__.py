"""The resident engine: every weight on device, the whole step one sharded `jax.jit`."""
