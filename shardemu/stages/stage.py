"""A pipeline stage of a phased run: its devices, its shardings and its compiled pieces.

Each stage's devices form a mesh whose `replica` axis is split in two, (replica, rts):
the `rts` sub-axis is what replicated tensor sharding spreads a weight over (MISSION.md:
"each device stores 1/(t*p*rts)"), while the batch is split over both. A weight has two
shardings: *stored* (host tier, and as it arrives on the device: its tensor-parallel
shard split again over `rts`) and *computed* (its tensor-parallel shard whole, gathered
over `rts` just before the phase runs). Gradients leave the backward pass already
reduced and scattered to the stored sharding. Optimizer state is stored over rts'
(`rts_optimizer`: 1, rts, or all of `replica`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardemu.accounting.attention_core import AttentionShape
from shardemu.accounting.count import signature
from shardemu.accounting.ledger import Phase
from shardemu.config import PhasedConfig, TrainConfig
from shardemu.models import Model, normalise
from shardemu.numerics.optim import clip_by_norm, make_optimizer, squared_norm
from shardemu.numerics.precision import (
    apply_update,
    is_mixed,
    to_fp32,
    unscale,
    with_master_weights,
)
from shardemu.parallel.rules import Rules, activation_rules, resolve_specs
from shardemu.sparsity import apply_masks, init_state, opt_state_shardings, sparse_optimizer
from shardemu.sparsity.storage import compressed_bytes
from shardemu.stages.executor import Executor
from shardemu.stages.pieces import Piece
from shardemu.stages.specs import Specs, make_specs
from shardemu.stages.systems import per_system_builders
from shardemu.stages.tiers import with_memory_kind


class Stage:
    """One stage's mesh, shardings and jitted pieces (built on first use)."""

    def __init__(
        self,
        index: int,
        mesh: Mesh,
        specs: Specs,
        rules: Rules,
        model: Model,
        train: TrainConfig,
        tx_layers: optax.GradientTransformation,
        tx_shared: optax.GradientTransformation,
        opt_layer_shapes: Any,
        opt_shared_shapes: Any,
        layer_logical: Any,
        per_system: bool = False,
    ) -> None:
        self.index, self.mesh, self.rules, self.model, self.train = index, mesh, rules, model, train
        self.layer_logical = layer_logical
        named = lambda tree: jax.tree.map(  # noqa: E731
            lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        self.layer_compute = named(specs.layer_compute)
        self.layer_store = named(specs.layer_store)
        self.shared_compute = named(specs.shared_compute)
        self.shared_store = named(specs.shared_store)
        self.layer_grads, self.shared_grads = named(specs.layer_grads), named(specs.shared_grads)
        self.act = NamedSharding(mesh, specs.act)
        # attention masks: [b, 1, s] padding masks split like the batch (BERT), or one
        # [1, s, s] causal mask (GPT)
        self.mask = NamedSharding(
            mesh, PartitionSpec(specs.act[0]) if model.family.example_mask else PartitionSpec()
        )
        self.batch = {k: NamedSharding(mesh, s) for k, s in specs.batch.items()}
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # weight streaming's per-system stacks: one row per system (the batch's axes)
        self.stacked = NamedSharding(mesh, PartitionSpec(specs.act[0]))
        self.tx_layers, self.tx_shared = tx_layers, tx_shared
        self.layer_opt = self._opt(tx_layers, opt_layer_shapes, named(specs.layer_opt))
        self.shared_opt = self._opt(tx_shared, opt_shared_shapes, named(specs.shared_opt))
        self._fns: dict[str, Any] = {}
        self._executables: dict[tuple, Any] = {}
        # weight streaming: the gradient pieces run per system (`systems.py`)
        self._per_system = per_system_builders(self) if per_system else {}

    def _opt(self, tx: optax.GradientTransformation, state_shapes: Any, shardings: Any) -> Any:
        """Shardings of `tx`'s state: like its parameters; scalars replicated."""
        return opt_state_shardings(tx, state_shapes, shardings, self.replicated)

    def layer_bytes(self, weights: Any, opt_state: Any) -> int | None:
        """Bytes over all devices that streaming `weights` (a stack of layers, placed)
        moves: a sparse run's compressed layout (`sparsity/storage.py`), read from the
        masks in `opt_state`; None for a dense run (the arrays' own bytes)."""
        sparse = self.train.sparsity
        if sparse is None:
            return None
        return compressed_bytes(weights, opt_state.masks, self.layer_logical, sparse)

    def on_device(self, masks: Any) -> Any:
        """Where a stack of layers' masks sit on the devices: like the stored weights
        (a dense leaf's scalar mask replicated), to drop its zero weights' gradients."""
        return jax.tree.map(
            lambda m, sh: self.replicated if m.ndim == 0 else sh, masks, self.layer_store
        )

    def fn(self, name: Piece) -> Any:
        """The jitted piece `name` (see `_build`), built once per stage."""
        if name not in self._fns:
            self._fns[name] = self._build(name)
        return self._fns[name]

    def executable(self, name: Piece, args: tuple) -> Any | None:
        """The piece `name` compiled for this stage's devices over the signature of
        `args` (arrays, or their shapes in a dry run before real steps), once: the
        executor runs it and counts it from this one compile (jit's own call would
        compile it a second time). None where `args` holds something else (a Python
        number is traced by value)."""
        leaves = jax.tree.leaves(args)
        if not all(isinstance(x, jax.Array | jax.ShapeDtypeStruct) for x in leaves):
            return None
        key = (name, signature(args), tuple(x.weak_type for x in leaves))
        if key not in self._executables:
            self._executables[key] = self.fn(name).lower(*args).compile()
        return self._executables[key]

    def _build(self, name: Piece) -> Any:
        model, mesh, rules = self.model, self.mesh, self.rules

        def traced(fn: Any, **out: Any) -> Any:
            def run(*args: Any) -> Any:
                with activation_rules(mesh, rules):
                    return fn(*args)

            return jax.jit(run, **out)

        layer_vjp, head_loss = self.layer_vjp, self.head_loss
        grads_out = {"out_shardings": (self.layer_grads, self.act)}
        builders = {
            Piece.GATHER_LAYERS: lambda: jax.jit(lambda w: w, out_shardings=self.layer_compute),
            Piece.GATHER_SHARED: lambda: jax.jit(lambda w: w, out_shardings=self.shared_compute),
            Piece.EMBED: lambda: traced(model.embed, out_shardings=(self.act, self.mask)),
            Piece.EMBED_BWD: lambda: traced(
                lambda s, b, g: jax.vjp(lambda s_: model.embed(s_, b)[0], s)[1](g)[0],
                out_shardings=self.shared_grads,
            ),
            Piece.FWD: lambda: traced(model.apply_layers, out_shardings=self.act),
            # its output laid out as `fwd`'s (the residuals as XLA lays them out), so that the
            # pieces that take it compile once for both
            Piece.FWD_KEEP: lambda: traced(layer_vjp, out_shardings=(self.act, None)),
            Piece.BWD: lambda: traced(lambda w, x, m, g: layer_vjp(w, x, m)[1](g), **grads_out),
            Piece.BWD_KEEP: lambda: traced(lambda vjp, g: vjp(g), **grads_out),
            Piece.HEAD: lambda: traced(
                jax.value_and_grad(head_loss, argnums=(0, 1)),
                out_shardings=(self.replicated, (self.shared_grads, self.act)),
            ),
            # the shared weights' gradient: its embedding and head halves summed (with
            # weight streaming, each system's: a row per system, `systems.py`)
            Piece.ADD_SHARED: lambda: jax.jit(
                lambda a, b: jax.tree.map(jnp.add, a, b),
                out_shardings=jax.tree.map(lambda _: self.stacked, self.shared_grads)
                if self._per_system
                else self.shared_grads,
            ),
            Piece.ACCUMULATE: lambda: jax.jit(
                lambda a, b: jax.tree.map(jnp.add, to_fp32(a), to_fp32(b))
            ),
            Piece.SPARSE_GRADS: lambda: jax.jit(apply_masks, out_shardings=self.layer_grads),
            Piece.SQ_NORM: lambda: jax.jit(squared_norm, out_shardings=self.replicated),
        }
        for part in ("layers", "shared"):
            for kind in ("device", "pinned_host"):
                builders[Piece.update(part, kind)] = lambda p=part, k=kind: self._update(p, k)
        return (builders | self._per_system)[name]()

    def layer_vjp(self, w: Any, x: jax.Array, mask: jax.Array) -> Any:
        """(layers(w, x), its vjp): the forward of a stack of layers and what its
        backward needs."""
        return jax.vjp(lambda w_, x_: self.model.apply_layers(w_, x_, mask), w, x)

    def head_loss(
        self, shared: Any, x: jax.Array, batch: dict, counts: Any = None, scale: Any = 1.0
    ) -> jax.Array:
        """The loss of `batch`; of a microbatch (or one system's share of the batch), its
        share of the whole batch's loss when `counts` are the whole batch's
        (`models/__init__.py`); times the loss scale `scale` (`numerics/precision.py`)."""
        model = self.model
        sums = model.loss_sums(model.head(shared, x, batch), batch)
        return normalise(sums, model.loss_counts(batch) if counts is None else counts) * scale

    def _update(self, part: str, kind: str) -> Any:
        """The clipped optimizer update of one phase's layers (or the shared weights),
        its results left in memory `kind`."""
        tx = self.tx_layers if part == "layers" else self.tx_shared
        params = self.layer_store if part == "layers" else self.shared_store
        opt = self.layer_opt if part == "layers" else self.shared_opt
        clip = self.train.grad_clip
        selects = is_mixed(self.train)

        def update(grads: Any, opt_state: Any, weights: Any, norm: jax.Array) -> Any:
            if kind == "pinned_host" and (self.train.sparsity is not None or selects):
                # the mask update (and a skipped mixed-precision step) mixes reductions
                # and selects, which JAX will not compile over host-memory operands:
                # work on device-memory views (on the CPU backend, the same RAM), and
                # leave the results on the host
                grads, opt_state, weights, norm = jax.device_put(
                    (grads, opt_state, weights, norm), jax.memory.Space.Device
                )
            # `norm` is the global norm of the unscaled gradients: finite or not, for all
            grads = clip_by_norm(unscale(grads, opt_state), norm, clip)
            return apply_update(tx, grads, opt_state, weights, jnp.isfinite(norm))

        out = (with_memory_kind(params, kind), with_memory_kind(opt, kind))
        return jax.jit(update, out_shardings=out)


@dataclass(frozen=True)
class Pieces:
    """The stages of a phased (or counted) run and what they share: the optimizers of a
    phase's layers and of the shared weights, and the abstract shapes of one layer and
    of the shared weights. With `train.sparsity`, the layers' optimizer is
    `wrap_optax`'s: its state holds the masks (`sparsity/`)."""

    stages: tuple[Stage, ...]
    tx_layers: optax.GradientTransformation
    tx_shared: optax.GradientTransformation
    layer_shape_one: Any  # one layer's parameters, [1, ...]
    shared_shapes: Any  # embedding and head parameters
    layer_logical: Any  # the layers' logical axes
    train: TrainConfig

    def init_layers(self, weights: Any, first_layer: int, shardings: tuple[Any, Any]) -> Any:
        """(weights, fresh optimizer state) of a stack of layers (on the devices) that
        starts at the model's layer `first_layer`, placed in `shardings`. A sparse run's
        state holds the whole model's masks for those layers, and its weights have
        their zeros."""
        sparse = self.train.sparsity
        if sparse is None:
            opt = jax.jit(self.tx_layers.init, out_shardings=shardings[1])(weights)
            return jax.device_put(weights, shardings[0]), opt

        def init(w: Any, first: jax.Array) -> Any:
            state = init_state(
                self.tx_layers.inner, w, sparse, self.layer_logical, self.train.seed, first
            )
            return apply_masks(w, state.masks), state

        return jax.jit(init, out_shardings=shardings)(weights, jnp.int32(first_layer))


def count_context(
    model: Model, train: TrainConfig, rules: Rules, cfg: PhasedConfig, context: int
) -> tuple:
    """What the stages' pieces compile to depends on besides their inputs, the counter's
    key beside their names and signatures (`Counter.count`): the model, the training
    settings, the rules, the stages' rts and rts', weight streaming (whose per-system
    pieces take the names and the inputs of the others: `systems.py`) and the attention
    core's shape, `context` ways split."""
    attention = AttentionShape.of(model.cfg, train.seq, context)
    return (model, train, rules, cfg.rts, cfg.rts_opt, cfg.weight_streaming, attention)


def build_stages(
    model: Model, meshes: list[Mesh], train: TrainConfig, cfg: PhasedConfig, rules: Rules
) -> Pieces:
    """One `Stage` per mesh, with the specs of `rules` (already `stage_rules`) and
    `cfg`'s rts and rts'; optimizers without clipping (the update clips by the global
    norm it is given). Stages keep no state but their jitted pieces, so trainers of the
    same settings in one process (a resumed run, a sweep, plans of other phase counts or
    activation policies) share them, traced and compiled once: of `cfg`, the stages
    depend on rts, rts' and weight streaming alone."""
    pieces_cfg = PhasedConfig(
        rts=cfg.rts, rts_optimizer=cfg.rts_opt, weight_streaming=cfg.weight_streaming
    )
    return _stages(model, tuple(meshes), train, pieces_cfg, rules)


@functools.lru_cache(maxsize=64)
def _stages(
    model: Model,
    meshes: tuple[Mesh, ...],
    train: TrainConfig,
    cfg: PhasedConfig,
    rules: Rules,
) -> Pieces:
    sizes = dict(meshes[0].shape)
    key = model.stack_key
    shapes, logical = model.abstract_params()
    one = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1, *s.shape[1:]), s.dtype), shapes[key])
    shared = {k: v for k, v in shapes.items() if k != key}
    shared_logical = {k: v for k, v in logical.items() if k != key}
    specs = make_specs(
        resolve_specs(one, logical[key], rules, sizes),
        one,
        resolve_specs(shared, shared_logical, rules, sizes),
        shared,
        rules,
        sizes,
        cfg,
        model,
        split_grads=train.zero == 2,  # ZeRO stage 2 (the pipelined engine's)
    )
    tx_layers = sparse_optimizer(
        with_master_weights(make_optimizer(train, one, logical[key], clip=False), train),
        train,
        one,
        logical[key],
        specs.layer_store,
        sizes,
    )
    tx_shared = with_master_weights(
        make_optimizer(train, shared, shared_logical, clip=False), train
    )
    opt_shapes = (jax.eval_shape(tx_layers.init, one), jax.eval_shape(tx_shared.init, shared))
    stages = tuple(
        Stage(
            s,
            m,
            specs,
            rules,
            model,
            train,
            tx_layers,
            tx_shared,
            *opt_shapes,
            logical[key],
            per_system=cfg.weight_streaming,
        )
        for s, m in enumerate(meshes)
    )
    return Pieces(stages, tx_layers, tx_shared, one, shared, logical[key], train)


def init_params(model: Model, stage: Stage, seed: int) -> Any:
    """Fresh parameters created on `stage`'s devices in its stored shardings (split over
    `tensor`, so no device holds the whole model): the values of the single-device
    init, for an engine to place where it keeps them."""
    shardings = {**stage.shared_store, model.stack_key: stage.layer_store}
    return jax.jit(model.init_params, out_shardings=shardings)(jax.random.key(seed))


def split_layers(stack: Any, slices: Sequence[tuple[int, int]]) -> list[Any]:
    """The layers `a:b` of a stacked parameter tree (arrays or host arrays) for each
    `(a, b)` of `slices`, where `stack` lies, for an engine to place on its stages: in
    one program, where slicing each leaf in turn would compile a program per leaf and
    slice (59 for a tiny GPT in four phases)."""

    def split(tree: Any) -> list[Any]:
        return [jax.tree.map(lambda x, a=a, b=b: x[a:b], tree) for a, b in slices]

    return jax.jit(split)(stack)


def sparse_grads(ex: Executor, st: Stage, phase: Phase, grads: Any, masks: Any) -> Any:
    """A sparse model's gradients of a stack of layers: its zero weights' dropped, so
    that the norm that clips them (and is reported) is the sparse model's, as in the
    resident engine. `masks` on the devices of `st` (`Stage.on_device`)."""
    return ex.run(phase, Piece.SPARSE_GRADS, st, (grads, masks))
