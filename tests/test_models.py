"""GPT and BERT: exact reference parameter counts, abstract description of huge presets,
and the two masks (causal, padding) checked by perturbing what they hide."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardemu.models import Model, get_preset, param_bytes, param_count

# Reference counts: Hugging Face GPT2Model / BertForPreTraining with the same configs.
EXACT = {"gpt2-small": 124_439_808, "bert-base": 110_106_428, "bert-large": 336_226_108}


@pytest.mark.parametrize(("name", "count"), sorted(EXACT.items()))
def test_parameter_count_matches_reference(name, count):
    shapes, _ = Model(get_preset(name)).abstract_params()
    assert param_count(shapes) == count
    assert param_bytes(shapes) == 4 * count


def test_gpt3_175b_is_described_without_allocating():
    start = time.perf_counter()
    shapes, logical = Model(get_preset("gpt3-175b")).abstract_params()
    assert time.perf_counter() - start < 30  # a generous bound: it takes well under 1 s
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    # Brown et al. 2020 report 175.0B; with d=12288, L=96, V=50257, n_ctx=2048 the
    # model is 12 L d^2 + 13 L d + (V + n_ctx) d + 2 d.
    d, layers, v, ctx = 12288, 96, 50257, 2048
    assert param_count(shapes) == 12 * layers * d * d + 13 * layers * d + (v + ctx) * d + 2 * d
    assert round(param_count(shapes) / 1e9, 1) == 174.6
    assert logical["blocks"]["mlp"]["fc_in"]["kernel"] == ("layers", "embed", "mlp")


def test_every_parameter_has_logical_axes_of_its_rank(tiny_model):
    shapes, logical = tiny_model.abstract_params()
    flat_axes = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    for shape, axes in zip(jax.tree.leaves(shapes), flat_axes, strict=True):
        assert len(axes) == len(shape.shape) and all(isinstance(a, str) for a in axes)


@pytest.fixture(scope="module")
def gpt():
    model = Model(get_preset("gpt-tiny"))
    return model, jax.jit(model.init_params)(jax.random.key(0))


def test_gpt_is_causal(gpt):
    model, params = gpt
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 4, 512)
    changed = tokens.at[:, 10:].set(7)
    apply = jax.jit(model.module.apply)  # one compile, not one per operation
    a = apply({"params": params}, tokens)
    b = apply({"params": params}, changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])  # the past never sees the future
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_gpt_output_is_tied_to_the_input_embedding(gpt):
    model, params = gpt
    assert "lm_head" not in params and set(params) == {"wte", "wpe", "blocks", "ln_f"}
    hidden = jnp.ones((1, 1, 64))
    logits = hidden @ params["wte"]["embedding"].T
    assert logits.shape == (1, 1, model.cfg.vocab_size)


def test_bert_ignores_padding():
    model = Model(get_preset("bert-tiny"))
    params = jax.jit(model.init_params)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 4, 512)
    segments = jnp.zeros_like(tokens)
    mask = jnp.ones_like(tokens).at[:, 12:].set(0)
    every = jnp.broadcast_to(jnp.arange(16), (2, 16))  # the masked-LM head at every position

    jitted = jax.jit(model.module.apply)  # one compile, not one per operation

    def apply(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jitted({"params": params}, tokens, segments, mask, every)

    mlm_a, nsp_a = apply(tokens)
    mlm_b, nsp_b = apply(tokens.at[:, 12:].set(9))
    np.testing.assert_allclose(mlm_a[:, :12], mlm_b[:, :12], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(nsp_a, nsp_b, rtol=1e-6, atol=1e-6)
    # ... while a visible token does change the others (attention is bidirectional).
    mlm_c, _ = apply(tokens.at[:, 11].set(9))
    assert not np.allclose(mlm_a[:, :11], mlm_c[:, :11])
    assert mlm_a.shape == (2, 16, 512) and nsp_a.shape == (2, 2)


def test_bert_predicts_at_the_masked_positions_what_it_would_at_every_one():
    """The masked-LM head gathers the masked positions first: its logits there are the
    all-position head's logits at those positions, and the loss reads only them."""
    model = Model(get_preset("bert-tiny"))
    params = jax.jit(model.init_params)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 4, 512)
    segments, mask = jnp.zeros_like(tokens), jnp.ones_like(tokens)
    every = jnp.broadcast_to(jnp.arange(16), (2, 16))
    positions = jnp.array([[1, 5, 9], [0, 2, 15]])
    apply = jax.jit(model.module.apply)
    mlm_all, nsp_all = apply({"params": params}, tokens, segments, mask, every)
    mlm, nsp = apply({"params": params}, tokens, segments, mask, positions)
    assert mlm.shape == (2, 3, 512)
    gathered = jnp.take_along_axis(mlm_all, positions[..., None], axis=1)
    np.testing.assert_allclose(mlm, gathered, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nsp, nsp_all, rtol=1e-6, atol=1e-6)
