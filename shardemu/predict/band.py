"""How far to trust a prediction: the same counted step timed at both ends of the spread
of the profile's estimates.

A step's counts are exact (XLA's, for the shapes the target runs); what turns them into
seconds and fits holds estimates (`Hardware`):

- `efficiency`, the fraction of peak that compute achieves (and with it the fused
  attention and FP8 kernels' own, where a profile gives them), known within a factor
  e^(+-efficiency_spread): measured on the H100, borrowed elsewhere, calibrated on one
  published run on the IPU (its spread assumed), assumed on the CS-2 (`profiles.py` and
  `graphcore.py` say which);
- which kernels the non-matmul bytes move through, where a roofline times them: those
  XLA's CPU backend emitted (a ceiling) or the same work fused between matmuls as an
  accelerator stack fuses it (a floor; `Hardware.kernel_fusion`);
- the device memory the allocator cannot hand out (`memory_fragmentation`, from none to
  `memory_fragmentation_max`).

The fast end takes the higher efficiency and fused kernels, the slow end the lower
efficiency and emitted kernels; the step is timed at each end by the same cost model
(`costmodel.build_timeline`, or `periodic.py`'s extrapolation), never scaled. Every
other input (bandwidths, peaks, latencies) is a datasheet figure and stays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardemu.predict.hardware import Hardware


@dataclass(frozen=True)
class Band:
    """A prediction's low-high band: the step time at the fast and the slow end of the
    estimates, and whether the device memory fits with no fragmentation and with the
    most (None: no memory was given)."""

    step_time_s: tuple[float, float]  # (fast end, slow end)
    efficiency: tuple[float, float]  # (slow end, fast end)
    kernel_fusion: tuple[str, str]  # (fast end, slow end)
    memory_fragmentation: tuple[float, float]  # (none, the most)
    device_fits: tuple[bool, bool] | None = None  # (with none, with the most)

    def to_json(self) -> dict[str, Any]:
        out = {
            "step_time_s": list(self.step_time_s),
            "efficiency": list(self.efficiency),
            "kernel_fusion": list(self.kernel_fusion),
            "memory_fragmentation": list(self.memory_fragmentation),
        }
        if self.device_fits is not None:
            out["device_fits"] = list(self.device_fits)
        return out


def ends(hw: Hardware) -> tuple[Hardware, Hardware]:
    """(fast, slow): `hw` with its estimates at either end of their spread. Kernel fusion
    matters only to a roofline (a profile with `memory_gbps`); efficiency stays <= 1."""
    roofline = hw.memory_gbps is not None

    def scaled(sign: int) -> dict[str, float | None]:  # every efficiency, one factor
        factor = math.exp(sign * hw.efficiency_spread)
        values = {
            k: getattr(hw, k) for k in ("efficiency", "attention_efficiency", "fp8_efficiency")
        }
        return {k: None if v is None else min(1.0, v * factor) for k, v in values.items()}

    fast = dataclasses.replace(
        hw, **scaled(1), kernel_fusion="fused" if roofline else hw.kernel_fusion
    )
    slow = dataclasses.replace(
        hw, **scaled(-1), kernel_fusion="emitted" if roofline else hw.kernel_fusion
    )
    return fast, slow


def band_of(
    step_at: Callable[[Hardware], float],
    hw: Hardware,
    step: float,
    device_bytes: int | None,
) -> Band:
    """The band of a step of `step` seconds on `hw`, which `step_at(profile)` times on
    another profile. The band holds `step` itself (a schedule can, rarely, finish later
    when one of its spans gets shorter: Graham 1969's anomalies)."""
    fast, slow = ends(hw)
    low, high = step_at(fast), step_at(slow)
    fragmentation = (0.0, hw.memory_fragmentation_max)
    fits = None
    if device_bytes is not None:
        fits = tuple(device_bytes <= hw.usable_device_bytes(f) for f in fragmentation)
    return Band(
        step_time_s=(min(low, step), max(high, step)),
        efficiency=(slow.efficiency, fast.efficiency),
        kernel_fusion=(fast.kernel_fusion, slow.kernel_fusion),
        memory_fragmentation=fragmentation,
        device_fits=fits,  # type: ignore[arg-type]
    )
