"""The resident engine: all parameters and optimizer state live on the devices, sharded
over `tensor` and `replica` by the rules table; one `jax.jit` step runs forward,
backward and the optax update.

With grad_accum > 1 the batch is processed in chunks whose gradients add up to the
whole batch's (`resident/microbatch.py`). On a 1-device mesh the step *is* plain
single-device `jax.jit`: the reference every engine must agree with. Meshes with
pipeline stages, and microbatched steps, run on the pipelined engine
(`pipelined/trainer.py`).

The step's ledger events are counted from the same step compiled with its layers
unrolled (XLA's cost analysis counts a loop body once) and split in two pieces, the
gradients and the update, so that the optimizer's FLOPs are not model FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardemu.accounting.attention_core import AttentionShape
from shardemu.accounting.count import Counted, Counter, piece_events, with_shardings
from shardemu.accounting.ledger import Event, Phase
from shardemu.config import ConfigError, TrainConfig
from shardemu.models import Model
from shardemu.models.layers import unrolled_layers
from shardemu.numerics.optim import make_optimizer
from shardemu.numerics.precision import (
    apply_update,
    compute_model,
    loss_scale,
    unscale,
    with_master_weights,
)
from shardemu.parallel.mesh import parallelism_of
from shardemu.parallel.rules import (
    Rules,
    activation_rules,
    check_divisible,
    logical_to_spec,
    named_shardings,
    resolve_specs,
    rules_or_default,
)
from shardemu.resident.microbatch import accumulate
from shardemu.sparsity import (
    SparseState,
    apply_masks,
    opt_state_shardings,
    sparse_optimizer,
)
from shardemu.stages.specs import tree_store_specs

_COMPILED: dict[tuple, jax.stages.Compiled] = {}  # Trainer.compiled's, process-wide


def loss_terms(model: Model, params: Any, batch: dict) -> tuple[jax.Array, ...]:
    """Each term of the model's loss on `batch` (BERT: MLM, NSP), normalised."""
    sums, counts = model.forward_sums(params, batch), model.loss_counts(batch)
    return tuple(s / c for s, c in zip(sums, counts, strict=True))


def held_out(per_batch: list[tuple[jax.Array, ...]]) -> dict[str, float]:
    """`val_loss` (the terms' sum) and, for a loss of two terms (BERT), the first as
    `val_mlm_loss`; each the mean over the batches."""
    means = np.mean([[float(t) for t in terms] for terms in per_batch], axis=0)
    out = {"val_loss": float(means.sum())}
    if len(means) == 2:
        out["val_mlm_loss"] = float(means[0])
    return out


@dataclass
class ResidentOutput:
    params: Any
    opt_state: Any
    loss: jax.Array
    grad_norm: jax.Array
    grads: Any | None


class Trainer:
    """Shardings, optimizer and the compiled step for one (model, mesh, settings)."""

    def __init__(
        self, model: Model, mesh: Mesh, train: TrainConfig, rules: Rules | None = None
    ) -> None:
        par = parallelism_of(mesh)
        model.check_fits(train, par)
        if par.pipe > 1 or train.microbatches > 1:
            raise ConfigError(
                f"the resident Trainer runs whole-batch steps without pipeline stages (got "
                f"pipe={par.pipe}, microbatches={train.microbatches}); pipelined steps run on "
                f"shardemu.PipelinedTrainer"
            )
        model = compute_model(model, train.precision)  # 16-bit weights for mixed precision
        self.model, self.mesh, self.train, self.par = model, mesh, train, par
        model.check_rules(rules)
        self.rules = rules_or_default(
            rules, train.sequence_parallel, par.expert, par.context,
            tensor=par.tensor, kv_heads=model.cfg.kv_heads,
        )  # fmt: skip
        axis_sizes = dict(mesh.shape)

        self.param_shapes, self.param_logical = model.abstract_params()
        self.param_specs = resolve_specs(
            self.param_shapes, self.param_logical, self.rules, axis_sizes
        )
        self.param_shardings = named_shardings(mesh, self.param_specs)
        self._zero_shardings = self._optimizer_param_shardings(axis_sizes)
        # ZeRO-2 and 3: each replica's share of the gradients (None: as the parameters)
        self._grad_zero = self._zero_shardings if train.zero >= 2 else None
        if train.zero == 3 and self._zero_shardings is not None:  # FSDP: weights stored split
            self.param_shardings = self._zero_shardings

        tx = make_optimizer(train, self.param_shapes, self.param_logical)
        self.tx = sparse_optimizer(
            with_master_weights(tx, train),
            train,
            self.param_shapes,
            self.param_logical,
            self.param_specs,
            axis_sizes,
        )
        replicated = NamedSharding(mesh, PartitionSpec())
        self.opt_shardings = opt_state_shardings(
            self.tx,
            jax.eval_shape(self.tx.init, self.param_shapes),
            self._zero_shardings or self.param_shardings,
            replicated,
        )
        self.batch_shardings = {}
        shapes = model.batch_shapes(train.batch, train.seq)
        for key, axes in model.batch_axes.items():
            spec = logical_to_spec(axes, self.rules, f"batch array {key!r}")
            shape = shapes[key]
            check_divisible(f"batch array {key!r} {shape}", shape, axes, spec, axis_sizes)
            self.batch_shardings[key] = NamedSharding(mesh, spec)
        self._replicated = replicated
        self._eval: Any = None  # the jitted held-out loss, made on first use

    def _optimizer_param_shardings(self, axis_sizes: dict[str, int]) -> Any:
        """With ZeRO, how the optimizer's copies of the parameters (Adam's moments, the
        FP32 master weights) are sharded: as the parameters and also over `replica`, on
        each one's largest dimension that the axis divides (Rajbhandari et al. 2020,
        P_os: each replica updates its share, then the parameters are all-gathered, in
        their own dtype: `_update`); a tensor no dimension of which it divides stays
        whole. Stage 2 reduce-scatters the gradients into the same shares (P_os+g:
        `_step_fn`), stage 3 also stores the weights so (P_os+g+p, FSDP: XLA all-gathers
        each where a layer uses it). None without ZeRO: as the parameters."""
        # with context parallelism over replica x context, whose devices hold the same
        # weights (Megatron-Core's distributed optimizer shards over that group)
        axes = ("replica", "context") if axis_sizes.get("context", 1) > 1 else ("replica",)
        if not self.train.zero or math.prod(axis_sizes[a] for a in axes) == 1:
            return None
        specs = tree_store_specs(self.param_specs, self.param_shapes, axes, axis_sizes, skip=0)
        return named_shardings(self.mesh, specs)

    def init(self, seed: int) -> tuple[Any, Any]:
        """Parameters and optimizer state, created directly in their shardings."""

        def init_fn(rng: jax.Array) -> tuple[Any, Any]:
            params = self.model.init_params(rng)
            opt_state = self.tx.init(params)
            if isinstance(opt_state, SparseState):  # the pattern's zeros start at zero
                params = apply_masks(params, opt_state.masks)
            return params, opt_state

        fn = jax.jit(init_fn, out_shardings=(self.param_shardings, self.opt_shardings))
        return fn(jax.random.key(seed))

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Place a host batch on the mesh (int32 ids, split over `replica`), checked."""
        self.model.check_batch(batch, self.train.batch, self.train.seq)
        return {
            k: jax.device_put(np.asarray(v, np.int32), self.batch_shardings[k])
            for k, v in batch.items()
        }

    def abstract_inputs(self) -> tuple[Any, Any, dict[str, jax.ShapeDtypeStruct]]:
        """Shapes and shardings of (params, opt_state, batch): enough to compile a step
        without allocating anything."""

        params = with_shardings(self.param_shapes, self.param_shardings)
        opt_state = with_shardings(
            jax.eval_shape(self.tx.init, self.param_shapes), self.opt_shardings
        )
        batch = self.model.abstract_batch(self.train.batch, self.train.seq, self.batch_shardings)
        return params, opt_state, batch

    def _grads(
        self, params: Any, batch: dict, scale: jax.Array | float = 1.0
    ) -> tuple[jax.Array, Any]:
        """The loss and gradients of the global batch (over its accumulation chunks),
        both multiplied by the loss scale `scale`."""
        with activation_rules(self.mesh, self.rules):
            counts = self.model.loss_counts(batch)
            loss, grads, _ = accumulate(
                lambda p, b: (self.model.forward_sums(p, b), None),
                counts,
                params,
                batch,
                self.train.grad_accum,
                scale,
            )
        return loss, grads

    def _update(self, grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
        params, opt_state = apply_update(self.tx, grads, opt_state, params)
        if self._zero_shardings is not None:  # each replica's share, rounded, then gathered
            params = jax.lax.with_sharding_constraint(params, self._zero_shardings)
        return params, opt_state

    def _step_fn(self, params: Any, opt_state: Any, batch: dict, keep_grads: bool):
        scale = loss_scale(opt_state)
        loss, grads = self._grads(params, batch, scale)
        loss, grads = loss / scale, unscale(grads, opt_state)
        if self._grad_zero is not None:  # each replica's share
            grads = jax.lax.with_sharding_constraint(grads, self._grad_zero)
        if isinstance(opt_state, SparseState):  # a sparse model's gradient: clipped, reported
            grads = apply_masks(grads, opt_state.masks)
        params, opt_state = self._update(grads, opt_state, params)
        grad_norm = optax.tree.norm(grads)
        return params, opt_state, loss, grad_norm, grads if keep_grads else None

    def compiled(self, keep_grads: bool = False) -> jax.stages.Compiled:
        """The step, lowered and compiled ahead of time over `abstract_inputs()`; compiled
        once per process for each (model, settings, rules, mesh, flag), so a second
        Trainer of the same settings (a resumed run, a sweep) reuses it."""
        key = (self.model, self._program_settings, self.rules, self.mesh, keep_grads)
        if key not in _COMPILED:
            if len(_COMPILED) >= 32:
                _COMPILED.pop(next(iter(_COMPILED)))  # the oldest
            _COMPILED[key] = self._compile(keep_grads)
        return _COMPILED[key]

    def _compile(self, keep_grads: bool) -> jax.stages.Compiled:
        r = self._replicated
        jitted = jax.jit(
            lambda p, o, b: self._step_fn(p, o, b, keep_grads),
            in_shardings=(self.param_shardings, self.opt_shardings, self.batch_shardings),
            out_shardings=(
                self.param_shardings,
                self.opt_shardings,
                r,
                r,
                self.param_shardings if keep_grads else None,
            ),
            donate_argnums=(0, 1),
        )
        return jitted.lower(*self.abstract_inputs()).compile()

    def step(
        self, params: Any, opt_state: Any, batch: dict[str, Any], keep_grads: bool = False
    ) -> ResidentOutput:
        """One optimizer step on a global batch. `params` and `opt_state` are donated.
        With `keep_grads`, the gradients (sharded like the parameters) come back too."""
        placed = self.put_batch(batch)  # checked before anything compiles
        return ResidentOutput(*self.compiled(keep_grads)(params, opt_state, placed))

    @property
    def _program_settings(self) -> TrainConfig:
        """The settings the step's program depends on: not the step count or the seed,
        so runs that differ only in those (a sweep over seeds, a resumed run) share one
        compilation and one count; nor the corpus its batches come from. (A sparse
        step's pattern updates depend on the step count and the seed.)"""
        program = dataclasses.replace(self.train, data="synthetic")  # batches are inputs
        if self.train.sparsity is not None:
            return program
        return dataclasses.replace(program, steps=1, seed=0)

    def evaluate(self, params: Any, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
        """The loss of held-out `batches` (no update): `val_loss`, and for a loss of two
        terms (BERT) the first, `val_mlm_loss`; each the mean over the batches."""
        if self._eval is None:

            def terms(p: Any, batch: dict) -> tuple[jax.Array, ...]:
                with activation_rules(self.mesh, self.rules):
                    return loss_terms(self.model, p, batch)

            self._eval = jax.jit(terms)
        return held_out([self._eval(params, self.put_batch(b)) for b in batches])

    def step_events(self, counter: Counter, step: int) -> list[Event]:
        """The ledger events of one step: the gradients (forward and backward, with
        their collectives by mesh axis) and the update, each compiled with the layers
        unrolled and counted once per signature by `counter`."""
        params, opt_state, batch = self.abstract_inputs()
        r = self._replicated
        attention = AttentionShape.of(self.model.cfg, self.train.seq, self.par.context)
        context = (self.model.cfg, self._program_settings, self.rules, attention)
        grad_shardings = self._grad_zero or self.param_shardings
        with unrolled_layers():
            grads = self._count(
                counter,
                "step-grads",
                self._grads,
                (params, batch),
                (r, grad_shardings),
                context,
            )
            update = self._count(
                counter,
                "step-update",
                self._update,
                (with_shardings(self.param_shapes, grad_shardings), opt_state, params),
                (self.param_shardings, self.opt_shardings),
                context,
            )
        return [
            *piece_events(grads, step, Phase("step"), 0),
            *piece_events(update, step, Phase("update"), 0, carries="optimizer_state"),
        ]

    def _count(
        self, counter: Counter, name: str, fn: Any, args: tuple, out: Any, context: tuple
    ) -> Counted:
        jitted = jax.jit(fn, out_shardings=out)
        return counter.count(name, jitted, self.mesh, args, context)
