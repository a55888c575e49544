"""One interface for every engine: `init(seed) -> state`, `step(state, batch) ->
StepResult`.

The training loop (`loop.py`) drives any engine the same way: it does not know whether
weights stay on the devices (resident, `resident.py`, GPipe over `pipe` when the mesh
has stages) or stream in from the host tier phase by phase (`phased/trainer.py`). A
step's result carries its loss, its gradient norm and its counts (the ledger totals of
the step: FLOPs, bytes by tier and by mesh axis), which the loop records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np

from shardemu.phased.trainer import PhasedTrainer
from shardemu.training.resident import Trainer


@dataclass
class StepResult:
    """What one training step produced: the next state, its loss and gradient norm
    (host floats: the step has finished), and its counts for `metrics.jsonl`."""

    state: Any
    loss: float
    grad_norm: float
    counts: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    name: str

    def init(self, seed: int) -> Any:
        """Parameters and optimizer state, where this engine keeps them."""

    def step(self, state: Any, batch: dict[str, np.ndarray]) -> StepResult:
        """One optimizer step on a global batch (host arrays)."""


class ResidentEngine:
    """Weights and optimizer state on the devices; one compiled step (`Trainer`)."""

    name = "resident"

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def init(self, seed: int) -> tuple[Any, Any]:
        self.trainer.compiled()  # compile before the first step, so steps time alone
        return self.trainer.init(seed)

    def step(self, state: tuple[Any, Any], batch: dict[str, np.ndarray]) -> StepResult:
        out = self.trainer.step(*state, batch)
        return StepResult((out.params, out.opt_state), float(out.loss), float(out.grad_norm))


class PhasedEngine:
    """Weights and optimizer state in the host tier, streamed per phase."""

    name = "phased"

    def __init__(self, trainer: PhasedTrainer, init_shardings: Any) -> None:
        """`init_shardings`: where to create the parameters before they go to the host
        tier (the resident shardings: no device holds the whole model)."""
        self.trainer, self.init_shardings = trainer, init_shardings

    def init(self, seed: int) -> Any:
        init = jax.jit(self.trainer.model.init_params, out_shardings=self.init_shardings)
        return self.trainer.init(init(jax.random.key(seed)))

    def step(self, state: Any, batch: dict[str, np.ndarray]) -> StepResult:
        out = self.trainer.step(state, batch)
        counts = self.trainer.ledger.step_totals(self.trainer.steps_done - 1)
        return StepResult(out.state, out.loss, out.grad_norm, counts)
