"""The ledger: every transfer, collective and phase computation of a run, as events.

An event records where it happened (step, phase), what it was (`kind`: h2d, d2h,
collective or compute), what it carried (weights, gradients, activations,
optimizer_state), over which mesh axis, on how many devices, and its bytes (summed over
those devices) and FLOPs (summed over those devices). A collective also names its `op`
and `group` size, and its bytes are those its devices send (`collectives.py`); a compute
event names the tier it ran in (`on`) and how many of its FLOPs recompute a forward pass
(`recompute_flops`). Per-step totals are what `metrics.jsonl` reports; the event list is
what `ledger.json` holds.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["h2d", "d2h", "collective", "compute"]
Carries = Literal["weights", "gradients", "activations", "optimizer_state", ""]
Where = Literal["device", "host"]


@dataclass(frozen=True)
class Event:
    step: int
    phase: str
    kind: Kind
    carries: Carries
    bytes: int = 0
    flops: float = 0.0
    axis: str | None = None
    devices: int = 1
    op: str = ""
    group: int = 1
    on: Where = "device"
    recompute_flops: float = 0.0
    stage: int = 0  # the pipeline stage whose devices did it (the sender, for a p2p)


class Ledger:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def record(self, event: Event) -> None:
        self.events.append(event)

    def step_totals(self, step: int) -> dict[str, Any]:
        """The metrics of one step: `flops` (executed), `model_flops` (forward and
        backward without recomputation or the optimizer, as in model FLOPs utilisation:
        Chowdhery et al. 2022, "PaLM", Appendix B), `bytes_h2d`, `bytes_d2h`,
        `bytes_h2d_weights`, `bytes_d2h_gradients` and `bytes_collective` by mesh axis."""
        totals: dict[str, Any] = {
            "flops": 0.0,
            "model_flops": 0.0,
            "bytes_h2d": 0,
            "bytes_d2h": 0,
            "bytes_h2d_weights": 0,
            "bytes_d2h_gradients": 0,
        }
        collective: dict[str, int] = defaultdict(int)
        for e in self.events:
            if e.step != step:
                continue
            totals["flops"] += e.flops
            if e.kind == "compute" and e.carries != "optimizer_state":
                totals["model_flops"] += e.flops - e.recompute_flops
            if e.kind in ("h2d", "d2h"):
                totals[f"bytes_{e.kind}"] += e.bytes
            if e.kind == "h2d" and e.carries == "weights":
                totals["bytes_h2d_weights"] += e.bytes
            if e.kind == "d2h" and e.carries == "gradients":
                totals["bytes_d2h_gradients"] += e.bytes
            if e.kind == "collective":
                collective[e.axis or "?"] += e.bytes
        totals["bytes_collective"] = dict(collective)
        return totals

    def to_json(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(e) for e in self.events]

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n")
