"""One interface for every engine: `init(seed) -> state`, `step(state, batch) ->
StepResult`.

The training loop (`loop.py`) drives any engine the same way: it does not know whether
weights stay on the devices in one compiled step (resident, `resident.py`), sit on the
devices of their pipeline stage (pipelined, `pipelined/trainer.py`), or stream in from
the host tier phase by phase (`phased/trainer.py`). Every engine keeps a ledger of what
each step computed and moved; a step's result carries its loss, its gradient norm and
its counts (the ledger totals of the step: FLOPs, bytes by tier and by mesh axis),
which the loop records.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from shardemu.accounting import flops
from shardemu.accounting.count import PROCESS_COUNTER
from shardemu.accounting.ledger import Event, Ledger
from shardemu.accounting.sizes import bytes_per_device
from shardemu.config import PhasedConfig, TrainConfig
from shardemu.models import Model
from shardemu.numerics.precision import scale_fields
from shardemu.parallel.mesh import parallelism_of
from shardemu.parallel.rules import Rules
from shardemu.phased.trainer import PhasedTrainer
from shardemu.pipelined.layout import refuse_phased
from shardemu.pipelined.trainer import PipelinedTrainer
from shardemu.resident.trainer import Trainer, held_out, loss_terms
from shardemu.sparsity import sparse_counts
from shardemu.stages.stage import init_params


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
    ledger: Ledger

    def init(self, seed: int) -> Any:
        """Parameters and optimizer state, where this engine keeps them."""

    def step(self, state: Any, batch: dict[str, np.ndarray]) -> StepResult:
        """One optimizer step on a global batch (host arrays)."""

    def stage_meshes(self) -> list[Mesh]:
        """The meshes of the pipeline stages its arrays lie on, one each (none: the
        whole mesh)."""

    def sizes(self) -> dict[str, int]:
        """Bytes per device of the parameters and of the optimizer state (the most
        any device holds)."""

    def start_at(self, steps_done: int) -> None:
        """Number the next step `steps_done` (a run resumed from a checkpoint)."""

    def device_bytes(self) -> int:
        """The device tier's high-water mark so far, in bytes per device (the fullest
        device)."""

    def evaluate(self, state: Any, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
        """The held-out loss of `state`'s parameters on `batches` (no update):
        `val_loss`, and BERT's `val_mlm_loss`."""


def step_counts(ledger: Ledger, step: int) -> dict[str, Any]:
    """A step's ledger totals, with the bytes sent between pipeline stages apart."""
    counts = ledger.step_totals(step)
    return {**counts, "pipe_bytes": counts["bytes_collective"].get("pipe", 0)}


def sparse_fields(counts: dict[str, Any], opt_states: list[Any], tokens: int) -> dict[str, Any]:
    """A sparse run's `density` and `model_flops_sparse` (nothing for a dense run): XLA
    counts a masked matmul as dense, so the zero weights, counted from the masks in
    `opt_states`, come off its model FLOPs (`flops.without_zero_weights`)."""
    sparse = sparse_counts(opt_states)
    if not sparse:
        return {}
    return {
        "density": sparse["density"],
        "model_flops_sparse": flops.without_zero_weights(
            counts["model_flops"], tokens, sparse["zero_weights"]
        ),
    }


class ResidentEngine:
    """Weights and optimizer state on the devices; one compiled step (`Trainer`)."""

    name = "resident"

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.ledger = trainer, Ledger()
        self.steps_done = 0
        self._events: list[Event] = []  # every step's, counted once

    def stage_meshes(self) -> list[Mesh]:
        return []

    def init(self, seed: int) -> tuple[Any, Any]:
        self.trainer.compiled()  # compile (and count) before the first step, so steps time alone
        self._events = self.trainer.step_events(PROCESS_COUNTER, 0)
        return self.trainer.init(seed)

    def start_at(self, steps_done: int) -> None:
        self.steps_done = steps_done

    def step(self, state: tuple[Any, Any], batch: dict[str, np.ndarray]) -> StepResult:
        out = self.trainer.step(*state, batch)
        step, self.steps_done = self.steps_done, self.steps_done + 1
        self.ledger.events.extend(dataclasses.replace(e, step=step) for e in self._events)
        counts = step_counts(self.ledger, step)
        counts |= sparse_fields(counts, [out.opt_state], self.trainer.train.tokens)
        counts |= scale_fields(out.opt_state, self.trainer.train)
        return StepResult(
            (out.params, out.opt_state), float(out.loss), float(out.grad_norm), counts
        )

    def evaluate(self, state: tuple[Any, Any], batches: list[dict[str, np.ndarray]]) -> dict:
        """Held-out loss of `state`'s parameters (`Trainer.evaluate`)."""
        return self.trainer.evaluate(state[0], batches)

    def sizes(self) -> dict[str, int]:
        params, opt_state, _ = self.trainer.abstract_inputs()
        return {
            "param_bytes_per_device": bytes_per_device(params),
            "opt_state_bytes_per_device": bytes_per_device(opt_state),
        }

    def device_bytes(self) -> int:
        """Per device: arguments (weights, optimizer state, batch) and temporaries
        (activations) of the compiled step, by XLA's memory analysis."""
        mem = self.trainer.compiled().memory_analysis()
        return int(mem.argument_size_in_bytes + mem.temp_size_in_bytes)


class _StagedEngine:
    """What the pipelined and phased engines share: their trainer keeps the ledger and
    numbers the steps, and a step's counts are its ledger totals."""

    def __init__(self, trainer: PipelinedTrainer | PhasedTrainer) -> None:
        self.trainer, self.ledger = trainer, trainer.ledger
        self._eval: Any = None  # the jitted held-out loss, made on first use

    def start_at(self, steps_done: int) -> None:
        self.trainer.steps_done = steps_done

    def stage_meshes(self) -> list[Mesh]:
        """Each stage's mesh: its arrays lie on it alone."""
        return [st.mesh for st in self.trainer.stages]

    def step(self, state: Any, batch: dict[str, np.ndarray]) -> StepResult:
        out = self.trainer.step(state, batch)
        counts = step_counts(self.ledger, self.trainer.steps_done - 1)
        counts |= sparse_fields(counts, self.layer_opts(out.state), self.trainer.train.tokens)
        counts |= scale_fields(self.layer_opts(out.state)[0], self.trainer.train)
        return StepResult(out.state, out.loss, out.grad_norm, counts)

    def layer_opts(self, state: Any) -> list[Any]:
        """The optimizer states of the layers, part by part (a sparse run's masks)."""
        raise NotImplementedError

    def evaluate(self, state: Any, batches: list[dict[str, np.ndarray]]) -> dict:
        """Held-out loss of the run's parameters, gathered whole onto one device: these
        engines have no forward-only program, and the model and its numbers are the
        same (`held_out`)."""
        if self._eval is None:
            self._eval = jax.jit(functools.partial(loss_terms, self.trainer.model))
        params = self.trainer.params(state)
        return held_out([self._eval(params, b) for b in batches])


class PipelinedEngine(_StagedEngine):
    """Each stage's layers on its devices; the schedule executed for real."""

    name = "pipelined"
    trainer: PipelinedTrainer

    def layer_opts(self, state: Any) -> list[Any]:
        return state.opt_chunks

    def init(self, seed: int) -> Any:
        return self.trainer.init(seed)

    def sizes(self) -> dict[str, int]:
        return self.trainer.sizes()

    def device_bytes(self) -> int:
        """Per device, on the fullest stage: weights, optimizer state and the most
        activations it kept for the backward pass (its device tier's high-water)."""
        sizes = self.trainer.sizes()
        held = max(t.high_water for t in self.trainer.tiers)
        return sizes["param_bytes_per_device"] + sizes["opt_state_bytes_per_device"] + held


class PhasedEngine(_StagedEngine):
    """Weights and optimizer state in the host tier, streamed per phase."""

    name = "phased"
    trainer: PhasedTrainer

    def layer_opts(self, state: Any) -> list[Any]:
        return state.opt_layers

    def init(self, seed: int) -> Any:
        return self.trainer.init(init_params(self.trainer.model, self.trainer.stages[0], seed))

    def sizes(self) -> dict[str, int]:
        """Host-tier bytes per device of the fullest stage (the first holds the shared
        weights too)."""
        state, lay = self.trainer.abstract_state(), self.trainer.layout()
        weights, opt = [0] * len(lay.stages), [0] * len(lay.stages)
        for i, (w, o) in enumerate(zip(state.layers, state.opt_layers, strict=True)):
            weights[lay.stage_of(i).index] += bytes_per_device(w)
            opt[lay.stage_of(i).index] += bytes_per_device(o)
        weights[0] += bytes_per_device(state.shared)
        opt[0] += bytes_per_device(state.opt_shared)
        return {"param_bytes_per_device": max(weights), "opt_state_bytes_per_device": max(opt)}

    def device_bytes(self) -> int:
        """The fullest stage's device tier at its high-water: the phase's weights,
        gradients and activations in flight (`Tier`)."""
        return max(t.high_water for t in self.trainer.tiers)


def make_engine(
    model: Model,
    mesh: Mesh,
    train_cfg: TrainConfig,
    phased: PhasedConfig | None,
    rules: Rules | None,
) -> Engine:
    """The engine for these settings: phased when asked, pipelined when the mesh has
    stages or the step has microbatches, else resident."""
    if phased:
        refuse_phased(train_cfg)
        return PhasedEngine(PhasedTrainer(model, mesh, train_cfg, phased, rules))
    par = parallelism_of(mesh)
    if par.pipe > 1 or train_cfg.microbatches > 1:
        return PipelinedEngine(PipelinedTrainer(model, mesh, train_cfg, rules))
    return ResidentEngine(Trainer(model, mesh, train_cfg, rules))
