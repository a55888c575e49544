"""Optimizers: AdamW and LAMB as optax chains, aware of stacked layers.

Weight decay applies to matrices and embeddings only (`kernel`, `embedding`), not to
biases or LayerNorm parameters, as in BERT's reference optimizer (Devlin et al. 2019,
`optimization.py`, `exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]`).

LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2) scales
each layer's update by ||w|| / ||u||. Our transformer layers are stacked on a leading
`layers` axis, so the ratio is taken per layer slice of those leaves, matching what the
algorithm does on unstacked weights; `optax.lamb` would take one ratio per leaf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from shardemu.config import TrainConfig
from shardemu.numerics.precision import to_fp32

_DECAYED = ("kernel", "embedding")


def decay_mask(params: object) -> object:
    """True for leaves that take weight decay."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in _DECAYED, params
    )


def scale_by_layerwise_trust_ratio(stacked: object) -> optax.GradientTransformation:
    """LAMB's trust ratio; `stacked` marks leaves whose axis 0 is `layers`."""

    def update(updates, state, params):
        if params is None:
            raise ValueError("scale_by_layerwise_trust_ratio needs params in update()")

        def one(u: jax.Array, p: jax.Array, is_stacked: bool) -> jax.Array:
            axes = tuple(range(1, u.ndim)) if is_stacked else None
            p_norm = jnp.sqrt(jnp.sum(jnp.square(p), axis=axes, keepdims=True))
            u_norm = jnp.sqrt(jnp.sum(jnp.square(u), axis=axes, keepdims=True))
            ratio = jnp.where((p_norm == 0) | (u_norm == 0), 1.0, p_norm / u_norm)
            return (u * ratio).astype(u.dtype)

        return jax.tree.map(one, updates, params, stacked), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def learning_rate(cfg: TrainConfig) -> optax.ScalarOrSchedule:
    """A linear warm-up from 0 over `warmup_steps`, then the constant peak rate."""
    if cfg.warmup_steps:
        return optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return cfg.learning_rate


def learning_rate_at(cfg: TrainConfig, step: int) -> float:
    """The rate step `step` (from 0) applies: optax counts updates from 0."""
    lr = learning_rate(cfg)
    return float(lr(step)) if callable(lr) else float(lr)


def make_optimizer(
    cfg: TrainConfig, params: object, logical: object, clip: bool = True
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW or LAMB with a linear warm-up to a constant rate.

    `params` (arrays or shapes) and `logical` (their logical axes) fix the tree structure
    for the weight-decay mask and LAMB's per-layer trust ratio. `clip=False` leaves out
    the clipping, for engines that update in pieces and clip with `clip_by_norm`."""
    lr = learning_rate(cfg)
    mask = decay_mask(params)
    if cfg.optimizer == "adamw":
        opt = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay, mask=mask)
    else:
        stacked = jax.tree.map(
            lambda axes: bool(axes) and axes[0] == "layers",
            logical,
            is_leaf=lambda x: isinstance(x, tuple),
        )
        opt = optax.chain(
            optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-6),
            optax.add_decayed_weights(cfg.weight_decay, mask),
            scale_by_layerwise_trust_ratio(stacked),
            optax.scale_by_learning_rate(lr),
        )
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt) if clip else opt


def squared_norm(grads: object) -> jax.Array:
    """The squared global norm, summed in FP32: 16-bit squares overflow (float16 above
    256) long before the gradients do."""
    return optax.tree.norm(to_fp32(grads), squared=True)


def clip_by_norm(grads: object, global_norm: jax.Array, max_norm: float) -> object:
    """`optax.clip_by_global_norm` with the norm of *all* gradients given: the same
    arithmetic, for engines that hold only part of the gradients at a time."""
    return jax.tree.map(
        lambda g: jnp.where(
            global_norm < max_norm, g, (g / global_norm.astype(g.dtype)) * max_norm
        ),
        grads,
    )
