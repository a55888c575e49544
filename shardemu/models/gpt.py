"""GPT: a decoder-only causal language model (Radford et al. 2019, GPT-2 Section 2.3).

Learned positions, pre-LayerNorm blocks, GELU MLP, a final LayerNorm, and an output
projection tied to the token embedding. Residual projections start at std
0.02 / sqrt(2 L), as GPT-2 scales them. Parameter names follow the GPT-2 release
(wte, wpe, ln_f) so counts compare one to one with the reference: GPT-2 small has
124,439,808 parameters.

The model is three parts so that engines can run them apart: `embed` (tokens ->
activations and mask), the layer stack `blocks`, and `head` (activations -> logits).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from shardemu.config import ModelConfig
from shardemu.models.family import Family, register
from shardemu.models.layers import (
    ACT_BSD,
    ACT_BSD_WHOLE,
    Mlp,
    SelfAttention,
    embed,
    layer_norm,
    layer_stack,
)
from shardemu.parallel.rules import constrain


class GPTBlock(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, mask_bqk: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        attn = SelfAttention(cfg, out_std, name="attn")
        x_bsd = x_bsd + attn(layer_norm(cfg, "ln_1")(x_bsd), mask_bqk)
        x_bsd = x_bsd + Mlp(cfg, out_std, name="mlp")(layer_norm(cfg, "ln_2")(x_bsd))
        return constrain(x_bsd, ACT_BSD), None


class GPT(nn.Module):
    cfg: ModelConfig

    def setup(self) -> None:
        cfg = self.cfg
        self.wte = embed(cfg, cfg.vocab_size, "vocab")
        self.wpe = embed(cfg, cfg.max_positions, "position")
        self.blocks = layer_stack(GPTBlock, cfg)
        self.ln_f = layer_norm(cfg)

    def embed(self, tokens_bs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Token ids [b, s] -> activations [b, s, d] and the causal mask [1, s, s]."""
        seq = tokens_bs.shape[1]
        x_bsd = constrain(self.wte(tokens_bs) + self.wpe(jnp.arange(seq))[None], ACT_BSD)
        return x_bsd, jnp.tril(jnp.ones((1, seq, seq), dtype=bool))

    def head(self, x_bsd: jax.Array) -> jax.Array:
        """Activations [b, s, d] -> next-token logits [b, s, V] (tied to wte)."""
        logits = self.wte.attend(constrain(self.ln_f(x_bsd), ACT_BSD_WHOLE))
        return constrain(logits, ("batch", "sequence", "vocab"))

    def __call__(self, tokens_bs: jax.Array) -> jax.Array:
        x_bsd, mask = self.embed(tokens_bs)
        x_bsd, _ = self.blocks(x_bsd, mask)
        return self.head(x_bsd)


def gpt_loss_sums(logits_bsv: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """Summed causal-LM cross-entropy; its count is every position (`gpt_loss_counts`)."""
    ce_bs = optax.softmax_cross_entropy_with_integer_labels(
        logits_bsv.astype(jnp.float32), batch["targets"]
    )
    return (ce_bs.sum(),)


def gpt_loss_counts(batch: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    return (jnp.asarray(batch["targets"].size, jnp.float32),)


FAMILY = register(
    Family(
        name="gpt",
        module=GPT,
        layer=GPTBlock,
        stack_key="blocks",
        inputs=("tokens",),
        batch_axes={"tokens": ("batch", "sequence"), "targets": ("batch", "sequence")},
        loss_sums=gpt_loss_sums,
        loss_counts=gpt_loss_counts,
        make_batch=lambda corpus, step, size, seq, _cfg: corpus.gpt_batch(step, size, seq),
        example_mask=False,
    )
)
