"""Phased execution: weights live in the host tier; each phase streams its shards in,
runs, and lets them go (MISSION.md, "Phased execution"; Cerebras weight streaming).

A step, for phases 0..N-1 of L/N layers each, spread over the pipeline stages in order:

    shared weights (embedding, head)   host -> device, to the first stage (and the last)
    forward  phase i = 0..N-1          weights_i host -> device (the next phase's are
                                       requested before this one runs: a real prefetch
                                       (`prefetch=False`: requested when needed),
                                       since JAX dispatch is asynchronous), all-gathered
                                       over `replica` when rts > 1, x_{i+1} = layers_i(x_i);
                                       between stages x moves point to point over `pipe`
    head                               loss and d loss / d x_N
    backward phase i = N-1..0          by the activation policy (`PhasedConfig`):
                                       recompute / offload: weights_i come in again and
                                       the phase's vjp recomputes its forward from x_i
                                       (kept on device, or brought back from the host);
                                       keep: the forward's residuals are still on device;
                                       gradients leave reduced over `replica` (scattered
                                       to the stored 1/rts shards), then device -> host
    update                             clipped by the global gradient norm; in the host
                                       tier, or on the device with weights, state and
                                       gradients streamed in and out (`optimizer_on`)

Every transfer, collective and computation goes through an `Executor`: real arrays in
real mode, shapes in abstract mode (`shardemu plan`), one code path. Each pipeline stage
has its own device tier, which refuses to exceed `device_memory`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from shardemu.accounting.ledger import Ledger
from shardemu.config import ConfigError, PhasedConfig, TrainConfig
from shardemu.models import Model
from shardemu.parallel.rules import Rules, megatron_rules, resolve_specs
from shardemu.phased.executor import Executor, one_layer
from shardemu.phased.stage import (
    AXIS_LABELS,
    Stage,
    make_specs,
    stage_meshes,
    stage_rules,
)
from shardemu.phased.tiers import CapacityError, Tier, bytes_per_device, with_memory_kind
from shardemu.training.optim import make_optimizer
from shardemu.training.resident import parallelism_of

# Counts of compiled pieces, per (model, training settings, rules), shared by every
# trainer in the process: planning compares phase counts, and tests build many trainers.
_COUNTS: dict[tuple, dict] = {}


def phase_slices(num_layers: int, phases: int, stages: int = 1) -> list[tuple[int, int]]:
    """[start, end) layers of each phase: equal phases, a whole number per stage."""
    if phases < 1 or num_layers % phases or phases % stages:
        raise ConfigError(
            f"--phases {phases} must divide the model's {num_layers} layers and be a multiple "
            f"of pipe={stages}; use one of {valid_phase_counts(num_layers, stages)}"
        )
    n = num_layers // phases
    return [(i * n, (i + 1) * n) for i in range(phases)]


def valid_phase_counts(num_layers: int, stages: int) -> list[int]:
    return [n for n in range(stages, num_layers + 1, stages) if num_layers % n == 0]


@dataclass
class PhasedState:
    """Everything a phased run keeps between steps, all in the host tier."""

    shared: Any  # embedding and head parameters (on the first stage's host memory)
    layers: list[Any]  # per phase: stacked layer parameters [L/N, ...]
    opt_shared: Any
    opt_layers: list[Any]


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
    ) -> None:
        """With `emulated_stages` = p, `mesh` (pipe=1) holds one stage's devices and the
        trainer plans p identical stages on them: abstract mode's representative slice,
        so a pipeline of thousands of devices needs only tensor * replica of them."""
        par = parallelism_of(mesh)
        if emulated_stages is not None:
            if par.pipe != 1:
                raise ConfigError("emulated_stages needs a mesh with pipe=1 (one stage's devices)")
            par = dataclasses.replace(par, pipe=emulated_stages)
        self.emulated = emulated_stages is not None
        train.check_fits(model.cfg, par)
        cfg.check_mesh(par)
        if train.microbatches > 1 or train.grad_accum > 1:
            raise ConfigError(
                "phased execution runs the whole batch through each phase, so its weights "
                "stream in once per step; --microbatches and --grad-accum must stay 1"
            )
        self.model, self.train, self.cfg, self.par = model, train, cfg, par
        self.rules = stage_rules(megatron_rules() if rules is None else rules)
        meshes = stage_meshes(mesh, cfg.rts) * (emulated_stages or 1)
        sizes = dict(meshes[0].shape)
        self.key = key = model.stack_key
        shapes, logical = model.abstract_params()
        one = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1, *s.shape[1:]), s.dtype), shapes[key])
        shared = {k: v for k, v in shapes.items() if k != key}
        shared_logical = {k: v for k, v in logical.items() if k != key}
        self.shared_shapes, self.layer_shape_one = shared, one
        specs = make_specs(
            resolve_specs(one, logical[key], self.rules, sizes),
            one,
            resolve_specs(shared, shared_logical, self.rules, sizes),
            shared,
            self.rules,
            sizes,
            cfg,
            model,
        )
        self.tx_layers = make_optimizer(train, one, logical[key], clip=False)
        self.tx_shared = make_optimizer(train, shared, shared_logical, clip=False)
        opt_shapes = (
            jax.eval_shape(self.tx_layers.init, one),
            jax.eval_shape(self.tx_shared.init, shared),
        )
        self.stages = [
            Stage(
                s, m, specs, self.rules, model, train, self.tx_layers, self.tx_shared, *opt_shapes
            )
            for s, m in enumerate(meshes)
        ]
        self.ledger = Ledger()
        # pieces' output shardings depend on rts and rts' as well as on their inputs
        self._counts = _COUNTS.setdefault((model.cfg, train, self.rules, cfg.rts, cfg.rts_opt), {})
        self.tiers = [Tier(f"device (stage {s})", cfg.device_memory) for s in range(par.pipe)]
        self.executor = self._executor(self.ledger, self.tiers, real=True)
        layers = model.cfg.num_layers
        self.slices = phase_slices(
            layers, cfg.phases or valid_phase_counts(layers, par.pipe)[-1], par.pipe
        )
        if cfg.phases is None and cfg.device_memory is not None:
            self.slices = phase_slices(layers, self._fewest_phases_that_fit(), par.pipe)

    def _executor(self, ledger: Ledger, tiers: list[Tier], real: bool) -> Executor:
        ex = Executor(ledger, tiers, AXIS_LABELS, real=real, cache=self._counts)
        return ex

    # ---- the plan ------------------------------------------------------------------------

    @property
    def layers_per_phase(self) -> int:
        lo, hi = self.slices[0]
        return hi - lo

    def stage_of(self, phase: int) -> Stage:
        return self.stages[phase * self.par.pipe // len(self.slices)]

    def _dry_run(self, slices: list[tuple[int, int]]) -> tuple[Ledger, list[Tier], list[dict]]:
        """One step in abstract mode with `slices`: what it moves, computes and holds."""
        saved = self.slices
        self.slices = slices
        try:
            ledger = Ledger()
            tiers = [Tier(t.name, None) for t in self.tiers]
            ex = self._executor(ledger, tiers, real=False)
            *_, rows = self._execute(ex, self.abstract_state(), self._abstract_batches())
            return ledger, tiers, rows
        finally:
            self.slices = saved

    def _fewest_phases_that_fit(self) -> int:
        """The largest phases whose step fits the device tier: tried in abstract mode,
        fewest phases first."""
        layers, pipe = self.model.cfg.num_layers, self.par.pipe
        counts = valid_phase_counts(layers, pipe)
        peaks = {}
        for n in counts:
            _, tiers, _ = self._dry_run(phase_slices(layers, n, pipe))
            peaks[n] = max(t.high_water for t in tiers)
            if peaks[n] <= self.cfg.device_memory:
                return n
        raise CapacityError(
            f"no phase count fits --device-memory {self.cfg.device_memory:,}: even {counts[-1]} "
            f"phases of one layer need {peaks[counts[-1]]:,} bytes per device; raise "
            f"--device-memory, add tensor sharding, use --rts, or --activations recompute"
        )

    def plan(self, phases: int | None = None, ledger: Ledger | None = None) -> dict[str, Any]:
        """The phase plan as data: per phase its stage, layers, weight bytes per device
        (stored and gathered), activation bytes kept for its backward, how often its
        weights come in and what it writes back; with the device tiers' peak and the
        per-step ledger totals, from one abstract step; of this trainer's phases, or of
        `phases` (to compare plans). Pass a `ledger` to receive that step's events."""
        slices = (
            self.slices
            if phases is None
            else phase_slices(self.model.cfg.num_layers, phases, self.par.pipe)
        )
        step_ledger, tiers, rows = self._dry_run(slices)
        if ledger is not None:
            ledger.events.extend(step_ledger.events)
        state = self.abstract_state()
        return {
            "phases": len(slices),
            "layers_per_phase": slices[0][1] - slices[0][0],
            "rts": self.cfg.rts,
            "rts_optimizer": self.cfg.rts_opt,
            "activations": self.cfg.activations,
            "optimizer_on": self.cfg.optimizer_on,
            "device_memory": self.cfg.device_memory,
            "device_high_water": max(t.high_water for t in tiers),
            "host_bytes_per_device": {
                "weights": bytes_per_device([state.shared, state.layers]),
                "optimizer_state": bytes_per_device([state.opt_shared, state.opt_layers]),
            },
            "per_phase": rows,
            "step_totals": step_ledger.step_totals(0),
        }

    # ---- state -------------------------------------------------------------------------

    def init(self, params: Any) -> PhasedState:
        """Split parameters into phases and place them, with fresh optimizer state, in
        the host tier of the stage that runs them."""
        first = self.stages[0]
        host = lambda tree, sh: jax.device_put(tree, with_memory_kind(sh, "pinned_host"))  # noqa: E731
        shared = host({k: v for k, v in params.items() if k != self.key}, first.shared_store)
        layers = [
            host(
                jax.tree.map(lambda w, a=a, b=b: w[a:b], params[self.key]),
                self.stage_of(i).layer_store,
            )
            for i, (a, b) in enumerate(self.slices)
        ]

        def opt_init(tx, sh):
            return jax.jit(tx.init, out_shardings=with_memory_kind(sh, "pinned_host"))

        return PhasedState(
            shared=shared,
            layers=layers,
            opt_shared=opt_init(self.tx_shared, first.shared_opt)(shared),
            opt_layers=[
                opt_init(self.tx_layers, self.stage_of(i).layer_opt)(w)
                for i, w in enumerate(layers)
            ],
        )

    def abstract_state(self) -> PhasedState:
        """The host-tier state as shapes and shardings: abstract mode's weights."""
        k, first = self.layers_per_phase, self.stages[0]

        def sds(shapes: Any, shardings: Any) -> Any:
            return jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                shapes,
                with_memory_kind(shardings, "pinned_host"),
            )

        layer = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((k, *s.shape[1:]), s.dtype), self.layer_shape_one
        )
        opt_layer = jax.eval_shape(self.tx_layers.init, layer)
        n = len(self.slices)
        return PhasedState(
            shared=sds(self.shared_shapes, first.shared_store),
            layers=[sds(layer, self.stage_of(i).layer_store) for i in range(n)],
            opt_shared=sds(
                jax.eval_shape(self.tx_shared.init, self.shared_shapes), first.shared_opt
            ),
            opt_layers=[sds(opt_layer, self.stage_of(i).layer_opt) for i in range(n)],
        )

    def params(self, state: PhasedState) -> dict:
        """The full parameter tree (host copies reassembled), for comparison and export;
        of a result's `grads`, the full gradient tree."""
        layers = jax.tree.map(lambda *xs: np.concatenate(xs), *jax.device_get(state.layers))
        return {**jax.device_get(state.shared), self.key: layers}

    def _batch_stages(self) -> list[Stage]:
        return [self.stages[0], self.stages[-1]] if self.par.pipe > 1 else [self.stages[0]]

    def _abstract_batches(self) -> dict[int, dict]:
        dims = (self.train.batch, self.train.seq)
        return {
            st.index: {
                k: jax.ShapeDtypeStruct(dims[: len(axes)], np.int32, sharding=st.batch[k])
                for k, axes in self.model.batch_axes.items()
            }
            for st in self._batch_stages()
        }

    # ---- one step ------------------------------------------------------------------------

    def step(self, state: PhasedState, batch: dict[str, np.ndarray]) -> PhasedResult:
        if self.emulated:
            raise ConfigError(
                "a trainer with emulated stages plans (abstract mode); it cannot train"
            )
        batches = {
            st.index: {
                k: jax.device_put(np.asarray(v, np.int32), st.batch[k]) for k, v in batch.items()
            }
            for st in self._batch_stages()
        }
        new_state, grads, loss, norm, _ = self._execute(self.executor, state, batches)
        self.executor.step += 1
        return PhasedResult(new_state, loss, norm, grads)

    def _fetch(self, ex: Executor, state: PhasedState, i: int, tag: str) -> Any:
        st = self.stage_of(i)
        return ex.to_device(
            st.index, f"w{i}", state.layers[i], st.layer_store, f"{tag}{i}", "weights"
        )

    def _gather(self, ex: Executor, st: Stage, key: str, stored: Any, part: str, phase: str):
        """All-gather stored 1/rts shards over `replica` before a phase runs; returns
        the weights to compute with and the device-tier key that now holds them."""
        if self.cfg.rts == 1:
            return stored, key
        count = (one_layer(stored),) if part == "layers" else None
        full = ex.run(
            phase, f"gather-{part}", st.fn(f"gather-{part}"), st, (stored,),
            count_args=count, repeat=self.layers_per_phase if count else 1, carries="weights",
        )  # fmt: skip
        ex.tiers[st.index].admit(f"{key}*", bytes_per_device(full), phase)
        ex.tiers[st.index].release(key)
        return full, f"{key}*"

    @staticmethod
    def _recompute_flops(ex: Executor, st: Stage, count: tuple, g_x: Any) -> float:
        """FLOPs per device of one layer's recomputation: its backward from the phase
        input minus its backward from kept residuals. (Not the forward's count: XLA
        drops the recomputed forward's last matmul, whose output the vjp never uses.)"""
        _, vjp_one = ex.shape("fwd-keep", st.fn("fwd-keep"), st, count)
        bwd = ex.count("bwd", st.fn("bwd"), st, (*count, g_x)).flops_per_device
        kept = ex.count("bwd-keep", st.fn("bwd-keep"), st, (vjp_one, g_x))
        return bwd - kept.flops_per_device

    def _execute(
        self, ex: Executor, state: PhasedState, batches: dict[int, dict]
    ) -> tuple[PhasedState, PhasedState, float, float, list[dict]]:
        cfg, n, k = self.cfg, len(self.slices), self.layers_per_phase
        first, last = self.stages[0], self.stages[-1]
        tier = lambda st: ex.tiers[st.index]  # noqa: E731
        fetches = (1 if cfg.activations == "keep" else 2) + (cfg.optimizer_on == "device")
        writes = ["gradients"] + (
            ["weights", "optimizer_state"] if cfg.optimizer_on == "device" else []
        )
        rows = [
            {"phase": i, "stage": self.stage_of(i).index, "layers": list(self.slices[i]),
             "fetches": fetches, "writes": writes}
            for i in range(n)
        ]  # fmt: skip

        shared = {}  # stage -> shared weights on its devices, and their tier key
        for st in {first.index: first, last.index: last}.values():
            stored = ex.to_device(
                st.index, f"shared@{st.index}", state.shared, st.shared_store, "shared", "weights"
            )
            shared[st.index] = self._gather(
                ex, st, f"shared@{st.index}", stored, "shared", "shared"
            )

        x, mask = ex.run("embed", "embed", first.fn("embed"), first, (shared[0][0], batches[0]))
        tier(first).admit("x0", bytes_per_device(x), "embed")
        masks = {0: mask}
        kept: dict[int, Any] = {}  # what each phase's backward needs from its forward
        ahead = 1 if cfg.prefetch else 0  # phases fetched before the one that runs
        fetched = {0: self._fetch(ex, state, 0, "fwd")}
        for i in range(n):
            st, tag = self.stage_of(i), f"fwd{i}"
            if i + ahead < n and i + ahead not in fetched:
                fetched[i + ahead] = self._fetch(ex, state, i + ahead, "fwd")
            if st.index not in masks:  # first phase of a later stage: x arrives over `pipe`
                x, masks[st.index] = ex.send(
                    self.stage_of(i - 1).index, (x, mask), (st.act, st.mask), tag, "activations"
                )
                tier(self.stage_of(i - 1)).release(f"x{i}")
                tier(st).admit(f"x{i}", bytes_per_device(x), tag)
            mask = masks[st.index]
            rows[i]["weight_bytes_per_device"] = bytes_per_device(fetched[i])
            weights, held = self._gather(ex, st, f"w{i}", fetched.pop(i), "layers", tag)
            rows[i]["gathered_bytes_per_device"] = bytes_per_device(weights)
            args, count = (weights, x, mask), (one_layer(weights), x, mask)
            if cfg.activations == "keep":
                y, vjp = ex.run(tag, "fwd-keep", st.fn("fwd-keep"), st, args, count, k)
                kept[i] = (vjp, count)
                tier(st).admit(f"res{i}", bytes_per_device(vjp), tag)
                tier(st).release(f"x{i}")
                rows[i]["activation_bytes_per_device"] = bytes_per_device(vjp)
            else:
                y = ex.run(tag, "fwd", st.fn("fwd"), st, args, count, k)
                rows[i]["activation_bytes_per_device"] = bytes_per_device(x)
                kept[i] = x
                if cfg.activations == "offload":
                    kept[i] = ex.to_host(st.index, x, st.act, tag, "activations")
                    tier(st).release(f"x{i}")
            tier(st).release(held)
            x = y
            tier(st).admit(f"x{i + 1}", bytes_per_device(x), tag)

        loss, (g_head, g_x) = ex.run(
            "head",
            "head",
            last.fn("head"),
            last,
            (shared[last.index][0], x, batches[last.index]),
        )
        tier(last).release(f"x{n}")

        grads: list[Any] = [None] * n
        squares: list[Any] = []
        restored: dict[int, Any] = {}

        def prefetch(j: int) -> None:
            if cfg.activations == "keep":
                return
            fetched[j] = self._fetch(ex, state, j, "bwd")
            if cfg.activations == "offload":
                sj = self.stage_of(j)
                restored[j] = ex.to_device(
                    sj.index, f"x{j}", kept[j], sj.act, f"bwd{j}", "activations"
                )

        prefetch(n - 1)
        requested = {n - 1}
        for i in reversed(range(n)):
            st, tag = self.stage_of(i), f"bwd{i}"
            if i - ahead >= 0 and i - ahead not in requested:
                requested.add(i - ahead)
                prefetch(i - ahead)
            if i + 1 < n and self.stage_of(i + 1) is not st:
                g_x = ex.send(self.stage_of(i + 1).index, g_x, st.act, tag, "gradients")
            mask = masks[st.index]
            if cfg.activations == "keep":
                vjp, count = kept.pop(i)
                _, vjp_one = ex.shape("fwd-keep", st.fn("fwd-keep"), st, count)
                g_w, g_x = ex.run(
                    tag, "bwd-keep", st.fn("bwd-keep"), st, (vjp, g_x), (vjp_one, g_x), k
                )
                tier(st).release(f"res{i}")
            else:
                x_i = restored.pop(i) if cfg.activations == "offload" else kept.pop(i)
                weights, held = self._gather(ex, st, f"w{i}", fetched.pop(i), "layers", tag)
                count = (one_layer(weights), x_i, mask)
                recompute = self._recompute_flops(ex, st, count, g_x)
                g_w, g_x = ex.run(
                    tag, "bwd", st.fn("bwd"), st, (weights, x_i, mask, g_x), (*count, g_x), k,
                    recompute=recompute,
                )  # fmt: skip
                tier(st).release(held)
                tier(st).release(f"x{i}")
            squares.append(ex.run(tag, "sq-norm", st.fn("sq-norm"), st, (g_w,)))
            grads[i] = ex.to_host(st.index, g_w, st.layer_store, tag, "gradients")

        g_embed = ex.run(
            "bwd-embed",
            "embed-bwd",
            first.fn("embed-bwd"),
            first,
            (shared[0][0], batches[0], g_x),
        )
        if last is not first:  # the tied embedding's second term, from the head's stage
            g_head = ex.send(last.index, g_head, first.shared_store, "bwd-shared", "gradients")
        g_shared = ex.run("bwd-embed", "add", first.fn("add"), first, (g_embed, g_head))
        squares.append(ex.run("bwd-shared", "sq-norm", first.fn("sq-norm"), first, (g_shared,)))
        shared_grads = ex.to_host(
            first.index, g_shared, first.shared_store, "bwd-shared", "gradients"
        )
        for st_index, (_, key) in shared.items():
            ex.tiers[st_index].release(key)

        norm = math.sqrt(sum(float(s) for s in squares)) if ex.real else 0.0
        layers, opt_layers = [], []
        for i in range(n):
            st = self.stage_of(i)
            w, o = self._update(
                ex, st, "layers", f"update{i}", grads[i], state.opt_layers[i], state.layers[i], norm
            )
            layers.append(w)
            opt_layers.append(o)
        shared_w, opt_shared = self._update(
            ex, first, "shared", "update-shared", shared_grads, state.opt_shared, state.shared, norm
        )
        new_state = PhasedState(shared_w, layers, opt_shared, opt_layers)
        grad_state = PhasedState(shared_grads, grads, None, [])
        return new_state, grad_state, float(loss) if ex.real else math.nan, norm, rows

    def _update(
        self, ex: Executor, st: Stage, part: str, tag: str, grads: Any, opt: Any, weights: Any,
        norm: float,
    ) -> tuple[Any, Any]:  # fmt: skip
        """The optimizer update where `optimizer_on` says; results end in the host tier."""
        store = st.layer_store if part == "layers" else st.shared_store
        opt_sh = st.layer_opt if part == "layers" else st.shared_opt
        kind = "device" if self.cfg.optimizer_on == "device" else "pinned_host"
        norm_sh = st.replicated.with_memory_kind(kind)
        norm_arg = (
            jax.device_put(np.float32(norm), norm_sh)
            if ex.real
            else jax.ShapeDtypeStruct((), np.float32, sharding=norm_sh)
        )
        fn = st.fn(f"update-{part}-{kind}")
        if kind == "pinned_host":
            return ex.run(
                tag, f"update-{part}-{kind}", fn, st, (grads, opt, weights, norm_arg),
                carries="optimizer_state", on="host",
            )  # fmt: skip
        t = ex.tiers[st.index]
        w = ex.to_device(st.index, "update:w", weights, store, tag, "weights")
        o = ex.to_device(st.index, "update:opt", opt, opt_sh, tag, "optimizer_state")
        g = ex.to_device(st.index, "update:g", grads, store, tag, "gradients")
        new_w, new_o = ex.run(
            tag,
            f"update-{part}-{kind}",
            fn,
            st,
            (g, o, w, norm_arg),
            carries="optimizer_state",
        )
        for key in ("update:w", "update:opt", "update:g"):
            t.release(key)
        return (
            ex.to_host(st.index, new_w, store, tag, "weights"),
            ex.to_host(st.index, new_o, opt_sh, tag, "optimizer_state"),
        )
