"""The resident engine: all parameters and optimizer state live on the devices, sharded
by the rules table; one `jax.jit` step runs forward, backward and the optax update.

This is the reference every later engine (pipelined, phased, streaming) must agree with:
on a 1-device mesh it *is* plain single-device `jax.jit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.models import Model
from shardemu.optim import make_optimizer
from shardemu.sharding import (
    Rules,
    activation_rules,
    check_divisible,
    logical_to_spec,
    megatron_rules,
    named_shardings,
    resolve_specs,
)


def parallelism_of(mesh: Mesh) -> Parallelism:
    return Parallelism(**{name: int(size) for name, size in mesh.shape.items()})


def require_no_pipeline(par: Parallelism) -> None:
    """Pipeline stages are not built yet; say so instead of silently replicating."""
    if par.pipe > 1:
        raise ConfigError(
            f"pipe={par.pipe}: pipeline stages over the `pipe` axis are not yet supported "
            f"(they come with the pipeline issue); use pipe=1 and spread the devices over "
            f"tensor and replica"
        )


@dataclass
class StepResult:
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
        require_no_pipeline(par)
        train.check_fits(model.cfg, par)
        self.model, self.mesh, self.train = model, mesh, train
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

        def sds(shape_leaf: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape_leaf.shape, shape_leaf.dtype, sharding=sharding)

        params = jax.tree.map(sds, self.param_shapes, self.param_shardings)
        opt_state = jax.tree.map(
            sds, jax.eval_shape(self.tx.init, self.param_shapes), self.opt_shardings
        )
        dims = (self.train.batch, self.train.seq)
        batch = {
            k: jax.ShapeDtypeStruct(dims[: len(axes)], np.int32, sharding=self.batch_shardings[k])
            for k, axes in self.model.batch_axes.items()
        }
        return params, opt_state, batch

    def _step_fn(self, params: Any, opt_state: Any, batch: dict, keep_grads: bool):
        with activation_rules(self.mesh, self.rules):
            loss, grads = jax.value_and_grad(self.model.loss)(params, batch)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, optax.tree.norm(grads), grads if keep_grads else None

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
            ),
            donate_argnums=(0, 1),
        )
        return jitted.lower(*self.abstract_inputs()).compile()

    def step(
        self, params: Any, opt_state: Any, batch: dict[str, Any], keep_grads: bool = False
    ) -> StepResult:
        """One optimizer step on a global batch. `params` and `opt_state` are donated.
        With `keep_grads`, the gradients (sharded like the parameters) come back too."""
        out = self.compiled(keep_grads)(params, opt_state, self.put_batch(batch))
        return StepResult(*out)
