"""Phased execution: weights live in the host tier, each phase streams its shards in,
runs, and lets them go (MISSION.md, "Phased execution"; Cerebras weight streaming).

A step, for phases 0..N-1 of L/N layers each:

    shared (embedding + head) weights   host -> device once, kept for the step
    forward  phase i = 0..N-1           weights_i host -> device, x_{i+1} = layers_i(x_i)
                                        (boundary activations x_i are kept on device)
    head                                loss and d loss / d x_N
    backward phase i = N-1..0           weights_i host -> device again, vjp gives
                                        grads_i and d loss / d x_i; grads_i device -> host
    update                              in the host tier, where the optimizer state
                                        lives (the MemoryX arrangement), clipped by the
                                        norm of all phases' gradients

The next phase's weights are requested before the current phase runs: JAX dispatch is
asynchronous, so the transfer overlaps the computation (the prefetch the source material
hides behind compute). Every transfer is a real `device_put` between memory kinds and
is recorded in the ledger.

Only phase-boundary activations are kept, so each phase's backward recomputes its
forward (XLA's vjp of the phase): executed `flops` exceed `model_flops` by about one
forward of the layers, as with full recomputation (Narayanan et al. 2021).

Not yet here (issue #4 continues): replicated tensor sharding (rts), activation offload
and the keep-everything policy, the optimizer on device, pipe > 1, and abstract mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardemu.config import ConfigError, TrainConfig
from shardemu.engine import Trainer
from shardemu.ledger import Event, Ledger
from shardemu.models import Model, normalise
from shardemu.optim import clip_by_norm, make_optimizer
from shardemu.phased.tiers import Streamer, Tier, with_memory_kind
from shardemu.sharding import Rules, activation_rules


def phase_slices(num_layers: int, phases: int) -> list[tuple[int, int]]:
    """[start, end) layers of each phase; phases must divide the layers evenly."""
    if phases < 1 or num_layers % phases:
        raise ConfigError(
            f"--phases {phases} does not divide the model's {num_layers} layers; use a "
            f"divisor of {num_layers}"
        )
    n = num_layers // phases
    return [(i * n, (i + 1) * n) for i in range(phases)]


@dataclass
class PhasedState:
    """Everything a phased run keeps between steps, all in the host tier."""

    shared: Any  # embedding and head parameters
    layers: list[Any]  # per phase: stacked layer parameters [L/N, ...]
    opt_shared: Any
    opt_layers: list[Any]


@dataclass
class PhasedResult:
    state: PhasedState
    loss: float
    grad_norm: float


class PhasedTrainer:
    def __init__(
        self,
        model: Model,
        mesh: Mesh,
        train: TrainConfig,
        phases: int,
        device_memory: int | None = None,
        rules: Rules | None = None,
    ) -> None:
        self.base = Trainer(model, mesh, train, rules)  # shardings, batch placement
        if self.base.pipelined or train.grad_accum > 1:
            raise ConfigError(
                "phased execution does not yet combine with pipe > 1, --microbatches or "
                "--grad-accum; use pipe=1 and one microbatch"
            )
        self.model, self.mesh, self.train = model, mesh, train
        self.slices = phase_slices(model.cfg.num_layers, phases)
        key = model.stack_key
        self.key = key
        shapes, logical = self.base.param_shapes, self.base.param_logical
        self.shared_shardings = {k: v for k, v in self.base.param_shardings.items() if k != key}
        self.layer_shardings = self.base.param_shardings[key]
        lo, hi = self.slices[0]
        self.layer_shapes = layer_shapes = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((hi - lo, *s.shape[1:]), s.dtype), shapes[key]
        )
        self.shared_shapes = shared_shapes = {k: v for k, v in shapes.items() if k != key}
        self.tx_layers = make_optimizer(train, layer_shapes, logical[key], clip=False)
        self.tx_shared = make_optimizer(
            train, shared_shapes, {k: v for k, v in logical.items() if k != key}, clip=False
        )
        self._opt_layers_host = self._opt_host(self.tx_layers, layer_shapes, self.layer_shardings)
        self._opt_shared_host = self._opt_host(self.tx_shared, shared_shapes, self.shared_shardings)
        self.ledger = Ledger()
        self._flop_cache: dict[str, float] = {}
        self.device = Tier("device", device_memory)
        self.stream = Streamer(self.ledger, self.device)
        self._compile()

    # ---- state -------------------------------------------------------------------------

    def init(self, params: Any) -> PhasedState:
        """Split parameters into phases and place them, with fresh optimizer state, in
        the host tier."""
        host = lambda tree, sh: jax.device_put(tree, with_memory_kind(sh, "pinned_host"))  # noqa: E731
        shared = host({k: v for k, v in params.items() if k != self.key}, self.shared_shardings)
        layers = [
            host(jax.tree.map(lambda w, a=a, b=b: w[a:b], params[self.key]), self.layer_shardings)
            for a, b in self.slices
        ]
        init_shared = jax.jit(self.tx_shared.init, out_shardings=self._opt_shared_host)
        init_layers = jax.jit(self.tx_layers.init, out_shardings=self._opt_layers_host)
        return PhasedState(
            shared=shared,
            layers=layers,
            opt_shared=init_shared(shared),
            opt_layers=[init_layers(w) for w in layers],
        )

    def _opt_host(self, tx: optax.GradientTransformation, shapes: Any, shardings: Any) -> Any:
        """Host-tier shardings of `tx`'s state: like its parameters; scalars replicated."""
        return optax.tree_map_params(
            tx,
            lambda _, s: s,
            jax.eval_shape(tx.init, shapes),
            with_memory_kind(shardings, "pinned_host"),
            transform_non_params=lambda _: NamedSharding(
                self.mesh, PartitionSpec(), memory_kind="pinned_host"
            ),
        )

    def params(self, state: PhasedState) -> dict:
        """The full parameter tree (host copies reassembled), for comparison and export."""
        layers = jax.tree.map(lambda *xs: np.concatenate(xs), *jax.device_get(state.layers))
        return {**jax.device_get(state.shared), self.key: layers}

    # ---- compiled pieces -----------------------------------------------------------------

    def _compile(self) -> None:
        model, mesh, rules = self.model, self.mesh, self.base.rules

        def traced(fn):
            def run(*args):
                with activation_rules(mesh, rules):
                    return fn(*args)

            return jax.jit(run)

        def head_loss(shared, x, batch):
            sums = model.loss_sums(model.head(shared, x), batch)
            return normalise(sums, model.loss_counts(batch))

        self._embed = traced(model.embed)
        self._embed_bwd = traced(
            lambda shared, batch, g: jax.vjp(lambda s: model.embed(s, batch)[0], shared)[1](g)[0]
        )
        self._layers_fwd = traced(model.apply_layers)
        self._layers_bwd = traced(
            lambda w, x, mask, g: jax.vjp(lambda w_, x_: model.apply_layers(w_, x_, mask), w, x)[1](
                g
            )
        )
        self._head = traced(jax.value_and_grad(head_loss, argnums=(0, 1)))
        self._sq_norm = jax.jit(lambda g: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g)))

        def update(tx, grads, opt_state, params, norm):
            grads = clip_by_norm(grads, norm, self.train.grad_clip)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def on_host(tx, param_shardings, opt_shardings):
            """The update, with its results kept in the host tier."""
            host = with_memory_kind(param_shardings, "pinned_host")
            return jax.jit(lambda *a: update(tx, *a), out_shardings=(host, opt_shardings))

        self._update_layers = on_host(self.tx_layers, self.layer_shardings, self._opt_layers_host)
        self._update_shared = on_host(self.tx_shared, self.shared_shardings, self._opt_shared_host)

    # ---- one step ------------------------------------------------------------------------

    def _flops(self, name: str, fn: Any, *args: Any) -> float:
        """Executed FLOPs of `fn` on `args`, all devices, from XLA's cost analysis of
        the compiled function; compiled once per name and reused (identical layers)."""
        if name not in self._flop_cache:
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args
            )
            per_device = fn.lower(*abstract).compile().cost_analysis()["flops"]
            self._flop_cache[name] = per_device * self.mesh.size
        return self._flop_cache[name]

    def _compute(self, phase: str, flops: float) -> None:
        self.ledger.record(
            Event(self.stream.step, phase, "compute", "", flops=flops, devices=self.mesh.size)
        )

    def _layer_flops(self, kind: str, fn: Any, weights: Any, *rest: Any) -> float:
        """A phase's FLOPs as (its layers) x (one compiled layer): XLA's cost analysis
        counts a scan body once, so a multi-layer phase cannot be counted whole."""
        one = jax.tree.map(lambda w: w[:1], weights)
        return self._flops(kind, fn, one, *rest) * jax.tree.leaves(weights)[0].shape[0]

    def step(self, state: PhasedState, batch: dict[str, np.ndarray]) -> PhasedResult:
        stream, n = self.stream, len(self.slices)
        batch = self.base.put_batch(batch)
        shared = stream.to_device(
            "shared", state.shared, self.shared_shardings, "shared", "weights"
        )
        x, mask = self._embed(shared, batch)
        self._compute("embed", self._flops("embed", self._embed, shared, batch))
        boundary = [x]
        fetch = lambda i, tag: stream.to_device(  # noqa: E731
            f"weights[{i}]", state.layers[i], self.layer_shardings, f"{tag}{i}", "weights"
        )
        fetched = {0: fetch(0, "fwd")}
        for i in range(n):
            if i + 1 < n:
                fetched[i + 1] = fetch(i + 1, "fwd")  # prefetch: overlaps phase i's compute
            weights = fetched.pop(i)
            flops = self._layer_flops("fwd", self._layers_fwd, weights, boundary[-1], mask)
            boundary.append(self._layers_fwd(weights, boundary[-1], mask))
            self._compute(f"fwd{i}", flops)
            self.device.release(f"weights[{i}]")
        self._compute("head", self._flops("head", self._head, shared, boundary[-1], batch))
        loss, (g_shared, g_x) = self._head(shared, boundary.pop(), batch)

        host_grads: list[Any] = [None] * n
        fetched = {n - 1: fetch(n - 1, "bwd")}
        for i in reversed(range(n)):
            if i > 0:
                fetched[i - 1] = fetch(i - 1, "bwd")
            weights, x_i = fetched.pop(i), boundary.pop()
            flops = self._layer_flops("bwd", self._layers_bwd, weights, x_i, mask, g_x)
            g_w, g_x = self._layers_bwd(weights, x_i, mask, g_x)
            self._compute(f"bwd{i}", flops)
            host_grads[i] = stream.to_host(g_w, self.layer_shardings, f"bwd{i}", "gradients")
            self.device.release(f"weights[{i}]")
        self._compute("bwd-embed", self._flops("embed_bwd", self._embed_bwd, shared, batch, g_x))
        g_shared = jax.tree.map(jnp.add, g_shared, self._embed_bwd(shared, batch, g_x))
        host_g_shared = stream.to_host(g_shared, self.shared_shardings, "bwd-shared", "gradients")
        self.device.release("shared")

        # The update runs in the host tier, on host copies; clipped by the global norm.
        norm = jnp.sqrt(sum(self._sq_norm(g) for g in [host_g_shared, *host_grads]))
        layers, opt_layers = [], []
        for i in range(n):
            w, o = self._update_layers(host_grads[i], state.opt_layers[i], state.layers[i], norm)
            layers.append(w)
            opt_layers.append(o)
        shared_w, opt_shared = self._update_shared(
            host_g_shared, state.opt_shared, state.shared, norm
        )
        stream.step += 1
        new_state = PhasedState(shared_w, layers, opt_shared, opt_layers)
        return PhasedResult(new_state, float(loss), float(norm))
