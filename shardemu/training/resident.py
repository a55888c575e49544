"""The training engine: all parameters and optimizer state live on the devices, sharded
by the rules table; one `jax.jit` step runs forward, backward and the optax update.

With pipe > 1 (or microbatches > 1) the layers run as a GPipe pipeline over the `pipe`
axis (`parallel/pipeline.py`); with grad_accum > 1 the batch is processed in chunks whose
gradients add up to the whole batch's (`parallel/microbatch.py`). On a 1-device mesh
with neither, the step *is* plain single-device `jax.jit`: the reference every engine
must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardemu.accounting.count import with_shardings
from shardemu.config import TrainConfig
from shardemu.models import Model
from shardemu.parallel.mesh import parallelism_of
from shardemu.parallel.microbatch import accumulate
from shardemu.parallel.pipeline import executor_for, pipelined_loss_sums
from shardemu.parallel.rules import (
    Rules,
    activation_rules,
    check_divisible,
    logical_to_spec,
    megatron_rules,
    named_shardings,
    resolve_specs,
)
from shardemu.training.optim import make_optimizer


@dataclass
class ResidentOutput:
    params: Any
    opt_state: Any
    loss: jax.Array
    grad_norm: jax.Array
    grads: Any | None
    order: jax.Array  # pipeline order [grad_accum, m + p - 1, p] (microbatch ids, -1 idle)


class Trainer:
    """Shardings, optimizer and the compiled step for one (model, mesh, settings)."""

    def __init__(
        self, model: Model, mesh: Mesh, train: TrainConfig, rules: Rules | None = None
    ) -> None:
        par = parallelism_of(mesh)
        train.check_fits(model.cfg, par)
        self.model, self.mesh, self.train, self.par = model, mesh, train, par
        self.pipelined = par.pipe > 1 or train.microbatches > 1
        if self.pipelined:
            executor_for(train.schedule)  # refuse a schedule not executed, before compiling
        self.rules = megatron_rules() if rules is None else rules
        axis_sizes = dict(mesh.shape)

        self.param_shapes, self.param_logical = model.abstract_params()
        self.param_specs = resolve_specs(
            self.param_shapes, self.param_logical, self.rules, axis_sizes
        )
        self.param_shardings = named_shardings(mesh, self.param_specs)

        self.tx = make_optimizer(train, self.param_shapes, self.param_logical)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            jax.eval_shape(self.tx.init, self.param_shapes),
            self.param_shardings,
            transform_non_params=lambda _: replicated,
        )
        self.batch_shardings = {}
        for key, axes in model.batch_axes.items():
            spec = logical_to_spec(axes, self.rules, f"batch array {key!r}")
            shape = (train.batch, train.seq)[: len(axes)]
            check_divisible(f"batch array {key!r} {shape}", shape, axes, spec, axis_sizes)
            self.batch_shardings[key] = NamedSharding(mesh, spec)
        self._replicated = replicated
        self._compiled: dict[bool, jax.stages.Compiled] = {}

    def init(self, seed: int) -> tuple[Any, Any]:
        """Parameters and optimizer state, created directly in their shardings."""

        def init_fn(rng: jax.Array) -> tuple[Any, Any]:
            params = self.model.init_params(rng)
            return params, self.tx.init(params)

        fn = jax.jit(init_fn, out_shardings=(self.param_shardings, self.opt_shardings))
        return fn(jax.random.key(seed))

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Place a host batch on the mesh (int32 ids, split over `replica`)."""
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

    def _loss_sums(self, params: Any, batch: dict) -> tuple[tuple[jax.Array, ...], jax.Array]:
        if self.pipelined:
            return pipelined_loss_sums(
                self.model,
                self.param_logical,
                params,
                batch,
                self.par.pipe,
                self.train.microbatches,
                self.train.schedule,
            )
        return self.model.forward_sums(params, batch), jnp.zeros((1, 1), jnp.int32)

    def _step_fn(self, params: Any, opt_state: Any, batch: dict, keep_grads: bool):
        with activation_rules(self.mesh, self.rules):
            counts = self.model.loss_counts(batch)
            loss, grads, order = accumulate(
                self._loss_sums, counts, params, batch, self.train.grad_accum
            )
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        grad_norm = optax.tree.norm(grads)
        order = order.reshape(self.train.grad_accum, *order.shape[-2:])
        return params, opt_state, loss, grad_norm, grads if keep_grads else None, order

    def compiled(self, keep_grads: bool = False) -> jax.stages.Compiled:
        """The step, lowered and compiled ahead of time over `abstract_inputs()`; compiled
        once per flag and kept for the Trainer's life."""
        if keep_grads not in self._compiled:
            self._compiled[keep_grads] = self._compile(keep_grads)
        return self._compiled[keep_grads]

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
                r,
            ),
            donate_argnums=(0, 1),
        )
        return jitted.lower(*self.abstract_inputs()).compile()

    def step(
        self, params: Any, opt_state: Any, batch: dict[str, Any], keep_grads: bool = False
    ) -> ResidentOutput:
        """One optimizer step on a global batch. `params` and `opt_state` are donated.
        With `keep_grads`, the gradients (sharded like the parameters) come back too."""
        out = self.compiled(keep_grads)(params, opt_state, self.put_batch(batch))
        return ResidentOutput(*out)
