"""The phased engine: weights live in the host tier; each phase streams its shards in,
runs, and lets them go (MISSION.md, "Phased execution"; Cerebras weight streaming).

`PhasedTrainer` holds what a phased run is made of: the stages (their meshes,
shardings and compiled pieces, `stage.py`), the layout of phases over the stages, the
device tiers and the ledger. The step itself is `program.py`; how many phases and the
phase plan are `planner.py`. Each pipeline stage has its own device tier, which refuses
to exceed `device_memory`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from shardemu.accounting.count import PROCESS_COUNTER, Counter, with_shardings
from shardemu.accounting.ledger import Ledger
from shardemu.accounting.sizes import bytes_per_device
from shardemu.config import ConfigError, PhasedConfig, TrainConfig
from shardemu.models import Model
from shardemu.numerics.precision import as_compute, compute_model
from shardemu.parallel.mesh import parallelism_of
from shardemu.parallel.rules import Rules
from shardemu.phased import planner
from shardemu.phased.program import run_step
from shardemu.phased.state import Layout, PhasedState
from shardemu.stages.crossing import put
from shardemu.stages.executor import Executor
from shardemu.stages.specs import AXIS_LABELS, stage_meshes, staged_rules
from shardemu.stages.stage import Stage, build_stages, count_context, split_layers
from shardemu.stages.tiers import Tier, with_memory_kind


@dataclass
class PhasedResult:
    state: PhasedState
    loss: float
    grad_norm: float
    grads: PhasedState  # this step's gradients as they reached the host tier (no opt state)


class PhasedTrainer:
    def __init__(
        self,
        model: Model,
        mesh: Mesh,
        train: TrainConfig,
        cfg: PhasedConfig,
        rules: Rules | None = None,
        emulated_stages: int | None = None,
        counter: Counter | None = None,
    ) -> None:
        """With `emulated_stages` = p, `mesh` (pipe=1) holds one stage's devices and the
        trainer plans p identical stages on them: abstract mode's representative slice,
        so a pipeline of thousands of devices needs only tensor * replica of them.
        `counter` keeps compiled pieces' counts; pass one to share them between
        trainers."""
        model = compute_model(model, train.precision)  # 16-bit weights for mixed precision
        par = parallelism_of(mesh)
        if emulated_stages is not None:
            if par.pipe != 1:
                raise ConfigError("emulated_stages needs a mesh with pipe=1 (one stage's devices)")
            par = dataclasses.replace(par, pipe=emulated_stages)
        self.emulated = emulated_stages is not None
        model.check_fits(train, par)
        cfg.check_mesh(par)
        if model.cfg.num_layers % par.pipe:
            raise ConfigError(
                f"{model.cfg.num_layers} layers do not split evenly over pipe={par.pipe}; "
                f"phased stages run the same phases each, so use a pipe size that divides "
                f"{model.cfg.num_layers}"
            )
        if train.schedule != "1f1b":
            raise ConfigError(
                f"TrainConfig.schedule {train.schedule} orders a pipeline's microbatches; "
                f"phased execution runs the whole batch through each phase, one pass a step: "
                f"leave TrainConfig.schedule out (1f1b)"
            )
        if train.microbatches > 1 or train.grad_accum > 1:
            raise ConfigError(
                "phased execution runs the whole batch through each phase, so its weights "
                "stream in once per step; TrainConfig.microbatches and TrainConfig.grad_accum must "
                "stay 1"
            )
        self.model, self.train, self.cfg, self.par = model, train, cfg, par
        model.check_rules(rules)
        if train.zero:
            raise ConfigError(
                f"TrainConfig.zero={train.zero}: ZeRO runs on the resident engine, not the "
                "phased one; its PhasedConfig.rts_opt shards the optimizer state over "
                "replicas instead"
            )
        self.rules = staged_rules(rules, model, train, par)
        meshes = stage_meshes(mesh, cfg.rts) * (emulated_stages or 1)
        self.pieces = build_stages(model, meshes, train, cfg, self.rules)
        self.stages: tuple[Stage, ...] = self.pieces.stages
        self.counter = PROCESS_COUNTER if counter is None else counter
        self._context = count_context(model, train, self.rules, cfg, par.context)
        self.dry_runs: dict[tuple, planner.DryRun] = {}  # by (layout slices, counting)
        self._abstract_states: dict[tuple, PhasedState] = {}  # by layout slices
        # one layer's weights as a phase computes with them (gathered, tensor-sharded)
        layer = with_shardings(self.pieces.layer_shape_one, self.stages[0].layer_compute)
        self.layer_bytes_per_device = bytes_per_device(layer)
        # what a phase's backward holds per layer at least: those weights, and beside
        # them the gradients it writes (in the stored layout) until they leave
        grads = with_shardings(self.pieces.layer_shape_one, self.stages[0].layer_store)
        self.backward_bytes_per_layer = self.layer_bytes_per_device + bytes_per_device(grads)
        self.ledger = Ledger()
        self.tiers = [Tier(f"device (stage {s})", cfg.device_memory) for s in range(par.pipe)]
        layers = model.cfg.num_layers
        phases = cfg.phases or planner.valid_phase_counts(layers, par.pipe)[-1]
        if cfg.phases is None and cfg.device_memory is not None and not cfg.weight_streaming:
            phases = planner.fewest_phases_that_fit(self, cfg.device_memory)
        self.slices = planner.phase_slices(layers, phases, par.pipe)
        self.steps_done = 0

    def layout(self, phases: int | None = None) -> Layout:
        """This trainer's phases over its stages, or `phases` equal phases."""
        slices = (
            self.slices
            if phases is None
            else planner.phase_slices(self.model.cfg.num_layers, phases, self.par.pipe)
        )
        return Layout(slices, self.stages)

    def executor(
        self, ledger: Ledger, tiers: list[Tier], real: bool, step: int = 0, counting: bool = True
    ) -> Executor:
        return Executor(
            ledger,
            tiers,
            AXIS_LABELS,
            real,
            self.counter,
            step,
            self._context,
            counting=counting,
            # a trainer built to run (not a planner's emulated stages): its dry runs
            # compile what its steps will run
            compiles_to_run=not self.emulated,
        )

    def plan(
        self, phases: int | None = None, ledger: Ledger | None = None, counting: bool = True
    ) -> planner.PhasePlan:
        """The phase plan (`planner.plan`) of this trainer's phases, or of `phases` (to
        compare plans). Pass a `ledger` to receive that step's events. Not `counting`,
        the plan's memory alone, nothing compiled that need not be (`planner.dry_run`)."""
        report, step = planner.plan(self, self.layout(phases), counting)
        if ledger is not None:
            ledger.events.extend(step.events)
        return report

    # ---- state -------------------------------------------------------------------------

    def init(self, params: Any) -> PhasedState:
        """Split parameters into phases and place them, with fresh optimizer state, in
        the host tier of the stage that runs them."""
        lay, first, key = self.layout(), self.stages[0], self.model.stack_key
        params = as_compute(params, self.model)
        host = lambda tree, sh: jax.device_put(tree, with_memory_kind(sh, "pinned_host"))  # noqa: E731
        shared = host({k: v for k, v in params.items() if k != key}, first.shared_store)
        layers, opt_layers = [], []
        parts = split_layers(params[key], self.slices)
        for i, ((a, _), part) in enumerate(zip(self.slices, parts, strict=True)):
            st = lay.stage_of(i)
            on_host = with_memory_kind((st.layer_store, st.layer_opt), "pinned_host")
            w = put(part, st.layer_store)
            w, o = self.pieces.init_layers(w, a, on_host)
            layers.append(w)
            opt_layers.append(o)
        opt_shared = jax.jit(
            self.pieces.tx_shared.init,
            out_shardings=with_memory_kind(first.shared_opt, "pinned_host"),
        )(shared)
        return PhasedState(shared, layers, opt_shared, opt_layers)

    def abstract_state(self, layout: Layout | None = None) -> PhasedState:
        """The host-tier state as shapes and shardings: abstract mode's weights. Built
        once per layout (a plan's dry runs and rows read it; GPT-3's 96 phases take a
        quarter of a second); the steps that read it do not change it."""
        lay = layout or self.layout()
        if lay.slices not in self._abstract_states:
            self._abstract_states[lay.slices] = self._abstract_state(lay)
        return self._abstract_states[lay.slices]

    def _abstract_state(self, lay: Layout) -> PhasedState:
        first, tx_layers, tx_shared = self.stages[0], self.pieces.tx_layers, self.pieces.tx_shared

        def sds(shapes: Any, shardings: Any) -> Any:
            return with_shardings(shapes, with_memory_kind(shardings, "pinned_host"))

        k = lay.layers_per_phase
        layer = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((k, *s.shape[1:]), s.dtype), self.pieces.layer_shape_one
        )
        opt_layer = jax.eval_shape(tx_layers.init, layer)
        shared = self.pieces.shared_shapes
        n = len(lay.slices)
        return PhasedState(
            shared=sds(shared, first.shared_store),
            layers=[sds(layer, lay.stage_of(i).layer_store) for i in range(n)],
            opt_shared=sds(jax.eval_shape(tx_shared.init, shared), first.shared_opt),
            opt_layers=[sds(opt_layer, lay.stage_of(i).layer_opt) for i in range(n)],
        )

    def params(self, state: PhasedState) -> dict:
        """The full parameter tree (host copies reassembled), for comparison and export;
        of a result's `grads`, the full gradient tree."""
        layers = jax.tree.map(lambda *xs: np.concatenate(xs), *jax.device_get(state.layers))
        return {**jax.device_get(state.shared), self.model.stack_key: layers}

    def _batch_stages(self) -> list[Stage]:
        return [self.stages[0], self.stages[-1]] if self.par.pipe > 1 else [self.stages[0]]

    def abstract_batches(self) -> dict[int, dict]:
        """The batch as shapes on the stages that read it (the first, and the last)."""
        size, seq = self.train.batch, self.train.seq
        return {
            st.index: self.model.abstract_batch(size, seq, st.batch) for st in self._batch_stages()
        }

    # ---- one step ------------------------------------------------------------------------

    def step(self, state: PhasedState, batch: dict[str, np.ndarray]) -> PhasedResult:
        """One real step; its events go to `self.ledger` under the step's number."""
        if self.emulated:
            raise ConfigError(
                "a trainer with emulated stages plans (abstract mode); it cannot train"
            )
        self.model.check_batch(batch, self.train.batch, self.train.seq)
        batches = {
            st.index: {
                k: jax.device_put(np.asarray(v, np.int32), st.batch[k]) for k, v in batch.items()
            }
            for st in self._batch_stages()
        }
        ex = self.executor(self.ledger, self.tiers, real=True, step=self.steps_done)
        out = run_step(ex, self.layout(), self.cfg, state, batches)
        self.steps_done += 1
        return PhasedResult(out.state, out.loss, out.grad_norm, out.grads)
