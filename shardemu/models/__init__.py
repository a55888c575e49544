"""GPT and BERT behind one interface: module, loss, data and the logical axes of both.

Engines (resident, pipelined; phased and streaming later) see only `Model`, so the same
training code serves both families. A model is three parts an engine may run apart:
`embed(params, batch) -> (x, mask)`, `apply_layers(layer_params, x, mask) -> x` over any
number of stacked layers (a pipeline stage runs its slice), and `head` + loss.

Losses are (sum, count) terms: the loss is sum_i sums_i / counts_i. An engine that
splits a batch (microbatches, gradient accumulation) sums the chunks' `sums` and
divides by the counts of the whole batch, which gives exactly the big batch's gradient
even for BERT, whose masked-LM mean is over a data-dependent number of tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from shardemu.config import ModelConfig, Parallelism, TrainConfig
from shardemu.data import SyntheticCorpus
from shardemu.errors import ConfigError
from shardemu.models import bert, gpt, llama, moe  # noqa: F401  (each registers its family)
from shardemu.models.family import (
    FAMILIES,
    PRESETS,
    Family,
    LogicalAxes,
    LossTerms,
    custom_model,
    get_family,
    get_preset,
)
from shardemu.models.layers import layer_stack
from shardemu.models.logical import require_named, stacked
from shardemu.parallel.rules import Rules, is_logical_axes, megatron_rules, recording_names

Batch = dict[str, jax.Array]
__all__ = [
    "FAMILIES",
    "PRESETS",
    "Batch",
    "Family",
    "LogicalAxes",
    "LossTerms",
    "Model",
    "as_model",
    "custom_model",
    "get_preset",
    "normalise",
]


def normalise(sums: LossTerms, counts: LossTerms) -> jax.Array:
    """The loss from its (sum, count) terms."""
    return sum(s / c for s, c in zip(sums, counts, strict=True))


@dataclass(frozen=True)
class Model:
    """A model an engine runs: its sizes (`cfg`) and its family (`Family`: modules, batch,
    loss). `Model(cfg)` is the registered family `cfg.family` names (GPT, BERT, Llama);
    `Model(cfg, family=MINE)` is a family of your own, registered or not
    (`models/family.py` says what it provides). Engines and planners take a `Model` and
    never rebuild one from its config, so a model of your own stays yours everywhere.
    Two models are equal when their configs are and their family is the same object."""

    cfg: ModelConfig
    family: Family = None  # type: ignore[assignment]  # None: the family `cfg.family` names
    module: nn.Module = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.cfg, ModelConfig):
            raise ConfigError(
                f"Model takes a ModelConfig (shardemu.get_preset(NAME), or your own), got a "
                f"{type(self.cfg).__name__}"
            )
        if self.family is None:
            object.__setattr__(self, "family", get_family(self.cfg.family))
        elif not isinstance(self.family, Family):
            raise ConfigError(
                f"Model's family must be a shardemu.Family, got a {type(self.family).__name__}"
            )
        elif self.family.name != self.cfg.family:
            raise ConfigError(
                f"{self.cfg.name}: ModelConfig.family is {self.cfg.family!r} but the family "
                f"given is {self.family.name!r}; set ModelConfig(family={self.family.name!r})"
            )
        family = self.family
        if not family.grouped_query and self.cfg.kv_heads != self.cfg.num_heads:
            raise ConfigError(
                f"{self.cfg.name}: ModelConfig.num_kv_heads={self.cfg.num_kv_heads}, but the "
                f"{family.name} family's attention has a key/value head per query head; "
                f"use a family with grouped-query attention (llama) or leave it 0"
            )
        if not family.mixture_of_experts and self.cfg.num_experts:
            raise ConfigError(
                f"{self.cfg.name}: ModelConfig.num_experts={self.cfg.num_experts}, but the "
                f"{family.name} family's MLP is dense; use a mixture-of-experts family (moe) "
                f"or leave it 0"
            )
        module = family.module(self.cfg)
        missing = [m for m in ("embed", "head") if not callable(getattr(module, m, None))]
        if missing:
            raise ConfigError(
                f"the {family.name} family's module ({type(module).__name__}) has no "
                f"{' or '.join(missing)} method; an engine runs a model as embed, the layers "
                f"(Family.stack_key) and head (shardemu.Family's docstring)"
            )
        object.__setattr__(self, "module", module)

    @property
    def name(self) -> str:
        return self.cfg.name

    def replace(self, **changes: Any) -> Model:
        """This model with its config's `changes` (a padded vocabulary, a dtype, fewer
        layers): the same family."""
        return Model(self.cfg.replace(**changes), self.family)

    @property
    def stack_key(self) -> str:
        """The parameter subtree holding the stacked layers."""
        return self.family.stack_key

    @property
    def batch_axes(self) -> dict[str, LogicalAxes]:
        """Logical axes of every array in a training batch."""
        return self.family.batch_axes

    def check_rules(self, rules: Rules | None) -> None:
        """Refuse a rules table that splits a logical axis neither shardemu's models nor
        this one name (a typo, or another model's name): it would split nothing, and
        the model would run with that dimension whole, without a word. Names of
        shardemu's own vocabulary (`megatron_rules`) may go unused: one table serves
        every family."""
        if rules is None:
            return
        names = _names_of(self)
        known = {name for name, _ in megatron_rules()} | names
        unused = [f"{name!r} -> {axes!r}" for name, axes in rules if axes and name not in known]
        if unused:
            raise ConfigError(
                f"the rules split {', '.join(unused)}, but {self.name} (family "
                f"{self.family.name!r}) names no parameter, activation or batch axis so; "
                f"its names: {', '.join(sorted(names))}"
            )

    def check_fits(self, train: TrainConfig, par: Parallelism) -> None:
        """Refuse training settings this model or the mesh cannot take
        (`TrainConfig.check_fits`), and sequences shorter than its family's batches hold."""
        train.check_fits(self.cfg, par)
        if train.sparsity is not None and not self.family.block_sparse:
            raise ConfigError(
                f"{self.cfg.name}: block sparsity (SparsityConfig.sparsity) is not built "
                f"for the {self.family.name} family's kernels yet; train it dense"
            )
        if train.seq < self.family.min_seq:
            raise ConfigError(
                f"{self.family.name} batches need TrainConfig.seq >= {self.family.min_seq}, got "
                f"{train.seq}"
            )

    def _inputs(self, batch: Batch) -> tuple[jax.Array, ...]:
        return tuple(batch[k] for k in self.family.inputs)

    def embed(self, params: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """Activations [b, s, d] and attention mask ([1, s, s] causal or [b, 1, s] keys)."""
        return self.module.apply({"params": params}, *self._inputs(batch), method="embed")

    def apply_layers(self, layer_params: dict, x_bsd: jax.Array, mask: jax.Array) -> jax.Array:
        """Run the layers stacked in `layer_params` (however many) over `x_bsd`."""
        length = jax.tree.leaves(layer_params)[0].shape[0]
        stack = layer_stack(self.family.layer, self.cfg, length=length)
        return stack.apply({"params": layer_params}, x_bsd, mask)[0]

    def head(self, params: dict, x_bsd: jax.Array, batch: Batch) -> Any:
        """The head's outputs from the last layer's activations (and the batch arrays
        it reads: BERT's masked positions)."""
        args = (batch[k] for k in self.family.head_inputs)
        return self.module.apply({"params": params}, x_bsd, *args, method="head")

    def loss_sums(self, outputs: Any, batch: Batch) -> LossTerms:
        return self.family.loss_sums(outputs, batch)

    def loss_counts(self, batch: Batch) -> LossTerms:
        return self.family.loss_counts(batch)

    def forward_sums(self, params: dict, batch: Batch) -> LossTerms:
        """Embed, all layers, head: the summed loss terms of `batch`."""
        x_bsd, mask = self.embed(params, batch)
        x_bsd = self.apply_layers(params[self.stack_key], x_bsd, mask)
        return self.loss_sums(self.head(params, x_bsd, batch), batch)

    def loss(self, params: dict, batch: Batch) -> jax.Array:
        """The training loss of one batch."""
        return normalise(self.forward_sums(params, batch), self.loss_counts(batch))

    def batch(
        self, corpus: SyntheticCorpus, step: int, size: int, seq: int
    ) -> dict[str, np.ndarray]:
        """Batch `step` of `corpus` (step k is the k-th batch: a pure function of the
        corpus's seed and k), `size` sequences of `seq` tokens."""
        for name, value, least in (("step", step, 0), ("size", size, 1), ("seq", seq, 1)):
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < least:
                raise ConfigError(
                    f"Model.batch: `{name}` must be an integer >= {least}, got {value!r}"
                )
        return self.family.make_batch(corpus, step, size, seq, self.cfg)

    def check_batch(self, batch: dict[str, Any], size: int, seq: int) -> None:
        """A training batch as the compiled step takes it: its family's arrays, each of
        its shape for `size` sequences of `seq` tokens, and token ids inside the
        vocabulary (an id past it would read no embedding row: a NaN loss, not an
        error). Checked on the host, before anything is placed."""
        want = self.batch_shapes(size, seq)
        if set(batch) != set(want):
            raise ConfigError(
                f"{self.cfg.name}'s batch holds {', '.join(sorted(want))}; got "
                f"{', '.join(sorted(batch)) or 'nothing'} (Model.batch makes one)"
            )
        for key, shape in want.items():
            got = tuple(np.shape(batch[key]))
            if got != shape:
                raise ConfigError(
                    f"batch array {key!r} has shape {got}; the step takes {shape} "
                    f"({size} sequences of {seq} tokens)"
                )
        tokens = batch.get("tokens")
        if isinstance(tokens, np.ndarray) and tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.cfg.vocab_size:
                raise ConfigError(
                    f"batch token ids run from {low} to {high}, outside {self.cfg.name}'s "
                    f"vocabulary of {self.cfg.vocab_size} (0 to {self.cfg.vocab_size - 1})"
                )

    def batch_shapes(self, size: int, seq: int) -> dict[str, tuple[int, ...]]:
        """The shape of each array of a batch of `size` sequences of `seq` tokens."""
        dims = {"batch": size, "sequence": seq, "predictions": self.cfg.predictions(seq)}
        return {k: tuple(dims[a] for a in axes) for k, axes in self.batch_axes.items()}

    def abstract_batch(self, size: int, seq: int, shardings: dict[str, Any]) -> Batch:
        """A batch of `size` sequences of `seq` tokens as shapes, each array with its
        sharding: what a step compiles over."""
        return {
            k: jax.ShapeDtypeStruct(shape, np.int32, sharding=shardings[k])
            for k, shape in self.batch_shapes(size, seq).items()
        }

    def _init_inputs(self) -> tuple[jax.Array, ...]:
        ids = jnp.zeros((1, min(8, self.cfg.max_positions)), jnp.int32)
        inputs = [jnp.ones_like(ids) if k == "attention_mask" else ids for k in self.family.inputs]
        return (*inputs, *(jnp.zeros((1, 1), jnp.int32) for _ in self.family.head_inputs))

    def _boxed_params(self, rng: jax.Array) -> dict:
        return self.module.init(rng, *self._init_inputs())["params"]

    def init_params(self, rng: jax.Array) -> dict:
        """Freshly initialised parameters (plain arrays). Call under `jax.jit` with
        `out_shardings` to create them already sharded."""
        return nn.unbox(self._boxed_params(rng))

    def abstract_params(self) -> tuple[dict, dict]:
        """(shapes, logical axes) of every parameter, without allocating any: traced
        once per process and config (~0.2 s at GPT-3's size; a search plans one model
        hundreds of times), so callers share the trees and must not change them."""
        shapes, logical, _ = _traced(self)
        return shapes, logical


@functools.lru_cache(maxsize=64)
def _traced(model: Model) -> tuple[dict, dict, frozenset[str]]:
    """`model`'s initialisation traced once (nothing allocated): its parameters' shapes
    and logical axes, and the logical names its activations are given on the way
    (`recording_names`)."""
    with recording_names() as activations:
        boxed = jax.eval_shape(model._boxed_params, jax.random.key(0))
    logical = jax.tree.map(
        tuple,
        nn.get_partition_spec(boxed),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    shapes, key = nn.unbox(boxed), model.stack_key
    if key not in shapes:
        raise ConfigError(
            f"{model.name}: the {model.family.name} family's parameters have no "
            f"{key!r} subtree (Family.stack_key), only {', '.join(shapes)}; name the "
            f"layer stack (shardemu.layer_stack) {key!r} in its module"
        )
    logical[key] = stacked(logical[key], shapes[key])
    require_named(shapes, logical, f"{model.name}: ")
    return shapes, logical, frozenset(activations)


def _names_of(model: Model) -> frozenset[str]:
    """Every logical name `model` uses: its parameters', its activations', its batch's
    and its inter-layer activations'."""
    _, logical, activations = _traced(model)
    params = {a for axes in jax.tree.leaves(logical, is_leaf=is_logical_axes) for a in axes if a}
    batch = {a for axes in model.batch_axes.values() for a in axes if a}
    between = {a for a in model.family.activation_axes if a}
    return activations | params | batch | between


def param_count(shapes: dict) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def param_bytes(shapes: dict) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def count_params(model: Model) -> int:
    """`model`'s parameters, from its abstract init (`Model.abstract_params`)."""
    return param_count(model.abstract_params()[0])


def as_model(model: Model | ModelConfig) -> Model:
    """`model`, or the model of a registered family's config: what the planners, the
    search and `train` take from a caller."""
    return model if isinstance(model, Model) else Model(model)
