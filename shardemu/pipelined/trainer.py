"""The pipelined engine: each pipeline stage holds its layers on its own devices and
runs its schedule's program (`program.py`); GPipe, 1F1B and interleaved 1F1B are all
executed for real (Huang et al. 2019; Narayanan et al. 2021).

`PipelinedTrainer` holds what a pipelined run is made of: the stages (meshes over each
`pipe` slice's tensor x replica devices, their shardings and compiled pieces,
`stages/stage.py`), the layers of every virtual stage (`layout.py`), a device tier per
stage that counts the activations it keeps for the backward pass, and the ledger that
every piece, send and collective is recorded in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from shardemu.accounting.count import PROCESS_COUNTER, Counter, with_shardings
from shardemu.accounting.ledger import Ledger
from shardemu.accounting.sizes import bytes_per_device
from shardemu.config import PhasedConfig, TrainConfig
from shardemu.models import Model
from shardemu.numerics.precision import as_compute, compute_model
from shardemu.parallel.mesh import parallelism_of
from shardemu.parallel.rules import Rules
from shardemu.parallel.schedules import Slot, make_schedule
from shardemu.pipelined.layout import Split, pipeline_layout
from shardemu.pipelined.program import PipelinedState, StepOutput, run_step, shared_holders
from shardemu.stages.crossing import put
from shardemu.stages.executor import Executor
from shardemu.stages.specs import AXIS_LABELS, stage_meshes, staged_rules
from shardemu.stages.stage import Stage, build_stages, count_context, init_params, split_layers
from shardemu.stages.tiers import Tier


@dataclass
class PipelinedResult:
    state: PipelinedState
    loss: float
    grad_norm: float
    grads: dict | None  # the full gradient tree (when asked for)
    order: list[list[Slot]]  # per accumulation pass, the operations as executed
    peak_activations: list[float]  # per stage: most microbatches' activations held


def zero_config(stage: int, replica: int) -> PhasedConfig:
    """A pipelined run's ZeRO stage (Rajbhandari et al. 2020) as the staged pieces' rts
    settings, which are ZeRO over `replica` (`stages/stage.py`): stage 1 (P_os) stores
    the optimizer state split over the replicas (rts' = replica: each updates its share,
    then the weights are all-gathered); stage 2 (P_os+g) also reduce-scatters the
    gradients into those shares (`stages/specs.make_specs`'s `split_grads`, from
    `TrainConfig.zero`); stage 3 (P_os+g+p, FSDP) stores the weights split too (rts =
    replica: gathered inside each piece before use, the gradients reduce-scattered to
    each replica's share). Stage 0: all whole."""
    return PhasedConfig(rts=replica if stage == 3 else 1, rts_optimizer=replica if stage else 1)


class PipelinedTrainer:
    def __init__(
        self,
        model: Model,
        mesh: Mesh,
        train: TrainConfig,
        rules: Rules | None = None,
        counter: Counter | None = None,
    ) -> None:
        model = compute_model(model, train.precision)  # 16-bit weights for mixed precision
        par = parallelism_of(mesh)
        model.check_fits(train, par)
        self.layout = pipeline_layout(
            model.cfg.num_layers, par.pipe, train.virtual, Split.of(train)
        )
        self.schedule = make_schedule(
            train.schedule, par.pipe, train.microbatches, train.virtual, train.microbatch_group
        )
        self.model, self.mesh, self.train, self.par = model, mesh, train, par
        model.check_rules(rules)
        self.rules = staged_rules(rules, model, train, par)
        cfg = zero_config(train.zero, par.replica)
        self.pieces = build_stages(model, stage_meshes(mesh, cfg.rts), train, cfg, self.rules)
        self.stages: tuple[Stage, ...] = self.pieces.stages
        self.holders = shared_holders(self.layout)
        self.counter = PROCESS_COUNTER if counter is None else counter
        self._context = count_context(model, train, self.rules, cfg, par.context)
        self.ledger = Ledger()
        self.tiers = [Tier(f"device (stage {s})", None) for s in range(par.pipe)]
        self.steps_done = 0

    def stage_of(self, j: int) -> Stage:
        return self.stages[self.layout.stage_of(j)]

    # ---- state -------------------------------------------------------------------------

    def init(self, seed: int) -> PipelinedState:
        """Fresh parameters (created sharded over the first stage's tensor axis, as the
        single-device init would make them) placed on their stages."""
        return self.place(init_params(self.model, self.stages[0], seed))

    def place(self, params: dict) -> PipelinedState:
        """Split a full parameter tree into virtual stages and put each on its stage,
        with the shared weights on the first and the last stage; fresh optimizer state."""
        key, params = self.model.stack_key, as_compute(params, self.model)
        shared = {k: v for k, v in params.items() if k != key}
        chunks, opt_chunks = [], []
        parts = split_layers(params[key], self.layout.slices)
        for j, ((a, _), layers) in enumerate(zip(self.layout.slices, parts, strict=True)):
            st = self.stage_of(j)
            w = put(layers, st.layer_store)
            w, o = self.pieces.init_layers(w, a, (st.layer_store, st.layer_opt))
            chunks.append(w)
            opt_chunks.append(o)
        on = {s: put(shared, self.stages[s].shared_store) for s in self.holders}
        opt_on = {
            s: jax.jit(self.pieces.tx_shared.init, out_shardings=self.stages[s].shared_opt)(w)
            for s, w in on.items()
        }
        return PipelinedState(chunks, opt_chunks, on, opt_on)

    def params(self, state: PipelinedState) -> dict:
        """The full parameter tree (host copies reassembled)."""
        return self._tree(state.chunks, state.shared[self.holders[0]])

    def _tree(self, chunks: list[Any], shared: Any) -> dict:
        layers = jax.tree.map(lambda *xs: np.concatenate(xs), *jax.device_get(chunks))
        return {**jax.device_get(shared), self.model.stack_key: layers}

    def sizes(self) -> dict[str, int]:
        """Bytes per device of the parameters and of the optimizer state on the stage
        that holds the most (the first or last, with the shared weights)."""

        def most(trees: list[Any], shared: dict[int, Any]) -> int:
            per_stage = [0] * self.par.pipe
            for j, tree in enumerate(trees):
                per_stage[self.layout.stage_of(j)] += bytes_per_device(tree)
            for s, tree in shared.items():
                per_stage[s] += bytes_per_device(tree)
            return max(per_stage)

        state = self.abstract_state()
        return {
            "param_bytes_per_device": most(state.chunks, state.shared),
            "opt_state_bytes_per_device": most(state.opt_chunks, state.opt_shared),
        }

    def abstract_state(self) -> PipelinedState:
        """The state as shapes with their shardings: nothing allocated."""
        p = self.pieces
        chunks, opt_chunks = [], []
        for j in range(len(self.layout.slices)):
            n, st = self.layout.layers_of(j), self.stage_of(j)
            shapes = jax.tree.map(
                lambda s, n=n: jax.ShapeDtypeStruct((n, *s.shape[1:]), s.dtype), p.layer_shape_one
            )
            chunks.append(with_shardings(shapes, st.layer_store))
            opt_shapes = jax.eval_shape(p.tx_layers.init, shapes)
            opt_chunks.append(with_shardings(opt_shapes, st.layer_opt))
        opt_shared = jax.eval_shape(p.tx_shared.init, p.shared_shapes)
        return PipelinedState(
            chunks,
            opt_chunks,
            {s: with_shardings(p.shared_shapes, self.stages[s].shared_store) for s in self.holders},
            {s: with_shardings(opt_shared, self.stages[s].shared_opt) for s in self.holders},
        )

    # ---- one step ------------------------------------------------------------------------

    def _passes(self, batch: dict[str, np.ndarray]) -> list[list[dict[int, dict]]]:
        """The batch as accumulation passes of microbatches, each on the stages that
        read it. Pass a holds examples a, a + k, ...; its microbatch i every m-th of
        those (the split of `resident/microbatch.py`)."""
        k, m = self.train.grad_accum, self.train.microbatches
        readers = [self.stages[s] for s in self.holders]

        def put(part: dict[str, np.ndarray]) -> dict[int, dict]:
            return {
                st.index: {
                    name: jax.device_put(np.asarray(v, np.int32), st.batch[name])
                    for name, v in part.items()
                }
                for st in readers
            }

        return [
            [put({name: v[a::k][i::m] for name, v in batch.items()}) for i in range(m)]
            for a in range(k)
        ]

    def step(
        self, state: PipelinedState, batch: dict[str, np.ndarray], keep_grads: bool = False
    ) -> PipelinedResult:
        """One real step; its events go to `self.ledger` under the step's number."""
        self.model.check_batch(batch, self.train.batch, self.train.seq)
        counts = tuple(np.float32(c) for c in self.model.loss_counts(batch))
        on = {s: jax.device_put(counts, self.stages[s].replicated) for s in self.holders}
        ex = Executor(
            self.ledger,
            self.tiers,
            AXIS_LABELS,
            True,
            self.counter,
            self.steps_done,
            self._context,
        )
        out: StepOutput = run_step(
            ex,
            self.layout,
            self.stages,
            self.schedule,
            state,
            self._passes(batch),
            on,
            self.model.family.example_mask,
        )
        self.steps_done += 1
        grads = self._tree(out.chunk_grads, out.shared_grads) if keep_grads else None
        return PipelinedResult(
            out.state, out.loss, out.grad_norm, grads, out.order, out.peak_activations
        )
