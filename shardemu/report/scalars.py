"""A record's numbers as the scalars a chart draws: shared by the trackers, `compare`
and `sweep`, so that each reads a run's metrics the same way."""

from __future__ import annotations

import math
from typing import Any


def scalars(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a record, nested dicts flattened with `/`
    (`bytes_collective/tensor`): what a scalar chart can draw."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            out[name] = value
    return out


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A step record's scalars without the step itself (the x axis, given apart)."""
    out = scalars(record)
    out.pop("step", None)
    return out
