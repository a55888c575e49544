"""Model families by name: what an engine needs to know of GPT, BERT, or the next one.

Adding a family is one file: define its Flax module and layer, its loss terms and its
batches, and `register` a `Family`; `models/__init__.py` imports the file. `Model`
(`models/__init__.py`) looks the family up by `ModelConfig.family` and never branches
on its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from shardemu.config import ModelConfig
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
    head_inputs: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    """The family called `name`, or an error listing the registered ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown model family {name!r}; registered: {', '.join(FAMILIES)}"
        ) from None
