"""One training loop for every engine, with hooks.

The loop steps an `Engine` (`engine.py`), times each step, and hands every step's
record to its hooks (levanter's `Trainer.add_hook(fn, every=)` is the model). The run
directory, progress bars and trackers are hooks: adding one does not touch the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardemu.run.engine import Engine, StepResult


@dataclass(frozen=True)
class StepInfo:
    """What a hook sees after a step: its number, its record (`metrics.jsonl`'s line)
    and the engine's result."""

    step: int
    record: dict[str, Any]
    result: StepResult


Hook = Callable[[StepInfo], None]
Derive = Callable[[StepInfo], dict[str, Any]]


class TrainLoop:
    def __init__(
        self,
        engine: Engine,
        batches: Callable[[int], dict[str, np.ndarray]],
        static: dict[str, Any] | None = None,
        derive: Sequence[Derive] = (),
    ) -> None:
        """`batches(step)` gives each step's global batch; `static` adds fields that
        every step's record carries (tokens per step, the analytic model FLOPs, ...),
        which the engine's own counts override; each of `derive` adds fields computed
        from the step so far (throughput, the learning rate, a prediction, a held-out
        loss)."""
        self.engine, self.batches, self.static = engine, batches, static or {}
        self.derive = list(derive)
        self._hooks: list[tuple[Hook, int]] = []

    def add_hook(self, fn: Hook, every: int = 1) -> None:
        """Call `fn` after every `every`-th step (and after the last)."""
        if every < 1:
            raise ValueError(f"a hook's `every` must be >= 1, got {every}")
        self._hooks.append((fn, every))

    def run(
        self,
        state: Any,
        steps: int,
        start: int = 0,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> tuple[Any, list[dict[str, Any]]]:
        """Steps `start` .. `steps - 1` from `state` (the state after `start` steps): the
        final state and every step's record. `stop_requested` is asked before each step;
        when it says yes the loop ends there, so a step is never cut in half."""
        records = []
        for step in range(start, steps):
            if stop_requested():
                break
            batch = self.batches(step)
            t0 = time.perf_counter()
            result = self.engine.step(state, batch)  # loss and norm are host floats: done
            elapsed = time.perf_counter() - t0
            state = result.state
            record = {
                "step": step,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "step_time_s": elapsed,
                **self.static,
                **result.counts,
            }
            for fn in self.derive:
                record.update(fn(StepInfo(step, record, result)))
            records.append(record)
            info = StepInfo(step, record, result)
            for fn, every in self._hooks:
                if (step + 1) % every == 0 or step == steps - 1:
                    fn(info)
        return state, records
