"""GPT: a decoder-only causal language model (Radford et al. 2019, GPT-2 Section 2.3).

Learned positions, pre-LayerNorm blocks, GELU MLP, a final LayerNorm, and an output
projection tied to the token embedding. Residual projections start at std
0.02 / sqrt(2 L), as GPT-2 scales them. Parameter names follow the GPT-2 release
(wte, wpe, ln_f) so counts compare one to one with the reference: GPT-2 small has
124,439,808 parameters.

The model is three parts so that engines can run them apart: `embed` (tokens ->
activations and mask), the layer stack `blocks`, and `head` (activations -> logits).

Presets and their sources:
- GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners",
  Table 2; vocabulary 50257 and context 1024 from the released `hparams.json`).
- GPT-3 (Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1; context
  2048, d_ff = 4 d_model, GPT-2 vocabulary). Table 2.1 lists GPT-3 XL (1.3B) with 24 heads
  of 128, which does not multiply to d_model 2048; we use 16 heads of 128 as public
  re-implementations do (EleutherAI GPT-Neo 1.3B). GPT-3 13B's d_model 5140 likewise
  does not equal 40 heads x 128; we use 5120 (as Megatron-LM's GPT-3 13B recipe does).
- `gpt-tiny` is shardemu's own test size: 8 heads and a vocabulary of 512 so that every
  tensor axis up to 8 divides it, 4 layers for up to 4 stages.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

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


def shaped(name: str, layers: int, d: int, heads: int, ctx: int = 2048) -> ModelConfig:
    """A GPT of these dimensions: d_ff = 4 d, GPT-2's vocabulary."""
    return ModelConfig(
        name=name,
        family="gpt",
        vocab_size=50257,
        num_layers=layers,
        embed_dim=d,
        num_heads=heads,
        mlp_dim=4 * d,
        max_positions=ctx,
    )


PRESETS = (
    ModelConfig("gpt-tiny", "gpt", 512, 4, 64, 8, 256, 128),
    shaped("gpt2-small", 12, 768, 12, ctx=1024),
    shaped("gpt2-medium", 24, 1024, 16, ctx=1024),
    shaped("gpt2-large", 36, 1280, 20, ctx=1024),
    shaped("gpt2-xl", 48, 1600, 25, ctx=1024),
    shaped("gpt3-1.3b", 24, 2048, 16),
    shaped("gpt3-13b", 40, 5120, 40),
    shaped("gpt3-175b", 96, 12288, 96),
)

FAMILY = register(
    Family(
        name="gpt",
        module=GPT,
        layer=GPTBlock,
        stack_key="blocks",
        activation_axes=ACT_BSD,
        shaped=shaped,  # a causal language model: `Family`'s defaults for the rest
        presets=PRESETS,
        block_sparse=True,
    )
)
