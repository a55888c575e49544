"""What a planned step comes to on a hardware profile: its `Prediction` (the step time,
its breakdown, utilisation, tokens per second, its band) and the memory each tier holds
per device against the profile's capacity, which every fit is judged on.

The timeline the step time is read from is `costmodel.py`'s; its low-high band,
`band.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger import Event
from shardemu.config import Parallelism
from shardemu.errors import CapacityError
from shardemu.predict.band import Band, band_of
from shardemu.predict.costmodel import Timeline, build_timeline, step_seconds
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap


@dataclass(frozen=True)
class TierUse:
    """Bytes per device a memory tier holds, against the profile's capacity."""

    bytes: int
    capacity: int  # the device tier's: what the allocator hands out (`memory_fragmentation`)
    fragmentation: float = 0.0  # of the tier, left out of `capacity`

    @property
    def fits(self) -> bool:
        return self.bytes <= self.capacity


@dataclass(frozen=True)
class Prediction:
    """The numbers a user asks of a step first: its time, the time's breakdown, the
    stage on the critical path, utilisation (model FLOPs / (devices * peak * step time),
    as model FLOPs utilisation: Chowdhery et al. 2022, Appendix B; the peak of the plan's
    precision, FP8's the 16-bit one, so an FP8 step's can pass the BF16 kernels'
    efficiency: `Hardware.at_precision`), tokens per second,
    memory per device per tier (None when the caller gave none), which kernels the
    roofline timed (`Hardware.kernel_fusion`) and at what fraction of their peak
    (`Hardware.kernel_efficiencies`)."""

    hardware: str
    step_time_s: float
    breakdown: dict[str, float]
    critical_stage: int
    utilisation: float
    tokens_per_s: float
    memory_per_device: dict[str, TierUse] | None = None
    kernel_fusion: str = "emitted"
    band: Band | None = None  # the step at both ends of the estimates' spread (`band.py`)
    kernel_efficiencies: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "hardware": self.hardware,
            "kernel_fusion": self.kernel_fusion,
            "kernel_efficiencies": self.kernel_efficiencies,
            "step_time_s": self.step_time_s,
            "breakdown": self.breakdown,
            "critical_stage": self.critical_stage,
            "utilisation": self.utilisation,
            "tokens_per_s": self.tokens_per_s,
        }
        if self.memory_per_device is not None:
            out["memory_per_device"] = {
                tier: {"bytes": use.bytes, "capacity": use.capacity, "fits": use.fits}
                | ({"fragmentation": use.fragmentation} if tier == "device" else {})
                for tier, use in self.memory_per_device.items()
            }
        if self.band is not None:
            out["band"] = self.band.to_json()
        return out


def predict(
    events: Sequence[Event] | AssembledLedger,
    hw: Hardware,
    par: Parallelism,
    model_flops: float,
    tokens: int,
    memory: dict[str, int] | None = None,
    overlap: Overlap = DEFAULT_OVERLAP,
    band: bool = True,
) -> tuple[Timeline, Prediction]:
    """The timeline of one step on `hw`, and its `Prediction` (`memory`: bytes per
    device by tier, checked against the profile's capacities), with its band unless
    `band` is False (two more timelines: a search ranks by the step alone)."""
    t = build_timeline(events, hw, par, overlap)
    step, breakdown, stage = t.step_time_s, t.breakdown, t.critical_stage
    ends = None
    if band:
        ends = band_of(
            lambda h: step_seconds(events, h, par, overlap),
            hw,
            step,
            (memory or {}).get("device"),
        )
    return t, prediction_of(step, breakdown, stage, hw, par, model_flops, tokens, memory, ends)


def prediction_of(
    step: float,
    breakdown: dict[str, float],
    critical_stage: int,
    hw: Hardware,
    par: Parallelism,
    model_flops: float,
    tokens: int,
    memory: dict[str, int] | None,
    band: Band | None = None,
) -> Prediction:
    """The `Prediction` of a step of `step` seconds on `hw` (`memory`: bytes per
    device by tier, checked against the profile's capacities), with its `band`."""
    capacity = capacities(hw)
    return Prediction(
        hardware=hw.name,
        step_time_s=step,
        breakdown=breakdown,
        critical_stage=critical_stage,
        utilisation=model_flops / (par.num_devices * hw.peak_tflops * 1e12 * step) if step else 0.0,
        tokens_per_s=tokens / step if step else 0.0,
        memory_per_device=None
        if memory is None
        else {
            tier: TierUse(used, capacity[tier], hw.memory_fragmentation if tier == "device" else 0)
            for tier, used in memory.items()
        },
        kernel_fusion=hw.kernel_fusion,
        band=band,
        kernel_efficiencies=hw.kernel_efficiencies(),
    )


def capacities(hw: Hardware) -> dict[str, int]:
    """Bytes per device each memory tier of `hw` holds (the device tier's less the
    allocator's fragmentation: `Hardware.device_memory_bytes`)."""
    return {"device": hw.device_memory_bytes, "host": hw.host_memory_bytes}


def require_fit(memory: dict[str, int], hw: Hardware, layout: str, at_least: bool = False) -> None:
    """Raise `CapacityError` (with the device bytes) if `memory` (bytes per device by
    tier; with `at_least`, a lower bound of them) overflows a tier of `hw`: a search
    times only the layouts that fit."""
    capacity = capacities(hw)
    over = {t: (used, capacity[t]) for t, used in memory.items() if used > capacity[t]}
    if over:
        least = "at least " if at_least else ""
        told = "; ".join(f"{t} {least}{used:,} bytes > {cap:,}" for t, (used, cap) in over.items())
        raise CapacityError(
            f"{layout} does not fit {hw.name} per device: {told}",
            needed=memory.get("device"),
            at_least=at_least,
        )
