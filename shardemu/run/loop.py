"""One training loop for every engine, with hooks.

The loop steps an `Engine` (`engine.py`), times each step, and hands every step's
record to its hooks (levanter's `Trainer.add_hook(fn, every=)` is the model). The run
directory, progress bars and trackers are hooks: adding one does not touch the loop.
`training_loop` is a run's loop: its corpus, and the fields each step's record derives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardemu.accounting import flops
from shardemu.config import Parallelism, TrainConfig
from shardemu.data import make_corpus
from shardemu.models import Model
from shardemu.numerics.optim import learning_rate_at
from shardemu.parallel.schedules import make_schedule
from shardemu.predict.costmodel import Timeline
from shardemu.run.engine import Engine, StepResult

EVAL_BATCHES = 4  # held-out batches of the run's batch size, the same at every evaluation


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


def training_loop(
    model: Model,
    engine: Engine,
    par: Parallelism,
    train_cfg: TrainConfig,
    predictor: Callable[[int], tuple[Timeline, dict[str, Any]]] | None,
    eval_every: int | None = None,
) -> TrainLoop:
    """The training loop over the run's corpus (`--data`; step k trains on batch k). A
    step's record carries, besides the engine's counts: the learning rate it applied,
    tokens and sequences per second, the device tier's high-water mark, with a
    `predictor` the step's predicted time on the hardware, and every `eval_every` steps
    and after the last, the loss of `EVAL_BATCHES` held-out batches (`val_loss`)."""
    corpus = make_corpus(train_cfg.data, model.cfg.vocab_size, train_cfg.seed)
    schedule = make_schedule(
        train_cfg.schedule, par.pipe, train_cfg.microbatches, train_cfg.virtual,
        train_cfg.microbatch_group,
    )  # fmt: skip
    static = {
        "tokens": train_cfg.tokens,
        "sequences": train_cfg.batch,
        "bubble_fraction": schedule.bubble_fraction if engine.name == "pipelined" else 0.0,
        "model_flops_analytic": flops.training_step(model, train_cfg.batch, train_cfg.seq),
    }

    def rates(info: StepInfo) -> dict[str, Any]:
        record = info.record
        seconds = record["step_time_s"]
        return {
            "learning_rate": learning_rate_at(train_cfg, record["step"]),
            "tokens_per_s": record["tokens"] / seconds,
            "sequences_per_s": record["sequences"] / seconds,
            "device_high_water_bytes": engine.device_bytes(),
        }

    def predicted(info: StepInfo) -> dict[str, Any]:
        return {"predicted_step_s": predictor(info.step)[1]["step_time_s"]}

    held_out: list[dict[str, Any]] = []

    def validation(info: StepInfo) -> dict[str, Any]:
        if (info.step + 1) % eval_every and info.step != train_cfg.steps - 1:
            return {}
        if not held_out:
            val = make_corpus(train_cfg.data, model.cfg.vocab_size, train_cfg.seed, "validation")
            held_out.extend(
                model.batch(val, i, train_cfg.batch, train_cfg.seq) for i in range(EVAL_BATCHES)
            )
        return engine.evaluate(info.result.state, held_out)

    derive = [rates]
    if predictor is not None:
        derive.append(predicted)
    if eval_every is not None:
        derive.append(validation)
    return TrainLoop(
        engine,
        lambda step: model.batch(corpus, step, train_cfg.batch, train_cfg.seq),
        static,
        derive,
    )
