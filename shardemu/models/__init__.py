"""GPT and BERT behind one interface: module, loss, data and the logical axes of both.

Engines (resident now; pipelined, phased and streaming later) see only `Model`, so the
same training code serves both families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from shardemu.config import ModelConfig
from shardemu.data import SyntheticCorpus
from shardemu.models.bert import BERT, bert_loss
from shardemu.models.gpt import GPT, gpt_loss
from shardemu.sharding import LogicalAxes

Batch = dict[str, jax.Array]

_BATCH_AXES: dict[str, dict[str, LogicalAxes]] = {
    "gpt": {"tokens": ("batch", "sequence"), "targets": ("batch", "sequence")},
    "bert": {
        "tokens": ("batch", "sequence"),
        "segments": ("batch", "sequence"),
        "attention_mask": ("batch", "sequence"),
        "mlm_targets": ("batch", "sequence"),
        "mlm_weights": ("batch", "sequence"),
        "next_sentence": ("batch",),
    },
}


@dataclass(frozen=True)
class Model:
    cfg: ModelConfig
    module: nn.Module = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "module", GPT(self.cfg) if self.cfg.family == "gpt" else BERT(self.cfg)
        )

    @property
    def batch_axes(self) -> dict[str, LogicalAxes]:
        """Logical axes of every array in a training batch."""
        return _BATCH_AXES[self.cfg.family]

    def loss(self, params: dict, batch: Batch) -> jax.Array:
        fn: Callable = gpt_loss if self.cfg.family == "gpt" else bert_loss
        return fn(self.module, params, batch)

    def batch(
        self, corpus: SyntheticCorpus, step: int, size: int, seq: int
    ) -> dict[str, np.ndarray]:
        if self.cfg.family == "gpt":
            return corpus.gpt_batch(step, size, seq)
        return corpus.bert_batch(step, size, seq)

    def _init_inputs(self) -> tuple[jax.Array, ...]:
        ids = jnp.zeros((1, min(8, self.cfg.max_positions)), jnp.int32)
        return (ids,) if self.cfg.family == "gpt" else (ids, ids, jnp.ones_like(ids))

    def _boxed_params(self, rng: jax.Array) -> dict:
        return self.module.init(rng, *self._init_inputs())["params"]

    def init_params(self, rng: jax.Array) -> dict:
        """Freshly initialised parameters (plain arrays). Call under `jax.jit` with
        `out_shardings` to create them already sharded."""
        return nn.unbox(self._boxed_params(rng))

    def abstract_params(self) -> tuple[dict, dict]:
        """(shapes, logical axes) of every parameter, without allocating any."""
        boxed = jax.eval_shape(self._boxed_params, jax.random.key(0))
        logical = jax.tree.map(
            tuple,
            nn.get_partition_spec(boxed),
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )
        return nn.unbox(boxed), logical


def param_count(shapes: dict) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def param_bytes(shapes: dict) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
