"""BERT: a bidirectional encoder pre-trained with masked-LM and next-sentence losses
(Devlin et al. 2019, Sections 3.1 and A.2).

Token + position + segment embeddings with LayerNorm, post-LayerNorm encoder layers
with a padding mask, a tanh pooler on [CLS], a next-sentence classifier, and a
masked-LM head (dense + GELU + LayerNorm, decoder tied to the token embedding, plus an
output bias). Names follow the reference `BertForPreTraining` so counts compare one to
one: BERT-Base 110,106,428 and BERT-Large 336,226,108 parameters with these heads.

The masked-LM head runs only at the masked positions (`mlm_positions`, P a sequence:
`ModelConfig.predictions`), gathered from the last layer's output, as Google's
reference does (`gather_indexes` in run_pretraining.py) and NVIDIA's and Graphcore's
BERT do: at s = 512 and P = 80 its vocabulary matmul costs 16% of what it would at
every position, and for BERT-Base that matmul at every position is a fifth of the
forward pass.

Like GPT, the model is `embed`, the layer stack `layers`, and `head`.

Presets and their sources: BERT (Devlin et al. 2019, Section 3: Base L=12 H=768 A=12,
Large L=24 H=1024 A=16; vocabulary 30522, 512 positions and 2 segment types from the
released `bert_config.json`). `bert-tiny` is shardemu's own test size: 8 heads and a
vocabulary of 512 so that every tensor axis up to 8 divides it, 4 layers for up to 4
stages.
"""

from __future__ import annotations

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
    dense,
    embed,
    layer_norm,
    layer_stack,
    zeros,
)
from shardemu.parallel.rules import constrain

ACT_BPD = ("batch", "predictions", "embed")  # the activations at the masked positions


class BertLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, mask_bqk: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        attn = SelfAttention(cfg, cfg.init_std, name="attn")
        x_bsd = layer_norm(cfg, "attn_ln")(x_bsd + attn(x_bsd, mask_bqk))
        x_bsd = layer_norm(cfg, "mlp_ln")(x_bsd + Mlp(cfg, cfg.init_std, name="mlp")(x_bsd))
        return constrain(x_bsd, ACT_BSD), None


class BERT(nn.Module):
    cfg: ModelConfig

    def setup(self) -> None:
        cfg = self.cfg
        self.word_embeddings = embed(cfg, cfg.vocab_size, "vocab")
        self.position_embeddings = embed(cfg, cfg.max_positions, "position")
        self.token_type_embeddings = embed(cfg, cfg.type_vocab_size, "segment")
        self.embeddings_ln = layer_norm(cfg)
        self.layers = layer_stack(BertLayer, cfg)
        self.pooler = dense(cfg, cfg.embed_dim, ("embed", "embed_out"))
        self.nsp = dense(cfg, 2, ("embed", "classes"))
        self.mlm_transform = dense(cfg, cfg.embed_dim, ("embed", "embed_out"))
        self.mlm_ln = layer_norm(cfg)
        self.mlm_bias = self.param(
            "mlm_bias", zeros(("vocab",)), (cfg.vocab_size,), jnp.dtype(cfg.param_dtype)
        )

    def embed(
        self, tokens_bs: jax.Array, segments_bs: jax.Array, attention_mask_bs: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Ids [b, s] -> activations [b, s, d] and the key padding mask [b, 1, s]."""
        seq = tokens_bs.shape[1]
        x_bsd = (
            self.word_embeddings(tokens_bs)
            + self.position_embeddings(jnp.arange(seq))[None]
            + self.token_type_embeddings(segments_bs)
        )
        x_bsd = constrain(self.embeddings_ln(x_bsd), ACT_BSD)
        return x_bsd, attention_mask_bs.astype(bool)[:, None, :]

    def head(self, x_bsd: jax.Array, positions_bp: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Activations and the masked positions [b, P] -> masked-LM logits at those
        positions [b, P, V] and next-sentence logits [b, 2]."""
        nsp_b2 = self.nsp(jnp.tanh(self.pooler(x_bsd[:, 0])))
        x_bpd = jnp.take_along_axis(constrain(x_bsd, ACT_BSD_WHOLE), positions_bp[..., None], 1)
        h_bpd = nn.gelu(self.mlm_transform(x_bpd), approximate=self.cfg.gelu_approximate)
        h_bpd = constrain(self.mlm_ln(h_bpd), ACT_BPD)
        mlm_bpv = self.word_embeddings.attend(h_bpd) + self.mlm_bias
        return constrain(mlm_bpv, ("batch", "predictions", "vocab")), nsp_b2

    def __call__(
        self,
        tokens_bs: jax.Array,
        segments_bs: jax.Array,
        attention_mask_bs: jax.Array,
        positions_bp: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        x_bsd, mask = self.embed(tokens_bs, segments_bs, attention_mask_bs)
        x_bsd, _ = self.layers(x_bsd, mask)
        return self.head(x_bsd, positions_bp)


def bert_loss_sums(
    outputs: tuple[jax.Array, jax.Array], batch: dict[str, jax.Array]
) -> tuple[jax.Array, ...]:
    """Summed masked-LM cross-entropy over masked positions and summed next-sentence
    cross-entropy; divided by `bert_loss_counts` they give BERT's pre-training loss."""
    mlm_bpv, nsp_b2 = outputs
    ce_bp = optax.softmax_cross_entropy_with_integer_labels(
        mlm_bpv.astype(jnp.float32), batch["mlm_targets"]
    )
    nsp_b = optax.softmax_cross_entropy_with_integer_labels(
        nsp_b2.astype(jnp.float32), batch["next_sentence"]
    )
    return (ce_bp * batch["mlm_weights"]).sum(), nsp_b.sum()


def bert_loss_counts(batch: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    masked = jnp.maximum(batch["mlm_weights"].astype(jnp.float32).sum(), 1.0)
    return masked, jnp.asarray(batch["next_sentence"].size, jnp.float32)


def shaped(name: str, layers: int, d: int, heads: int) -> ModelConfig:
    """A BERT of these dimensions: d_ff = 4 d, BERT's vocabulary, 512 positions, the
    exact (erf) GELU and LayerNorm epsilon 1e-12 of the released `bert_config.json`."""
    return ModelConfig(
        name=name,
        family="bert",
        vocab_size=30522,
        num_layers=layers,
        embed_dim=d,
        num_heads=heads,
        mlp_dim=4 * d,
        max_positions=512,
        layer_norm_eps=1e-12,
        gelu_approximate=False,
    )


def head_matmuls(cfg: ModelConfig, batch: int, seq: int) -> dict[str, tuple[int, int, int]]:
    """The masked-LM head at its P masked positions a sequence, the pooler and the
    next-sentence classifier (the embedding lookup is a gather)."""
    masked, d = batch * cfg.predictions(seq), cfg.embed_dim
    return {
        "mlm_transform": (masked, d, d),
        "logits": (masked, d, cfg.vocab_size),
        "pooler": (batch, d, d),
        "nsp": (batch, d, 2),
    }


PRESETS = (
    shaped("bert-tiny", 4, 64, 8).replace(vocab_size=512, mlp_dim=256, max_positions=128),
    shaped("bert-base", 12, 768, 12),
    shaped("bert-large", 24, 1024, 16),
)

FAMILY = register(
    Family(
        name="bert",
        module=BERT,
        layer=BertLayer,
        stack_key="layers",
        activation_axes=ACT_BSD,
        inputs=("tokens", "segments", "attention_mask"),
        head_inputs=("mlm_positions",),
        batch_axes={
            "tokens": ("batch", "sequence"),
            "segments": ("batch", "sequence"),
            "attention_mask": ("batch", "sequence"),
            "mlm_positions": ("batch", "predictions"),
            "mlm_targets": ("batch", "predictions"),
            "mlm_weights": ("batch", "predictions"),
            "next_sentence": ("batch",),
        },
        loss_sums=bert_loss_sums,
        loss_counts=bert_loss_counts,
        make_batch=lambda corpus, step, size, seq, cfg: corpus.bert_batch(
            step, size, seq, cfg.predictions(seq)
        ),
        example_mask=True,
        block_sparse=True,
        shaped=shaped,
        head_matmuls=head_matmuls,
        presets=PRESETS,
        min_seq=8,  # a sentence pair: [CLS] A [SEP] B [SEP] with room for both halves
    )
)
