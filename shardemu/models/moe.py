"""Mixture of experts: Llama's blocks with the MLP replaced by `num_experts` SwiGLU
experts, each token routed to the top `experts_per_token` of them (Mixtral: Jiang et al.
2024, "Mixtral of Experts", Section 2.1; Switch: Fedus et al. 2022).

Routing, per layer and token: a router (a [d, E] matrix, Hugging Face's
`block_sparse_moe.gate`) gives E logits; their softmax, in float32, gives the router
probabilities p; the top K experts take the token. With K = 1 its gate is its
probability (Switch, Section 2.1); with K > 1 the K probabilities renormalised to sum to
one (Mixtral's softmax over the top-K logits, the same numbers). The expert outputs,
weighted by the gates, are summed.

Capacity (GShard, Lepikhin et al. 2020, Algorithm 1; a sequence is a group): each
expert takes at most C = ceil(K s capacity_factor / E) tokens of a sequence of s. Slots
fill in priority order, every token's first choice before any second choice, and in
sequence order within a choice; a (token, choice) past its expert's capacity is
dropped, its gate zero (the residual carries the token on). `routing` reports the drops.
`capacity_factor` 0 is dropless: C = s. Dispatch and combine are gathers, not one-hot
matmuls, so the FLOPs XLA counts are the router's and the experts' alone.

Expert parallelism: the dispatched tokens [b, E, C, d] are pinned to the `experts` and
`expert_batch` logical axes; with the default rules on a mesh of `expert` > 1
(`megatron_rules(expert_parallel=True)`) the experts are split over `expert` and the
batch over `replica` x `expert`, so resharding the tokens is an all-to-all over
`expert` each way (dispatch and combine; GShard Section 3.2), which the ledger records.

The load-balancing loss (Switch, eq. 4; Hugging Face's `load_balancing_loss_func`, as
Mixtral trains with it): E sum_e f_e P_e, f_e the fraction of a sequence's tokens routed
to e (summed over the K choices), P_e its mean router probability over the sequence;
averaged over layers and sequences and added to the loss times
`router_aux_loss_coef`. Per token it is a_t = E sum_e chosen_te P_e, whose mean over a
sequence's tokens is the sequence's loss, so it is a per-token term like the
cross-entropy: the layers carry each token's running sum on one extra channel of the
residual stream ([b, s, d + 1]), the head adds it to the loss, and every engine, batch
split and microbatch gets the same gradient as one device (1/d more activation bytes).

Presets and their sources:
- Mixtral 8x7B: Llama's shape with 32 layers, d 4096, 32 heads over 8 key/value heads,
  d_ff 14336, vocabulary 32000, context 32768, RoPE base 1e6, 8 experts, top 2, the
  load-balancing loss at 0.02 (mistralai/Mixtral-8x7B-v0.1 `config.json`; Jiang et al.
  2024, Table 1): 46,702,792,704 parameters, as Hugging Face's `MixtralForCausalLM`.
  Mixtral routes dropless; the preset's capacity factor is 1.0 (Switch's, Section 2.2)
  so that its shapes are static: a plan of it times the experts at balanced load. Set
  `capacity_factor` 0 for dropless routing at E / K times the expert work.
- `moe-tiny`: shardemu's test size, 4 experts, top 2, capacity factor 1.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from shardemu.config import ModelConfig
from shardemu.errors import ShardingError
from shardemu.models import causal_lm, fp8
from shardemu.models.family import Family, register
from shardemu.models.layers import ACT_BSD, ACT_BSD_WHOLE, normal
from shardemu.models.llama import Attention, Llama, RMSNorm
from shardemu.models.llama import shaped as llama_shaped
from shardemu.parallel.rules import (
    active_rules,
    axes_tuple,
    constrain,
    logical_to_spec,
    named,
)

EXPERT_TOKENS = ("expert_batch", "experts", "capacity", "embed")  # at the experts
BATCH_TOKENS = ("batch", None, "capacity", "embed")  # the same [b, E, C, d], as dispatched


def exchange(tokens_becd: jax.Array, to_experts: bool) -> jax.Array:
    """Dispatched tokens [b, E, C, d] from their sequences' devices to their experts'
    (`to_experts`) or back: one all-to-all over the mesh axes the experts are split over
    (`shard_map`, so that its transpose in the backward pass is an all-to-all too, where
    XLA's CPU pipeline would reshard with all-reduces). Without those axes (expert = 1,
    or rules that keep the experts whole) the tokens are only pinned to their layout."""
    src, dst = (BATCH_TOKENS, EXPERT_TOKENS) if to_experts else (EXPERT_TOKENS, BATCH_TOKENS)
    named(src, dst)
    active = active_rules()
    if active is None:
        return tokens_becd
    mesh, rules = active
    specs = {
        axes: logical_to_spec(axes, rules, f"activation {axes}", mesh.axis_names)
        for axes in (BATCH_TOKENS, EXPERT_TOKENS)
    }
    experts = axes_tuple(specs[EXPERT_TOKENS][1])
    if not experts:
        return constrain(tokens_becd, dst)
    batch, expert_batch = axes_tuple(specs[BATCH_TOKENS][0]), axes_tuple(specs[EXPERT_TOKENS][0])
    if batch != expert_batch + experts:
        raise ShardingError(
            f"expert parallelism over {experts} needs the batch split over "
            f"{expert_batch + experts} (its expert_batch axes, then the experts'), as "
            f"megatron_rules(expert_parallel=True) splits it; the rules split it over {batch}"
        )
    split, concat = (1, 0) if to_experts else (0, 1)
    names = experts[0] if len(experts) == 1 else experts
    move = lambda x: jax.lax.all_to_all(x, names, split, concat, tiled=True)  # noqa: E731
    return jax.shard_map(
        move, mesh=mesh, in_specs=specs[src], out_specs=specs[dst], check_vma=False
    )(tokens_becd)


def _kernel(cfg: ModelConfig, shape: tuple[int, ...], axes: tuple[str | None, ...]):
    return normal(cfg.init_std, axes), shape, jnp.dtype(cfg.param_dtype)


class Routing(nn.Module):
    """The router: for each token its K experts, their gates, and where each (token,
    choice) sits in its expert's slots (or that it was dropped)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array) -> tuple[jax.Array, ...]:
        cfg = self.cfg
        e, k = cfg.num_experts, cfg.experts_per_token
        w = self.param("gate", *_kernel(cfg, (cfg.embed_dim, e), ("embed", None)))
        x_bsd, w = nn.dtypes.promote_dtype(x_bsd, w)
        probs_bse = jax.nn.softmax((x_bsd @ w).astype(jnp.float32), axis=-1)
        top_p, top_e = jax.lax.top_k(probs_bse, k)  # [b, s, k]
        gates = top_p if k == 1 else top_p / top_p.sum(-1, keepdims=True)
        b, s = x_bsd.shape[:2]
        capacity = cfg.capacity(s)
        chosen = jax.nn.one_hot(top_e, e, dtype=jnp.int32)  # [b, s, k, e]
        by_priority = chosen.transpose(0, 2, 1, 3).reshape(b, k * s, e)  # choice-major
        position = ((jnp.cumsum(by_priority, axis=1) - 1) * by_priority).sum(-1)
        position = position.reshape(b, k, s).transpose(0, 2, 1)  # [b, s, k]
        kept = position < capacity
        # the load-balancing loss per token: E sum_e chosen_te P_e (module docstring)
        mean_p = probs_bse.mean(axis=1, keepdims=True)  # [b, 1, e]
        balance_bs = e * (chosen.sum(2) * mean_p).sum(-1)
        return top_e, gates * kept, position, kept, balance_bs


class Experts(nn.Module):
    """E SwiGLU experts (Hugging Face's w1 gate, w3 up, w2 down), tokens dispatched to
    their slots and combined back by gathers."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        d, f, e = cfg.embed_dim, cfg.mlp_dim, cfg.num_experts
        x_bsd = constrain(x_bsd, ACT_BSD_WHOLE)
        top_e, gates, position, kept, balance_bs = Routing(cfg, name="router")(x_bsd)
        w1 = self.param("w1", *_kernel(cfg, (e, d, f), ("experts", "embed", "mlp")))
        w3 = self.param("w3", *_kernel(cfg, (e, d, f), ("experts", "embed", "mlp")))
        w2 = self.param("w2", *_kernel(cfg, (e, f, d), ("experts", "mlp", "embed")))
        x_bsd, w1, w3, w2 = nn.dtypes.promote_dtype(x_bsd, w1, w3, w2)
        b, s = x_bsd.shape[:2]
        capacity = cfg.capacity(s)
        slots = e * capacity
        slot_bsk = jnp.where(kept, top_e * capacity + position, slots)  # dropped: past the end
        token_bsk = jnp.broadcast_to(jnp.arange(s)[None, :, None], slot_bsk.shape)
        rows = jnp.arange(b)[:, None, None]
        # the token in each slot (s, a zero row, where a slot is empty)
        slot_token = jnp.full((b, slots + 1), s, jnp.int32).at[rows, slot_bsk].set(token_bsk)
        padded = jnp.concatenate([x_bsd, jnp.zeros((b, 1, d), x_bsd.dtype)], axis=1)
        dispatched = jnp.take_along_axis(padded, slot_token[:, :slots, None], axis=1)
        tokens = exchange(dispatched.reshape(b, e, capacity, d), to_experts=True)
        on = cfg.fp8_matmuls  # one scale over all experts' weights (`models/fp8.py`)
        h = jax.nn.silu(fp8.einsum("becd,edf->becf", tokens, w1, on))
        h = h * fp8.einsum("becd,edf->becf", tokens, w3, on)
        h = constrain(h, ("expert_batch", "experts", "capacity", "mlp"))
        out = exchange(fp8.einsum("becf,efd->becd", h, w2, on), to_experts=False)
        out = out.reshape(b, slots, d)
        out = jnp.concatenate([out, jnp.zeros((b, 1, d), out.dtype)], axis=1)
        picked = jnp.take_along_axis(out, slot_bsk.reshape(b, -1, 1), axis=1)
        y_bsd = (picked.reshape(b, s, -1, d) * gates[..., None].astype(out.dtype)).sum(2)
        return constrain(y_bsd, ACT_BSD), balance_bs


class MoeBlock(nn.Module):
    """Llama's block with the experts for its MLP, on [b, s, d + 1] activations whose
    last channel carries the load-balancing loss so far (module docstring)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsD: jax.Array, mask_bqk: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        x_bsd, balance = x_bsD[..., : cfg.embed_dim], x_bsD[..., cfg.embed_dim :]
        attn = Attention(cfg, name="self_attn")
        x_bsd = x_bsd + attn(RMSNorm(cfg, name="input_layernorm")(x_bsd), mask_bqk)
        moe = Experts(cfg, name="block_sparse_moe")
        y_bsd, balance_bs = moe(RMSNorm(cfg, name="post_attention_layernorm")(x_bsd))
        balance = balance + (balance_bs / cfg.num_layers)[..., None].astype(balance.dtype)
        return constrain(jnp.concatenate([x_bsd + y_bsd, balance], axis=-1), ACT_BSD), None


class Moe(Llama):
    """Llama's embedding, norm and untied head around the expert blocks."""

    block = MoeBlock

    def embed(self, tokens_bs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Token ids -> activations [b, s, d + 1] (the load-balancing channel at 0) and
        the causal mask."""
        x_bsd, mask = super().embed(tokens_bs)
        zero = jnp.zeros((*x_bsd.shape[:2], 1), x_bsd.dtype)
        return constrain(jnp.concatenate([x_bsd, zero], axis=-1), ACT_BSD), mask

    def head(self, x_bsD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Logits [b, s, V] and each token's load-balancing loss, weighted."""
        d = self.cfg.embed_dim
        balance_bs = x_bsD[..., d].astype(jnp.float32) * self.cfg.router_aux_loss_coef
        return super().head(x_bsD[..., :d]), balance_bs


def moe_loss_sums(outputs: tuple[jax.Array, jax.Array], batch: dict) -> tuple[jax.Array, ...]:
    """The cross-entropy's sum plus the weighted load-balancing loss's: both per token,
    divided by the same count (`causal_lm.loss_counts`)."""
    logits_bsv, balance_bs = outputs
    return (causal_lm.loss_sums(logits_bsv, batch)[0] + balance_bs.sum(),)


def routing(model_cfg: ModelConfig, router_params: dict, x_bsd: jax.Array) -> dict[str, float]:
    """What one layer's router does with activations `x_bsd` (after the MLP's norm):
    the tokens each expert takes, the (token, choice) pairs dropped past capacity, and
    their fraction. `router_params` is that layer's `block_sparse_moe/router`."""
    top_e, _, _, kept, _ = Routing(model_cfg).apply({"params": router_params}, x_bsd)
    load = np.bincount(np.asarray(top_e)[np.asarray(kept)], minlength=model_cfg.num_experts)
    dropped = int((~np.asarray(kept)).sum())
    return {
        "tokens_per_expert": load.tolist(),
        "dropped": dropped,
        "dropped_fraction": dropped / np.asarray(kept).size,
    }


def shaped(name: str, layers: int, d: int, heads: int) -> ModelConfig:
    """A mixture of experts of these dimensions: Llama's shape (`llama.shaped`) with 8
    experts, top 2, capacity factor 1 and Mixtral's load-balancing weight."""
    return llama_shaped(name, layers, d, heads).replace(
        family="moe", num_experts=8, experts_per_token=2, router_aux_loss_coef=0.02
    )


PRESETS = (
    llama_shaped("moe-tiny", 4, 64, 8, kv_heads=4, mlp=128, vocab=512, ctx=128).replace(
        family="moe", num_experts=4, experts_per_token=2, router_aux_loss_coef=0.01
    ),
    llama_shaped(
        "mixtral-8x7b", 32, 4096, 32, kv_heads=8, mlp=14336, vocab=32000, ctx=32768, theta=1e6
    ).replace(family="moe", num_experts=8, experts_per_token=2, router_aux_loss_coef=0.02),
)

FAMILY = register(
    Family(
        name="moe",
        module=Moe,
        layer=MoeBlock,
        stack_key="layers",
        activation_axes=ACT_BSD,
        loss_sums=moe_loss_sums,
        shaped=shaped,
        presets=PRESETS,
        gated_mlp=True,
        grouped_query=True,
        mixture_of_experts=True,
    )
)
