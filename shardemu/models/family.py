"""Model families by name: what an engine needs to know of GPT, BERT, or the next one.

Adding a family is one file: define its Flax module and layer, its loss terms, its
batches, its head's matmuls and its presets, and `register` a `Family`;
`models/__init__.py` imports the file. `Model` (`models/__init__.py`), the analytic
FLOP count (`accounting/flops.py`) and the command line look the family up by
`ModelConfig.family` and never branch on its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from shardemu.config import ModelConfig, require_positive
from shardemu.data import SyntheticCorpus
from shardemu.errors import ConfigError

LogicalAxes = tuple[str | None, ...]
LossTerms = tuple[jax.Array, ...]


@dataclass(frozen=True)
class Family:
    """One model family.

    module        the Flax module of a whole model (methods `embed` and `head`)
    layer         the Flax module of one layer, stacked on a leading `layers` axis
    stack_key     the parameter subtree that holds the stacked layers
    inputs        the batch arrays `embed` takes, in order
    head_inputs   the batch arrays `head` takes after the activations, in order
    batch_axes    logical axes of every array in a training batch
    loss_sums     (head outputs, batch) -> the loss's summed terms
    loss_counts   batch -> the counts that divide them
    make_batch    (corpus, step, size, seq, model config) -> a host batch
    example_mask  whether the attention mask is per example ([b, 1, s], travels with
                  the batch) or one for all ([1, s, s] causal)
    shaped        (name, layers, hidden, heads) -> a config of those dimensions shaped
                  like the family's presets (`--model NAME --layers ...`)
    head_matmuls  (config, batch, seq) -> the output head's forward matmuls by name,
                  as (m, k, n): what the analytic FLOP count needs of the head
    presets       the family's named configurations, with their sources
    head_inputs   the batch arrays `head` takes after the activations, in order
    min_seq       the shortest sequence a batch can hold (BERT's sentence pairs)
    gated_mlp     whether the MLP's input is two matrices (gate and up: SwiGLU), which
                  the analytic FLOP count needs
    grouped_query whether its attention reads `ModelConfig.num_kv_heads` key/value heads;
                  a config of a family without it must leave them at the query heads
    block_sparse  whether its layer kernels are the ones block sparsity applies to
                  (`sparsity/masks.py`: GPT's and BERT's); without, sparsity is refused
    """

    name: str
    module: Callable[[ModelConfig], nn.Module]
    layer: type[nn.Module]
    stack_key: str
    inputs: tuple[str, ...]
    batch_axes: dict[str, LogicalAxes]
    loss_sums: Callable[[Any, dict], LossTerms]
    loss_counts: Callable[[dict], LossTerms]
    make_batch: Callable[[SyntheticCorpus, int, int, int, ModelConfig], dict[str, np.ndarray]]
    example_mask: bool
    shaped: Callable[[str, int, int, int], ModelConfig]
    head_matmuls: Callable[[ModelConfig, int, int], dict[str, tuple[int, int, int]]]
    presets: tuple[ModelConfig, ...] = ()
    head_inputs: tuple[str, ...] = ()
    min_seq: int = 1
    gated_mlp: bool = False
    grouped_query: bool = False
    block_sparse: bool = True


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
    if kv_heads is not None and not FAMILIES[family].grouped_query:
        grouped = [name for name, f in FAMILIES.items() if f.grouped_query]
        raise ConfigError(
            f"`kv_heads` {kv_heads} goes with grouped-query attention ({', '.join(grouped)}); "
            f"{family}'s attention has a key/value head per query head"
        )
    cfg = FAMILIES[family].shaped(f"{family}-L{layers}-H{hidden}-A{heads}", layers, hidden, heads)
    changes: dict[str, int] = {"max_positions": max(positions, cfg.max_positions)}
    for field, value in (("vocab_size", vocab), ("num_kv_heads", kv_heads), ("mlp_dim", mlp)):
        if value is not None:
            changes[field] = value
    return cfg.replace(**changes)
