"""Checks every config runs on construction, and the limits they hold values to."""

from __future__ import annotations

import math
import typing
from typing import Any

from shardemu.errors import ConfigError


def require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


def require_finite(owner: str, positive: bool, **values: float) -> None:
    """Each value a finite real number, > 0 or >= 0 (NaN fails every comparison, so
    it is tested for apart)."""
    for name, value in values.items():
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise ConfigError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


SEED_LIMIT = 2**32  # numpy.random.default_rng and jax.random.key take seeds below this
# Tokens per step beyond which shapes stop being countable: activations are tokens x width
# elements, and XLA's dimension arithmetic is int64 (2**40 tokens x 2**17 width < 2**63).
MAX_TOKENS_PER_STEP = 2**40
# Steps a run can count: optax's step counter (`ScaleByAdamState.count`) and the
# learning-rate schedule's step are int32 arrays.
MAX_STEPS = 2**31 - 1


def require_choice(config: object, name: str, choices: Any) -> None:
    """`config.name` one of the values of the `Literal` type `choices`."""
    value, allowed = getattr(config, name), typing.get_args(choices)
    if value not in allowed:
        raise ConfigError(
            f"{type(config).__name__}.{name} must be one of {', '.join(map(str, allowed))}, "
            f"got {value!r}"
        )
