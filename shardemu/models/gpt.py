"""GPT: a decoder-only causal language model (Radford et al. 2019, GPT-2 Section 2.3).

Learned positions, pre-LayerNorm blocks, GELU MLP, a final LayerNorm, and an output
projection tied to the token embedding. Residual projections start at std
0.02 / sqrt(2 L), as GPT-2 scales them. Parameter names follow the GPT-2 release
(wte, wpe, ln_f) so counts compare one to one with the reference: GPT-2 small has
124,439,808 parameters.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from shardemu.config import ModelConfig
from shardemu.models.layers import ACT_BSD, Mlp, SelfAttention, embed, layer_norm, layer_stack
from shardemu.sharding import constrain


class GPTBlock(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, mask_bqk: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        x_bsd = x_bsd + SelfAttention(cfg, out_std, name="attn")(
            layer_norm(cfg, "ln_1")(x_bsd), mask_bqk
        )
        x_bsd = x_bsd + Mlp(cfg, out_std, name="mlp")(layer_norm(cfg, "ln_2")(x_bsd))
        return constrain(x_bsd, ACT_BSD), None


class GPT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_bs: jax.Array) -> jax.Array:
        """Token ids [b, s] -> next-token logits [b, s, V]."""
        cfg = self.cfg
        seq = tokens_bs.shape[1]
        wte = embed(cfg, cfg.vocab_size, "vocab", "wte")
        wpe = embed(cfg, cfg.max_positions, "position", "wpe")
        x_bsd = constrain(wte(tokens_bs) + wpe(jnp.arange(seq))[None], ACT_BSD)
        causal_bqk = jnp.tril(jnp.ones((1, seq, seq), dtype=bool))
        x_bsd, _ = layer_stack(GPTBlock, cfg, "blocks")(x_bsd, causal_bqk)
        x_bsd = layer_norm(cfg, "ln_f")(x_bsd)
        return constrain(wte.attend(x_bsd), ("batch", "sequence", "vocab"))


def gpt_loss(module: GPT, params: dict, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean causal-LM cross-entropy over every position of the global batch."""
    logits_bsv = module.apply({"params": params}, batch["tokens"])
    ce_bs = optax.softmax_cross_entropy_with_integer_labels(
        logits_bsv.astype(jnp.float32), batch["targets"]
    )
    return ce_bs.mean()
