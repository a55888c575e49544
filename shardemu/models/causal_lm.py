"""Next-token prediction: the batch, loss and head matmuls every causal language model
shares (GPT, Llama, and a model of your own unless its `Family` says otherwise).

A batch is `tokens` and `targets` ([b, s] each, targets the tokens shifted by one:
`data.SyntheticCorpus.gpt_batch`); the loss is the mean cross-entropy of the head's
logits [b, s, V] over every position, as (sum, count) terms (`models/__init__.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardemu.config import ModelConfig
from shardemu.data import SyntheticCorpus

BATCH_AXES = {"tokens": ("batch", "sequence"), "targets": ("batch", "sequence")}


def loss_sums(logits_bsv: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """Summed causal-LM cross-entropy; its count is every position (`loss_counts`)."""
    ce_bs = optax.softmax_cross_entropy_with_integer_labels(
        logits_bsv.astype(jnp.float32), batch["targets"]
    )
    return (ce_bs.sum(),)


def loss_counts(batch: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    return (jnp.asarray(batch["targets"].size, jnp.float32),)


def make_batch(
    corpus: SyntheticCorpus, step: int, size: int, seq: int, _cfg: ModelConfig
) -> dict[str, np.ndarray]:
    return corpus.gpt_batch(step, size, seq)


def head_matmuls(cfg: ModelConfig, batch: int, seq: int) -> dict[str, tuple[int, int, int]]:
    """The output projection at every position (the embedding lookup is a gather):
    GPT's, tied to the embedding, and Llama's untied `lm_head` alike."""
    return {"logits": (batch * seq, cfg.embed_dim, cfg.vocab_size)}
