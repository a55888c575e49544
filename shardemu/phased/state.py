"""What a phased run keeps between steps (`PhasedState`, all in the host tier), which
layers each phase runs on which stage (`Layout`), and what a step's forward pass leaves
for its backward (`Forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax

from shardemu.accounting.ledger import Phase
from shardemu.stages.stage import Stage


@jax.tree_util.register_dataclass
@dataclass
class PhasedState:
    """Everything a phased run keeps between steps, all in the host tier."""

    shared: Any  # embedding and head parameters (on the first stage's host memory)
    layers: list[Any]  # per phase: stacked layer parameters [L/N, ...]
    opt_shared: Any
    opt_layers: list[Any]


@dataclass(frozen=True)
class Layout:
    """Which layers each phase runs and on which stage: `slices[i]` = [start, end)."""

    slices: tuple[tuple[int, int], ...]
    stages: tuple[Stage, ...]

    @property
    def layers_per_phase(self) -> int:
        lo, hi = self.slices[0]
        return hi - lo

    def stage_of(self, phase: int) -> Stage:
        return self.stages[phase * len(self.stages) // len(self.slices)]

    def phase(self, kind: str, i: int) -> Phase:
        return Phase(kind, i, self.slices[i])  # type: ignore[arg-type]


@dataclass
class Forward:
    """What the forward pass leaves for the backward, and what each phase held."""

    loss: Any
    g_head: Any  # the head's gradient of the shared weights
    g_x: Any  # d loss / d x_N
    masks: dict[int, Any]  # attention mask on each stage
    kept: dict[int, Any]  # per phase: its residuals (keep) or its input x_i
    fetched: dict[int, Any]  # weights already requested for the backward
    gathered_bytes: list[int] = field(default_factory=list)
    activation_bytes: list[int] = field(default_factory=list)
