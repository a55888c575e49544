"""LAMB's trust ratio is per layer even though layers are stacked: the stacked update
must equal optax.lamb applied to each layer's weights as separate leaves."""

import chex
import jax
import jax.numpy as jnp
import optax

from shardemu.config import TrainConfig
from shardemu.numerics.optim import decay_mask, make_optimizer


def test_lamb_on_stacked_layers_equals_lamb_per_layer():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "blocks": {"kernel": jax.random.normal(keys[0], (3, 4, 5))},
        "head": {"kernel": jax.random.normal(keys[1], (5, 2))},
    }
    grads = {
        "blocks": {
            "kernel": jax.random.normal(keys[2], (3, 4, 5)) * jnp.arange(1, 4)[:, None, None]
        },
        "head": {"kernel": jax.random.normal(keys[3], (5, 2))},
    }
    logical = {
        "blocks": {"kernel": ("layers", "embed", "mlp")},
        "head": {"kernel": ("embed", "classes")},
    }
    cfg = TrainConfig(optimizer="lamb", learning_rate=0.1, weight_decay=0.01, grad_clip=1e9)
    tx = make_optimizer(cfg, params, logical)
    ours, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)

    def unstack(tree):
        return {
            **{f"layer{i}": tree["blocks"]["kernel"][i] for i in range(3)},
            "head": tree["head"]["kernel"],
        }

    ref_tx = optax.lamb(0.1, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01)
    flat_p, flat_g = unstack(params), unstack(grads)
    ref, _ = jax.jit(ref_tx.update)(flat_g, jax.jit(ref_tx.init)(flat_p), flat_p)
    chex.assert_trees_all_close(unstack(ours), ref, rtol=1e-6, atol=1e-7)
    # and one ratio per leaf (plain optax.lamb on the stack) would be different:
    whole, _ = ref_tx.update(grads, ref_tx.init(params), params)
    assert not jnp.allclose(whole["blocks"]["kernel"], ours["blocks"]["kernel"], rtol=1e-3)


def test_weight_decay_skips_biases_and_layer_norms():
    params = {
        "fc": {"kernel": 0, "bias": 0},
        "ln": {"scale": 0, "bias": 0},
        "wte": {"embedding": 0},
    }
    assert decay_mask(params) == {
        "fc": {"kernel": True, "bias": False},
        "ln": {"scale": False, "bias": False},
        "wte": {"embedding": True},
    }
