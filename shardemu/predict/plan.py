"""The one value both planners return: a step planned from shapes alone.

`plan_resident` and `plan_phased` count a step and assemble it; neither writes a file.
The command line, the search and the experiments write a run directory from a `Plan`
(`report/plandir.py`) or read its report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardemu.accounting.ledger import Ledger
from shardemu.config import Parallelism
from shardemu.errors import ConfigError
from shardemu.phased.planner import PhasePlan
from shardemu.predict.costmodel import Timeline
from shardemu.predict.prediction import Prediction


@dataclass(frozen=True)
class Plan:
    """A planned step: `report` (what `shardemu plan --json` prints: settings, counts,
    memory and, with hardware, the predicted step), the `ledger` of counted events it
    was assembled from, its `timeline` and `prediction` on the hardware (None without
    one) and, for a phased step, its `phase_plan`."""

    report: dict[str, Any]
    ledger: Ledger
    timeline: Timeline | None
    prediction: Prediction | None = None  # on the hardware (in `report` too)
    phase_plan: PhasePlan | None = None  # a phased plan's phases (in `report` as `plan`)

    @property
    def step_time_s(self) -> float:
        """The predicted step; a plan without hardware has none."""
        if self.prediction is None:
            raise ConfigError(
                "this plan has no prediction: plan it with a hardware profile "
                "(shardemu.get_hardware(NAME))"
            )
        return self.prediction.step_time_s

    @property
    def fits(self) -> bool:
        """Whether the step fits every memory tier of its hardware (a plan without
        hardware has no capacities to overflow)."""
        memory = self.prediction.memory_per_device if self.prediction else None
        return all(use.fits for use in (memory or {}).values())

    def to_json(self) -> dict[str, Any]:
        return self.report


def require_no_experts(par: Parallelism) -> None:
    """The phased planner counts a stage's pieces without the `expert` axis (the
    resident planner adds it: `expert_parallel.py`): refuse a phased plan of a mesh
    with expert > 1 rather than plan it as if the axis were not there."""
    if par.expert > 1:
        raise ConfigError(
            f"mesh {par}: phased plans of expert parallelism (expert > 1) are not built "
            f"yet; plan it resident (no PhasedConfig), or phased with expert=1"
        )
