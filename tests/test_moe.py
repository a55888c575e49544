"""The mixture-of-experts family (`models/moe.py`) against independent witnesses: Hugging
Face's parameter count of Mixtral 8x7B, routing and the layer written token by token in
NumPy, the load-balancing loss in Hugging Face's form, XLA's FLOP count, one device's
training on every engine (expert parallelism on the resident one), and the all-to-alls
of expert parallelism against the hand formula."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import numpy as np
import pytest

import shardemu
from shardemu.accounting import flops
from shardemu.accounting.count import Counter
from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.models import Model, get_preset
from shardemu.models.moe import Experts, routing
from shardemu.parallel.mesh import make_mesh
from shardemu.phased.trainer import PhasedTrainer
from shardemu.pipelined.trainer import PipelinedTrainer
from shardemu.resident.trainer import Trainer

TINY = Model(get_preset("moe-tiny"))
TRAIN = TrainConfig(batch=8, seq=16, seed=0)
STEPS = 3


def test_mixtral_has_hugging_faces_parameter_count():
    """`num_parameters()` of transformers' MixtralForCausalLM for Mixtral-8x7B-v0.1."""
    assert shardemu.param_count(Model(get_preset("mixtral-8x7b")).abstract_params()[0]) == (
        46_702_792_704
    )


def numpy_layer(cfg: ModelConfig, p: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The expert layer token by token: each token's top-k experts, slots filled first
    choices first in sequence order, a choice past capacity dropped; the output, the
    load-balancing loss per sequence as Hugging Face writes it, the drops."""
    b, s, _ = x.shape
    e, k, cap = cfg.num_experts, cfg.experts_per_token, cfg.capacity(s)
    logits = x @ p["router"]["gate"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y, dropped, balance = np.zeros_like(x), 0, np.zeros(b)
    for i in range(b):
        order = np.argsort(-probs[i], axis=-1, kind="stable")[:, :k]  # [s, k]
        filled = np.zeros(e, int)
        for j in range(k):
            for t in range(s):
                expert = order[t, j]
                if filled[expert] >= cap:
                    dropped += 1
                    continue
                filled[expert] += 1
                top = probs[i, t, order[t]]
                gate = top[j] if k == 1 else top[j] / top.sum()
                h = x[i, t] @ p["w1"][expert]
                h = h / (1 + np.exp(-h)) * (x[i, t] @ p["w3"][expert])
                y[i, t] += gate * (h @ p["w2"][expert])
        # Hugging Face's load_balancing_loss_func over this sequence's tokens
        chosen = np.eye(e)[order]  # [s, k, e]
        balance[i] = e * np.sum(chosen.mean(0) * probs[i].mean(0)[None])
    return y, balance, dropped


@pytest.mark.parametrize("k, factor", [(2, 1.0), (1, 1.0), (2, 0.5), (2, 0.0)])
def test_the_layer_routes_as_written_token_by_token(k, factor):
    """Top-2 (renormalised gates) and top-1 (Switch's gate), at capacity factor 1, at
    0.5 (tokens dropped) and dropless (0): the output, the drops and the
    load-balancing loss equal the NumPy loop's."""
    cfg = TINY.cfg.replace(experts_per_token=k, capacity_factor=factor)
    x = np.random.default_rng(0).normal(size=(3, 12, cfg.embed_dim)).astype(np.float32)
    layer = Experts(cfg)
    params = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(1), x))["params"]
    p = jax.tree.map(np.asarray, params)
    got, balance_bs = jax.jit(layer.apply)({"params": params}, x)  # one program, not one an op
    want, balance, dropped = numpy_layer(cfg, p, x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(balance_bs).mean(1), balance, rtol=1e-5)
    stats = routing(cfg, params["router"], x)
    assert stats["dropped"] == dropped
    if factor == 0.5:  # half the slots k tokens need: some dropped
        assert dropped > 0
    if factor == 0:  # dropless
        assert dropped == 0
    assert sum(stats["tokens_per_expert"]) == x.shape[0] * x.shape[1] * k - dropped


def test_analytic_count_agrees_with_xla_within_1_percent(xla_training_flops):
    """One wide layer at capacity factor 1 (every slot filled: k s divisible by E): the
    router and the two active experts' three matrices, grouped K/V, the head."""
    cfg = ModelConfig(
        "moe-wide", "moe", 8192, 1, 1024, 8, 2048, 256, num_kv_heads=2, num_experts=4,
        experts_per_token=2, router_aux_loss_coef=0.01,
    )  # fmt: skip
    model = Model(cfg)
    analytic = flops.training_step(model, 2, 128)
    assert abs(xla_training_flops(model, 2, 128) / analytic - 1) < 0.01


@pytest.fixture(scope="module")
def reference(single_device_reference):
    return single_device_reference(TINY, TRAIN, STEPS)


@pytest.mark.parametrize("sizes", [{"tensor": 2, "replica": 2}, {"expert": 2, "replica": 2}])
def test_resident_equals_one_device(reference, train_and_compare, sizes):
    """Tensor parallel (the experts' MLP split over tensor), and expert parallel: the
    experts split over `expert`, the batch over replica x expert."""
    mesh = make_mesh(**sizes, devices=jax.devices()[:4])
    train_and_compare(Trainer(TINY, mesh, TRAIN), reference)


def test_pipelined_equals_one_device(reference, staged_like_reference):
    """Two microbatches over two stages: routing groups are sequences, and the
    load-balancing loss a per-token term, so splitting the batch changes neither."""
    train = dataclasses.replace(TRAIN, microbatches=2)
    trainer = PipelinedTrainer(TINY, make_mesh(2, 2, 1, devices=jax.devices()[:4]), train)
    staged_like_reference(trainer, trainer.place(reference["init"]), reference)


def test_phased_with_rts_equals_one_device(reference, staged_like_reference):
    mesh = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    trainer = PhasedTrainer(TINY, mesh, TRAIN, PhasedConfig(phases=2, rts=2))
    staged_like_reference(trainer, trainer.init(reference["init"]), reference)


@functools.cache  # read by two tests: counted once
def expert_parallel_events() -> list:
    """The ledger events of moe-tiny's step on expert 2 x replica 2."""
    mesh = make_mesh(expert=2, replica=2, devices=jax.devices()[:4])
    return Trainer(TINY, mesh, TRAIN).step_events(Counter(), 0)


def test_expert_parallel_all_to_alls_are_the_hand_formula():
    """Each layer sends its dispatched tokens to their experts and back, forward and
    backward: four all-to-alls over `expert`, each of tokens x k x d x 4 bytes (at
    capacity factor 1 the slots hold exactly k tokens each), a device sending
    (ep - 1) / ep of its share. Nothing else crosses `expert` but the gradients'
    reductions and the loss."""
    ep = 2
    events = expert_parallel_events()
    cfg = TINY.cfg
    tokens, k, d = TRAIN.batch * TRAIN.seq, cfg.experts_per_token, cfg.embed_dim
    per_direction = tokens * k * d * 4 * (ep - 1) / ep
    sent = sum(e.bytes for e in events if e.op == "all-to-all" and e.axis == "expert")
    assert sent == 4 * cfg.num_layers * per_direction
    assert not [e for e in events if e.op == "all-to-all" and e.axis != "expert"]


def test_settings_it_cannot_honour_are_refused():
    with pytest.raises(ConfigError, match="num_experts=4, but the llama family's MLP is dense"):
        Model(get_preset("llama-tiny").replace(num_experts=4, experts_per_token=1))
    with pytest.raises(ConfigError, match="experts_per_token=5 must be 1 to num_experts=4"):
        TINY.cfg.replace(experts_per_token=5)
    with pytest.raises(ConfigError, match="pipelined and phased engines run expert = 1"):
        PipelinedTrainer(TINY, make_mesh(pipe=2, expert=2, devices=jax.devices()[:4]), TRAIN)


def test_mixtral_is_planned_at_full_size():
    """Mixtral 8x7B on 64 H100s (pipe 4, tensor 8, replica 2, bf16): its 46.7B
    parameters; its model FLOPs (counted, within 1% of the analytic count) a dense
    Llama's of the same shape plus the second active expert's three matrices and the
    router, per token and layer, three times over (forward and backward)."""
    train = TrainConfig(batch=64, seq=4096, precision="bf16")
    planned = shardemu.plan(
        get_preset("mixtral-8x7b"), Parallelism(pipe=4, tensor=8, replica=2), train,
        shardemu.get_hardware("h100-sxm"), microbatch_size=1,
    )  # fmt: skip
    r = planned.report
    assert r["param_count"] == 46_702_792_704
    assert abs(r["model_flops_rel_err"]) < 0.01
    cfg = get_preset("mixtral-8x7b")
    dense = Model(cfg.replace(family="llama", num_experts=0, experts_per_token=0))
    t, d, f = 64 * 4096, cfg.embed_dim, cfg.mlp_dim
    extra = cfg.num_layers * (3 * 2 * t * d * f + 2 * t * d * cfg.num_experts)
    assert r["model_flops_analytic"] == flops.training_step(dense, 64, 4096) + 3 * extra
    assert math.isfinite(r["step_time_s"]) and r["step_time_s"] > 0


def test_a_plan_of_expert_parallelism_holds_the_runs_all_to_alls():
    """The resident plan of moe-tiny on replica 2 x expert 2 and the real step's ledger
    on the same mesh, two witnesses: the same all-to-all bytes over `expert`. Against
    replica 4 (the same devices, experts whole), the plan holds half of each layer's
    experts, reduces their gradients over replica alone and the rest over replica x
    expert; a phased plan refuses the axis."""
    hw = shardemu.get_hardware("h100-sxm")
    par = Parallelism(replica=2, expert=2)
    planned = shardemu.plan(TINY, par, TRAIN, hw, recompute="none")
    real = sum(e.bytes for e in expert_parallel_events() if e.op == "all-to-all")
    a2a = [e for e in planned.ledger.events if e.op == "all-to-all"]
    assert {e.axis for e in a2a} == {"expert"} and sum(e.bytes for e in a2a) == real
    flat = shardemu.plan(TINY, Parallelism(replica=4), TRAIN, hw, recompute="none")
    reduced: dict[str, dict[str, int]] = {"ep": {}, "flat": {}}
    for name, x in (("ep", planned), ("flat", flat)):
        for e in x.ledger.events:
            if e.op == "all-reduce":
                reduced[name][e.axis] = reduced[name].get(e.axis, 0) + e.bytes
    assert set(reduced["ep"]) == {"replica+expert", "replica"} and set(reduced["flat"]) == {
        "replica"
    }
    # FP32 gradients: the experts' X bytes and the rest's D (the shared weights too)
    shapes, logical = TINY.abstract_params()
    sizes = jax.tree.leaves(jax.tree.map(lambda a: 4 * a.size, shapes))
    names = jax.tree.leaves(logical, is_leaf=lambda a: isinstance(a, tuple))
    x = sum(n for n, axes in zip(sizes, names, strict=True) if "experts" in axes)
    d = sum(sizes) - x
    # 4 devices, each sending 2 (n-1)/n of what it reduces: D over all 4, X / 2 (its
    # experts' half) over its replica pair; without expert parallelism, D + X over 4
    assert reduced["ep"] == {"replica+expert": 6 * d, "replica": 4 * (x // 2)}
    assert reduced["flat"] == {"replica": 6 * (d + x)}
    memory = [x.report["memory_per_device"]["device"]["bytes"] for x in (planned, flat)]
    assert memory[0] < memory[1]
    with pytest.raises(ConfigError, match="phased plans of expert parallelism .* not built yet"):
        shardemu.plan(TINY, par, TRAIN, hw, phased=PhasedConfig())


def test_describe_prints_the_router_whose_expert_axis_has_no_name():
    """`describe`'s table prints an unnamed logical axis as "-", as its spec column does
    (the router's experts axis: the table raised a TypeError before, found by fuzzing
    the command line)."""
    from cli_helpers import shardemu as command

    out = command("describe", "--model", "moe-tiny")
    assert out.returncode == 0, out.stderr
    assert "router" in out.stdout
