"""Llama: a decoder-only causal language model with rotary positions, RMSNorm, a SwiGLU
MLP and grouped-query attention (Touvron et al. 2023, "Llama 2", Section 2.2; Dubey et
al. 2024, "The Llama 3 Herd of Models", Section 3.2).

Pre-RMSNorm blocks (Zhang and Sennrich 2019) without biases; rotary position embeddings
(Su et al. 2021, RoFormer) on queries and keys, in the rotate-half form of Hugging Face's
`LlamaForCausalLM`; `num_kv_heads` key/value heads shared by groups of query heads
(Ainslie et al. 2023, GQA), query head j reading key/value head j // (A / G); the MLP
down(silu(gate x) * up x) (Shazeer 2020, "GLU Variants Improve Transformer"); a final
RMSNorm and an output projection (`lm_head`) untied from the token embedding. Parameter
names follow Hugging Face's (embed_tokens, layers, self_attn.q_proj, mlp.gate_proj,
norm, lm_head), so counts compare one to one: Llama-3-8B has 8,030,261,248 parameters.

Tensor parallelism is Megatron's: query heads and key/value heads split over `tensor`
(column-parallel), the output projection and `down_proj` row-parallel. Where the tensor
size does not divide the key/value heads, the default rules replicate them on every
tensor device (`parallel.rules.megatron_rules`: as vLLM does; Megatron-Core refuses it).

Presets and their sources (Hugging Face `config.json` of each release, which the papers'
tables agree with):
- Llama 2 7B: 32 layers, d 4096, 32 heads (no grouping), d_ff 11008, vocabulary 32000,
  context 4096, RoPE base 10000 (Touvron et al. 2023, Table 1; meta-llama/Llama-2-7b-hf).
- Llama 3 8B / 70B: 32 / 80 layers, d 4096 / 8192, 32 / 64 heads, 8 key/value heads,
  d_ff 14336 / 28672, vocabulary 128256, context 8192, RoPE base 500000 (Dubey et al.
  2024, Table 3; meta-llama/Meta-Llama-3-8B, -70B).
- Llama 3.1 405B: 126 layers, d 16384, 128 heads, 8 key/value heads, d_ff 53248,
  vocabulary 128256, context 131072 (Dubey et al. 2024, Table 3; meta-llama/Llama-3.1-405B).
- `llama-tiny` is shardemu's test size: 8 query heads over 4 key/value heads, so tensor
  sizes 2 and 4 split both; 4 layers for up to 4 stages.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from shardemu.config import ModelConfig
from shardemu.models import fp8
from shardemu.models.family import Family, register
from shardemu.models.layers import ACT_BSD, ACT_BSD_WHOLE, ACT_BSF, ACT_BSHK, layer_stack, normal
from shardemu.parallel.rules import constrain


class RMSNorm(nn.Module):
    """x / rms(x) * scale, in float32 (Zhang and Sennrich 2019; Hugging Face's
    `LlamaRMSNorm` computes in float32 and casts back)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array) -> jax.Array:
        cfg = self.cfg
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
            (cfg.embed_dim,),
            jnp.dtype(cfg.param_dtype),
        )
        x = x_bsd.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.layer_norm_eps)
        return (x.astype(x_bsd.dtype) * scale).astype(x_bsd.dtype)


def rotary(x_bshk: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of queries or keys [b, s, heads, k]: each pair (i,
    i + k/2) of a head's features rotated by position * theta^(-2i/k) (Su et al. 2021,
    eq. 34, in Hugging Face's rotate-half layout)."""
    seq, k = x_bshk.shape[1], x_bshk.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, k, 2, dtype=jnp.float32) / k)
    angles_sk = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None]
    angles_sk = jnp.concatenate([angles_sk, angles_sk], axis=-1)
    cos, sin = jnp.cos(angles_sk)[None, :, None], jnp.sin(angles_sk)[None, :, None]
    x = x_bshk.astype(jnp.float32)
    half = jnp.concatenate([-x[..., k // 2 :], x[..., : k // 2]], axis=-1)
    return (x * cos + half * sin).astype(x_bshk.dtype)


def _kernel(cfg: ModelConfig, shape: tuple[int, ...], axes: tuple[str, ...], std: float):
    return normal(std, axes), shape, jnp.dtype(cfg.param_dtype)


class Attention(nn.Module):
    """Grouped-query self-attention: A query heads over G key/value heads."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, mask_bqk: jax.Array) -> jax.Array:
        cfg = self.cfg
        d, heads, groups, k = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        std = cfg.init_std
        x_bsd = constrain(x_bsd, ACT_BSD_WHOLE)
        wq = self.param("q_proj", *_kernel(cfg, (d, heads, k), ("embed", "heads", "head_dim"), std))
        kv_axes = ("embed", "kv_heads", "head_dim")
        wk = self.param("k_proj", *_kernel(cfg, (d, groups, k), kv_axes, std))
        wv = self.param("v_proj", *_kernel(cfg, (d, groups, k), kv_axes, std))
        wo = self.param("o_proj", *_kernel(cfg, (heads, k, d), ("heads", "head_dim", "embed"), std))
        x_bsd, wq, wk, wv, wo = nn.dtypes.promote_dtype(x_bsd, wq, wk, wv, wo)
        fp8_on = cfg.fp8_matmuls
        q_bshk = rotary(fp8.einsum("bsd,dhk->bshk", x_bsd, wq, fp8_on), cfg.rope_theta)
        k_bsgk = rotary(fp8.einsum("bsd,dgk->bsgk", x_bsd, wk, fp8_on), cfg.rope_theta)
        v_bsgk = fp8.einsum("bsd,dgk->bsgk", x_bsd, wv, fp8_on)
        q_bshk = constrain(q_bshk, ACT_BSHK)
        # K and V computed on each device's own tokens, then gathered whole: under
        # context parallelism XLA would otherwise gather V's input, d wide, not V, G k
        # wide (16x the bytes for Llama 3 405B)
        local = ("batch", "sequence", "kv_heads", "head_dim")
        k_bsgk, v_bsgk = constrain(k_bsgk, local), constrain(v_bsgk, local)
        kv_axes_act = ("batch", None, "kv_heads", "head_dim")  # the whole sequence (KV_BSHK)
        k_bsgk, v_bsgk = constrain(k_bsgk, kv_axes_act), constrain(v_bsgk, kv_axes_act)
        b, s = q_bshk.shape[:2]
        q_bsgrk = q_bshk.reshape(b, s, groups, heads // groups, k)  # head j: group j // r
        scores = jnp.einsum("bqgrk,bsgk->bgrqs", q_bsgrk, k_bsgk) / math.sqrt(k)
        scores = jnp.where(mask_bqk[:, None, None], scores, jnp.finfo(scores.dtype).min)
        # softmax in float32, then back to the activations' type (mixed precision)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v_bsgk.dtype)
        ctx_bshk = jnp.einsum("bgrqs,bsgk->bqgrk", probs, v_bsgk).reshape(b, s, heads, k)
        out_bsd = fp8.einsum("bshk,hkd->bsd", constrain(ctx_bshk, ACT_BSHK), wo, fp8_on)
        return constrain(out_bsd, ACT_BSD)


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x): gate and up column-parallel, down row-parallel."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array) -> jax.Array:
        cfg = self.cfg
        d, f, std = cfg.embed_dim, cfg.mlp_dim, cfg.init_std
        gate = self.param("gate_proj", *_kernel(cfg, (d, f), ("embed", "mlp"), std))
        up = self.param("up_proj", *_kernel(cfg, (d, f), ("embed", "mlp"), std))
        down = self.param("down_proj", *_kernel(cfg, (f, d), ("mlp", "embed"), std))
        x_bsd, gate, up, down = nn.dtypes.promote_dtype(
            constrain(x_bsd, ACT_BSD_WHOLE), gate, up, down
        )
        on = cfg.fp8_matmuls
        h_bsf = nn.silu(fp8.einsum("bsd,df->bsf", x_bsd, gate, on))
        h_bsf = h_bsf * fp8.einsum("bsd,df->bsf", x_bsd, up, on)
        return constrain(fp8.einsum("bsf,fd->bsd", constrain(h_bsf, ACT_BSF), down, on), ACT_BSD)


class LlamaBlock(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, mask_bqk: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        attn = Attention(cfg, name="self_attn")
        x_bsd = x_bsd + attn(RMSNorm(cfg, name="input_layernorm")(x_bsd), mask_bqk)
        mlp = SwiGLU(cfg, name="mlp")
        x_bsd = x_bsd + mlp(RMSNorm(cfg, name="post_attention_layernorm")(x_bsd))
        return constrain(x_bsd, ACT_BSD), None


class Llama(nn.Module):
    cfg: ModelConfig
    block = LlamaBlock  # the layer (a mixture of experts' blocks: models/moe.py)

    def setup(self) -> None:
        cfg = self.cfg
        self.embed_tokens = nn.Embed(
            cfg.vocab_size,
            cfg.embed_dim,
            embedding_init=normal(cfg.init_std, ("vocab", "embed")),
            param_dtype=jnp.dtype(cfg.param_dtype),
        )
        self.layers = layer_stack(self.block, cfg)
        self.norm = RMSNorm(cfg)
        self.lm_head = self.param(
            "lm_head",
            *_kernel(cfg, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), cfg.init_std),
        )

    def embed(self, tokens_bs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Token ids [b, s] -> activations [b, s, d] and the causal mask [1, s, s]."""
        seq = tokens_bs.shape[1]
        x_bsd = constrain(self.embed_tokens(tokens_bs), ACT_BSD)
        return x_bsd, jnp.tril(jnp.ones((1, seq, seq), dtype=bool))

    def head(self, x_bsd: jax.Array) -> jax.Array:
        """Activations [b, s, d] -> next-token logits [b, s, V] (untied `lm_head`)."""
        x_bsd, w = nn.dtypes.promote_dtype(constrain(self.norm(x_bsd), ACT_BSD_WHOLE), self.lm_head)
        return constrain(x_bsd @ w, ("batch", "sequence", "vocab"))

    def __call__(self, tokens_bs: jax.Array) -> jax.Array:
        x_bsd, mask = self.embed(tokens_bs)
        x_bsd, _ = self.layers(x_bsd, mask)
        return self.head(x_bsd)


def shaped(
    name: str,
    layers: int,
    d: int,
    heads: int,
    kv_heads: int | None = None,
    mlp: int | None = None,
    vocab: int = 128256,
    ctx: int = 8192,
    theta: float = 500000.0,
) -> ModelConfig:
    """A Llama of these dimensions; by default Llama 3's vocabulary, context and RoPE
    base, its own key/value heads (no grouping) and d_ff = 8/3 d rounded up to a
    multiple of 256 (Touvron et al. 2023a, Section 2.2; Meta's `multiple_of`)."""
    mlp = mlp or 256 * math.ceil(8 * d / 3 / 256)
    return ModelConfig(
        name=name,
        family="llama",
        vocab_size=vocab,
        num_layers=layers,
        embed_dim=d,
        num_heads=heads,
        mlp_dim=mlp,
        max_positions=ctx,
        num_kv_heads=kv_heads or heads,
        rope_theta=theta,
    )


PRESETS = (
    shaped("llama-tiny", 4, 64, 8, kv_heads=4, mlp=192, vocab=512, ctx=128),
    shaped("llama2-7b", 32, 4096, 32, mlp=11008, vocab=32000, ctx=4096, theta=10000.0),
    shaped("llama3-8b", 32, 4096, 32, kv_heads=8, mlp=14336),
    shaped("llama3-70b", 80, 8192, 64, kv_heads=8, mlp=28672),
    shaped("llama3-405b", 126, 16384, 128, kv_heads=8, mlp=53248, ctx=131072),
)

FAMILY = register(
    Family(
        name="llama",
        module=Llama,
        layer=LlamaBlock,
        stack_key="layers",
        activation_axes=ACT_BSD,
        shaped=shaped,  # a causal language model (`Family`'s defaults), its head untied
        presets=PRESETS,
        gated_mlp=True,
        grouped_query=True,  # block_sparse False: not `sparsity.masks.SPARSE_KERNELS`
    )
)
