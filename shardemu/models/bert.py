"""BERT: a bidirectional encoder pre-trained with masked-LM and next-sentence losses
(Devlin et al. 2019, Sections 3.1 and A.2).

Token + position + segment embeddings with LayerNorm, post-LayerNorm encoder layers
with a padding mask, a tanh pooler on [CLS], a next-sentence classifier, and a
masked-LM head (dense + GELU + LayerNorm, decoder tied to the token embedding, plus an
output bias). Names follow the reference `BertForPreTraining` so counts compare one to
one: BERT-Base 110,106,428 and BERT-Large 336,226,108 parameters with these heads.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from shardemu.config import ModelConfig
from shardemu.models.layers import (
    ACT_BSD,
    Mlp,
    SelfAttention,
    dense,
    embed,
    layer_norm,
    layer_stack,
    zeros,
)
from shardemu.sharding import constrain


class BertLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, mask_bqk: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        x_bsd = layer_norm(cfg, "attn_ln")(
            x_bsd + SelfAttention(cfg, cfg.init_std, name="attn")(x_bsd, mask_bqk)
        )
        x_bsd = layer_norm(cfg, "mlp_ln")(x_bsd + Mlp(cfg, cfg.init_std, name="mlp")(x_bsd))
        return constrain(x_bsd, ACT_BSD), None


class BERT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(
        self, tokens_bs: jax.Array, segments_bs: jax.Array, attention_mask_bs: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Returns masked-LM logits [b, s, V] and next-sentence logits [b, 2]."""
        cfg = self.cfg
        seq = tokens_bs.shape[1]
        word = embed(cfg, cfg.vocab_size, "vocab", "word_embeddings")
        x_bsd = (
            word(tokens_bs)
            + embed(cfg, cfg.max_positions, "position", "position_embeddings")(jnp.arange(seq))[
                None
            ]
            + embed(cfg, cfg.type_vocab_size, "segment", "token_type_embeddings")(segments_bs)
        )
        x_bsd = constrain(layer_norm(cfg, "embeddings_ln")(x_bsd), ACT_BSD)
        keys_bqk = attention_mask_bs.astype(bool)[:, None, :]
        x_bsd, _ = layer_stack(BertLayer, cfg, "layers")(x_bsd, keys_bqk)

        pooled_bd = jnp.tanh(
            dense(cfg, cfg.embed_dim, ("embed", "embed_out"), "pooler")(x_bsd[:, 0])
        )
        nsp_b2 = dense(cfg, 2, ("embed", "classes"), "nsp")(pooled_bd)

        h_bsd = dense(cfg, cfg.embed_dim, ("embed", "embed_out"), "mlm_transform")(x_bsd)
        h_bsd = layer_norm(cfg, "mlm_ln")(nn.gelu(h_bsd, approximate=cfg.gelu_approximate))
        bias_v = self.param(
            "mlm_bias", zeros(("vocab",)), (cfg.vocab_size,), jnp.dtype(cfg.param_dtype)
        )
        mlm_bsv = word.attend(h_bsd) + bias_v
        return constrain(mlm_bsv, ("batch", "sequence", "vocab")), nsp_b2


def bert_loss(module: BERT, params: dict, batch: dict[str, jax.Array]) -> jax.Array:
    """Masked-LM cross-entropy averaged over masked positions, plus next-sentence
    cross-entropy averaged over pairs (the sum BERT pre-training minimises)."""
    mlm_bsv, nsp_b2 = module.apply(
        {"params": params}, batch["tokens"], batch["segments"], batch["attention_mask"]
    )
    ce_bs = optax.softmax_cross_entropy_with_integer_labels(
        mlm_bsv.astype(jnp.float32), batch["mlm_targets"]
    )
    w_bs = batch["mlm_weights"].astype(jnp.float32)
    mlm = (ce_bs * w_bs).sum() / jnp.maximum(w_bs.sum(), 1.0)
    nsp = optax.softmax_cross_entropy_with_integer_labels(
        nsp_b2.astype(jnp.float32), batch["next_sentence"]
    ).mean()
    return mlm + nsp
