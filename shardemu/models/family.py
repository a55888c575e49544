"""Model families: what an engine needs to know of GPT, BERT, Llama, or a model of your own.

A family is one `Family` value: its Flax modules, its batches and loss, and what the
analytic FLOP count needs of its head. shardemu's own families `register` theirs (one
file each; `models/__init__.py` imports them) so that a `ModelConfig` names them; a
model of your own needs no registration: `Model(cfg, family=MY_FAMILY)` runs on every
engine and planner (docs/own-model.md shows one end to end). `Model`
(`models/__init__.py`), the analytic FLOP count (`accounting/flops.py`) and the command
line read the family and never branch on its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from shardemu.config import ModelConfig, require_positive
from shardemu.data import SyntheticCorpus
from shardemu.errors import ConfigError
from shardemu.models import causal_lm

LogicalAxes = tuple[str | None, ...]
LossTerms = tuple[jax.Array, ...]


@dataclass(frozen=True, eq=False)
class Family:
    """One model family: the interface a model provides to run on the resident,
    pipelined and phased engines, the planners and the search.

    The engines run a model in three parts, so that a pipeline stage or a phase can run
    its slice of the layers alone:

    module        `module(cfg)` -> the Flax linen module of the whole model, with
                  methods `embed(*inputs) -> (x [b, s, d], mask)` and
                  `head(x, *head_inputs) -> outputs`, a submodule named `stack_key`
                  made by `shardemu.layer_stack(layer, cfg)` (the layers, their
                  parameters stacked on a leading `layers` axis), and `__call__(*inputs,
                  *head_inputs)` that runs all three (it initialises the parameters)
    layer         `layer(cfg)` -> one layer, called as `layer(x, mask) -> (x, None)`
    stack_key     the parameter subtree that holds the stacked layers

    Every parameter is made with `nn.with_logical_partitioning(init, axes)`, one logical
    axis name per dimension (None for one never split); the rules table
    (`parallel/rules.py`) maps the names to mesh axes. Activations may be pinned with
    `shardemu.constrain(x, axes)` or Flax's `nn.with_logical_constraint`. Parameters
    are made in `cfg.param_dtype` (`jnp.dtype(cfg.param_dtype)` as each layer's
    `param_dtype`): a mixed precision changes it, and a module that ignores it is
    refused (`numerics/precision.compute_model`).

    The rest default to next-token prediction (`models/causal_lm.py`): a batch of
    `tokens` and `targets`, logits [b, s, V] from `head`, mean cross-entropy; the
    activations between layers named (batch, sequence, embed). The rules table must name
    these too.

    activation_axes  logical axes of the activations between layers ([b, s, d]: what a
                  pipeline stage sends the next, what a phase hands on)
    inputs        the batch arrays `embed` takes, in order
    head_inputs   the batch arrays `head` takes after the activations, in order
    batch_axes    logical axes of every array in a training batch (int32 arrays)
    loss_sums     (head outputs, batch) -> the loss's summed terms
    loss_counts   batch -> the counts that divide them
    make_batch    (corpus, step, size, seq, model config) -> a host batch
    example_mask  whether the attention mask is per example ([b, 1, s], travels with
                  the batch) or one for all ([1, s, s] causal)
    head_matmuls  (config, batch, seq) -> the output head's forward matmuls by name,
                  as (m, k, n): what the analytic FLOP count needs of the head
    shaped        (name, layers, hidden, heads) -> a config of those dimensions shaped
                  like the family's presets (`--model NAME --layers ...`); None: the
                  family takes no custom dimensions on the command line
    presets       the family's named configurations, with their sources
    min_seq       the shortest sequence a batch can hold (BERT's sentence pairs)
    gated_mlp     whether the MLP's input is two matrices (gate and up: SwiGLU), which
                  the analytic FLOP count needs
    grouped_query whether its attention reads `ModelConfig.num_kv_heads` key/value heads;
                  a config of a family without it must leave them at the query heads
    mixture_of_experts  whether its MLP is `ModelConfig.num_experts` experts of which
                  each token uses `experts_per_token` (the analytic FLOP count adds the
                  router and counts the active experts); a config of a family without
                  it must leave `num_experts` 0
    block_sparse  whether its layer kernels are the ones block sparsity applies to
                  (`sparsity/masks.py`: GPT's and BERT's); without, sparsity is refused

    Families compare by identity: two models are the same model when their configs are
    equal and their family is the same object.
    """

    name: str
    module: Callable[[ModelConfig], nn.Module]
    layer: Callable[[ModelConfig], nn.Module]
    stack_key: str
    activation_axes: LogicalAxes = ("batch", "sequence", "embed")
    inputs: tuple[str, ...] = ("tokens",)
    batch_axes: dict[str, LogicalAxes] = field(default_factory=lambda: dict(causal_lm.BATCH_AXES))
    loss_sums: Callable[[Any, dict], LossTerms] = causal_lm.loss_sums
    loss_counts: Callable[[dict], LossTerms] = causal_lm.loss_counts
    make_batch: Callable[[SyntheticCorpus, int, int, int, ModelConfig], dict[str, np.ndarray]] = (
        causal_lm.make_batch
    )
    example_mask: bool = False
    head_matmuls: Callable[[ModelConfig, int, int], dict[str, tuple[int, int, int]]] = (
        causal_lm.head_matmuls
    )
    shaped: Callable[[str, int, int, int], ModelConfig] | None = None
    presets: tuple[ModelConfig, ...] = ()
    head_inputs: tuple[str, ...] = ()
    min_seq: int = 1
    gated_mlp: bool = False
    grouped_query: bool = False
    mixture_of_experts: bool = False
    block_sparse: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Family.name must be a non-empty string, got {self.name!r}")
        for what in ("module", "layer", "loss_sums", "loss_counts", "make_batch", "head_matmuls"):
            if not callable(getattr(self, what)):
                raise ConfigError(
                    f"Family {self.name!r}: `{what}` must be callable, got "
                    f"{type(getattr(self, what)).__name__}"
                )
        unknown = set(self.inputs + self.head_inputs) - set(self.batch_axes)
        if unknown:
            raise ConfigError(
                f"Family {self.name!r}: inputs {sorted(unknown)} are not in its batch_axes "
                f"({', '.join(self.batch_axes)}); name every batch array's logical axes there"
            )


FAMILIES: dict[str, Family] = {}
PRESETS: dict[str, ModelConfig] = {}


def register(family: Family) -> Family:
    """Add `family` and its presets to the registries."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    for preset in family.presets:
        if preset.name in PRESETS or preset.family != family.name:
            raise ValueError(f"preset {preset.name!r} clashes or is not of {family.name!r}")
    FAMILIES[family.name] = family
    PRESETS.update((preset.name, preset) for preset in family.presets)
    return family


def get_family(name: str) -> Family:
    """The family called `name`, or an error listing the registered ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown model family {name!r}; registered: {', '.join(FAMILIES)}"
        ) from None


def get_preset(name: str) -> ModelConfig:
    """The preset called `name`, or an error listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise ConfigError(f"unknown model {name!r}; known presets: {known}") from None


def custom_model(
    family: str,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int | None,
    positions: int,
    kv_heads: int | None = None,
    mlp: int | None = None,
) -> ModelConfig:
    """A model of `family` of any size, shaped like its presets (`Family.shaped`), its
    vocabulary `vocab`, key/value heads `kv_heads` and MLP width `mlp` unless None, at
    least `positions` positions: `--model llama --layers L --hidden H --heads A`."""
    if family not in FAMILIES:
        raise ConfigError(
            f"custom dimensions need `family` set to a family ({', '.join(FAMILIES)}), "
            f"got {family!r}"
        )
    require_positive("custom model", layers=layers, hidden=hidden, heads=heads)
    if hidden % heads:
        raise ConfigError(f"`hidden` {hidden} is not divisible by `heads` {heads}")
    shaped = FAMILIES[family].shaped
    if shaped is None:
        raise ConfigError(f"the {family} family takes no custom dimensions (Family.shaped is None)")
    if kv_heads is not None and not FAMILIES[family].grouped_query:
        grouped = [name for name, f in FAMILIES.items() if f.grouped_query]
        raise ConfigError(
            f"`kv_heads` {kv_heads} goes with grouped-query attention ({', '.join(grouped)}); "
            f"{family}'s attention has a key/value head per query head"
        )
    cfg = shaped(f"{family}-L{layers}-H{hidden}-A{heads}", layers, hidden, heads)
    changes: dict[str, int] = {"max_positions": max(positions, cfg.max_positions)}
    for name, value in (("vocab_size", vocab), ("num_kv_heads", kv_heads), ("mlp_dim", mlp)):
        if value is not None:
            changes[name] = value
    return cfg.replace(**changes)
