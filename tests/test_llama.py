"""The Llama family (`models/llama.py`) against independent witnesses: Hugging Face's
published parameter counts, the complex-number form of rotary embeddings, multi-head
attention over repeated key/value heads, XLA's FLOP count, and one device's training
(resident over tensor x replica, pipelined, and phased with replicated tensor sharding)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_helpers import shardemu

from shardemu.accounting import flops
from shardemu.config import ConfigError, ModelConfig, PhasedConfig, SparsityConfig, TrainConfig
from shardemu.errors import ShardingError
from shardemu.models import Model, custom_model, get_preset
from shardemu.models.llama import Attention, rotary
from shardemu.parallel.mesh import make_mesh
from shardemu.parallel.rules import megatron_rules
from shardemu.phased.trainer import PhasedTrainer
from shardemu.pipelined.trainer import PipelinedTrainer
from shardemu.resident.trainer import Trainer

TINY = Model(get_preset("llama-tiny"))
TRAIN = TrainConfig(batch=8, seq=16, seed=0)
STEPS = 3


@pytest.mark.parametrize(
    ("name", "params"),
    [
        # `num_parameters()` of transformers' LlamaForCausalLM for each release
        ("llama2-7b", 6_738_415_616),
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
    ],
)
def test_presets_have_the_published_parameter_counts(name, params):
    shapes, _ = Model(get_preset(name)).abstract_params()
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == params


def test_rotary_is_a_complex_rotation_by_position():
    """Feature pair (i, i + k/2) of the head at position p, as the complex number
    x_i + j x_{i+k/2}, is multiplied by exp(j p theta^(-2i/k)) (Su et al. 2021, eq. 34)."""
    b, s, h, k, theta = 2, 5, 3, 8, 500000.0
    x = np.random.default_rng(0).normal(size=(b, s, h, k)).astype(np.float32)
    z = x[..., : k // 2] + 1j * x[..., k // 2 :]
    angle = np.arange(s)[:, None] * theta ** (-np.arange(0, k, 2) / k)[None]
    want = z * np.exp(1j * angle)[None, :, None]
    got = np.asarray(rotary(jnp.asarray(x), theta))
    np.testing.assert_allclose(got[..., : k // 2], want.real, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[..., k // 2 :], want.imag, rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_is_multi_head_over_repeated_key_value_heads():
    """Query head j reads key/value head j // (A / G): the module equals plain multi-head
    attention, written here head by head in NumPy, with K and V repeated per group."""
    cfg = get_preset("llama-tiny")
    heads, groups, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    x = np.random.default_rng(1).normal(size=(2, 6, cfg.embed_dim)).astype(np.float32)
    mask = np.tril(np.ones((1, 6, 6), dtype=bool))
    attn = Attention(cfg)
    params = jax.jit(attn.init)(jax.random.key(0), x, mask)
    got = np.asarray(attn.apply(params, x, mask))
    p = jax.tree.map(np.asarray, nn.meta.unbox(params["params"]))
    q = np.asarray(rotary(jnp.einsum("bsd,dhk->bshk", x, p["q_proj"]), cfg.rope_theta))
    key = np.asarray(rotary(jnp.einsum("bsd,dgk->bsgk", x, p["k_proj"]), cfg.rope_theta))
    value = np.einsum("bsd,dgk->bsgk", x, p["v_proj"])
    ctx = np.zeros_like(q)
    for j in range(heads):
        g = j // (heads // groups)
        scores = np.einsum("bqk,bsk->bqs", q[:, :, j], key[:, :, g]) / np.sqrt(k)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        ctx[:, :, j] = np.einsum(
            "bqs,bsk->bqk", probs / probs.sum(-1, keepdims=True), value[:, :, g]
        )
    want = np.einsum("bshk,hkd->bsd", ctx, p["o_proj"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_analytic_count_agrees_with_xla_within_1_percent(xla_training_flops):
    """One wide layer (XLA counts a scanned stack's body once): grouped K/V projections,
    three MLP matrices, the untied head. Wide enough that the matmuls dominate."""
    cfg = ModelConfig(
        "llama-wide", "llama", 8192, 1, 1024, 8, 2816, 256, num_kv_heads=2, rope_theta=5e5
    )
    model = Model(cfg)
    analytic = flops.training_step(model, 2, 128)
    assert abs(xla_training_flops(model, 2, 128) / analytic - 1) < 0.01


@pytest.fixture(scope="module")
def reference(single_device_reference):
    return single_device_reference(TINY, TRAIN, STEPS)


@pytest.mark.slow
def test_key_value_heads_tensor_does_not_divide_are_replicated_and_equal_one_device(
    reference, train_and_compare
):
    """tensor=8 splits the 8 query heads, one a device, but not the 4 key/value heads:
    the default rules replicate those (each device computes all four; test_activations.py
    holds the plan's memory to that), and the run equals one device. (tensor=2, which
    splits both alike, is the pipelined, phased and FP8 tests' layout.)"""
    trainer = Trainer(TINY, make_mesh(tensor=8), TRAIN)
    assert dict(trainer.rules)["kv_heads"] is None and dict(trainer.rules)["heads"] == "tensor"
    k_proj = trainer.param_shardings[TINY.stack_key]["self_attn"]["k_proj"].spec
    assert "tensor" not in jax.tree.leaves(tuple(k_proj))
    train_and_compare(trainer, reference)


@pytest.mark.slow
def test_todays_layouts_together_stay_within_fp8s_tolerance_and_are_planned(reference):
    """FP8 matmuls, ZeRO stage 3 and sequence parallelism at once on tensor=2 x
    replica=2, from the FP32 reference's initial weights rounded to BF16: every loss
    within FP8's stated tolerance (test_precision.py: 0.5%) of that one FP32 device. The
    same layout planned on an H100 with the tensor collectives chunked: FP8 dots,
    gradients reduce-scattered and layers gathered over replica, tensor all-gathers and
    reduce-scatters (each stage's memory is test_zero.py's)."""
    from test_precision import LOSS_RTOL

    from shardemu.data import SyntheticCorpus
    from shardemu.numerics.precision import as_compute
    from shardemu.predict.overlap import Overlap
    from shardemu.predict.plan_resident import plan_resident
    from shardemu.predict.profiles import PROFILES

    today = TrainConfig(batch=8, seq=16, seed=0, precision="fp8", zero=3, sequence_parallel=True)
    mesh = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    trainer = Trainer(TINY, mesh, today)
    params = jax.device_put(as_compute(reference["init"], trainer.model), trainer.param_shardings)
    opt_state = jax.jit(trainer.tx.init, out_shardings=trainer.opt_shardings)(params)
    corpus, metrics = SyntheticCorpus(TINY.cfg.vocab_size, seed=0), []
    for step in range(STEPS):
        out = trainer.step(params, opt_state, TINY.batch(corpus, step, 8, 16))
        params, opt_state = out.params, out.opt_state
        metrics.append(float(out.loss))
    np.testing.assert_allclose(metrics, reference["losses"], rtol=LOSS_RTOL)
    par, hw = trainer.par, PROFILES["h100-sxm"]
    planned = plan_resident(TINY, par, today, 4, hw, overlap=Overlap(tp_overlap="chunked"))
    events = planned.ledger.events
    ops = {(e.op, e.axis) for e in events if e.kind == "collective"}
    assert {("reduce-scatter", "replica"), ("all-gather", "replica")} <= ops
    assert {("reduce-scatter", "tensor"), ("all-gather", "tensor")} <= ops
    assert any(m.fp8 for e in events if e.kind == "compute" for m in e.matmuls)
    assert planned.report["kernel_fusion"] == "fused"  # an FP8 stack's (test_fp8.py)


@pytest.mark.slow
def test_pipelined_equals_one_device(reference, staged_like_reference):
    """1F1B over pipe=2 with context=2 x tensor=2 and sequence parallelism (Llama 3's
    pipelined long-context layout): the embedding on the first stage, the untied head
    on the last, each stage's sequences split over context (keys and values gathered)
    and its residual stream over context x tensor."""
    train = TrainConfig(
        batch=TRAIN.batch, seq=TRAIN.seq, seed=0, microbatches=2, sequence_parallel=True
    )
    trainer = PipelinedTrainer(TINY, make_mesh(2, 2, 1, context=2), train)
    staged_like_reference(trainer, trainer.place(reference["init"]), reference)
    context = {e.op for e in trainer.ledger.events if e.axis == "context"}
    assert {"all-gather", "reduce-scatter"} <= context


@pytest.mark.slow
def test_phased_with_rts_equals_one_device_and_its_plan(reference, staged_like_reference):
    """Two phases on tensor=2 x replica=2 x context=2, each replica storing half of every
    weight (rts 2) and gathering the rest before its phase runs, each sequence split
    over context; the update in the host tier. The same layout planned counts one stage
    on all its devices, each sequence split over context as the engine splits it: its
    step's ledger is the run's first step's, event kind by event kind (context
    parallelism's keys and values all-gathered)."""
    from shardemu.config import Parallelism
    from shardemu.predict.planning import plan
    from shardemu.predict.profiles import PROFILES

    cfg = PhasedConfig(phases=2, rts=2)
    trainer = PhasedTrainer(TINY, make_mesh(tensor=2, replica=2, context=2), TRAIN, cfg)
    staged_like_reference(trainer, trainer.init(reference["init"]), reference)
    par = Parallelism(tensor=2, replica=2, context=2)
    planned = plan(TINY, par, TRAIN, PROFILES["h100-sxm"], phased=cfg)

    def totals_by_kind(events):
        out = {}
        for e in events:
            if e.step == 0:
                key = (e.kind, e.axis, e.op)
                out[key] = out.get(key, 0) + (e.flops if e.kind == "compute" else e.bytes)
        return out

    got, want = totals_by_kind(planned.ledger.events), totals_by_kind(trainer.ledger.events)
    assert got == want
    assert ("collective", "context", "all-gather") in got


def test_settings_a_family_cannot_honour_are_refused():
    """Key/value heads on a family with one per query head, block sparsity on kernels it
    does not know, and rules that split key/value heads over a tensor size that does not
    divide them (the default replicates them instead)."""
    with pytest.raises(ConfigError, match="grouped-query attention"):
        custom_model("gpt", 2, 64, 8, None, 16, kv_heads=2)
    with pytest.raises(ConfigError, match="num_kv_heads=2, but the gpt family"):
        Model(get_preset("gpt-tiny").replace(num_kv_heads=2))
    sparse = TrainConfig(batch=8, seq=16, sparsity=SparsityConfig(0.5, block=4))
    with pytest.raises(ConfigError, match="block sparsity .* llama family"):
        Trainer(TINY, make_mesh(devices=jax.devices()[:1]), sparse)
    with pytest.raises(ShardingError, match="kv_heads.*not divisible by mesh axis .tensor.*None"):
        Trainer(TINY, make_mesh(tensor=8), TRAIN, rules=megatron_rules())


def test_command_line_plans_a_preset_and_builds_a_custom_llama():
    """`--model llama3-70b` planned at full size on tensor 8 x pipe 8; `--model llama`
    with grouped heads described; `--kv-heads` on GPT refused, naming the flag."""
    plan = shardemu(
        "plan", "--model", "llama3-70b", "--mesh", "pipe=8,tensor=8,replica=2", "--batch", "64",
        "--seq", "4096", "--microbatch-size", "1", "--hardware", "h100-sxm", "--json",
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert '"param_count": 70553706496' in plan.stdout
    described = shardemu(
        "describe", "--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "8",
        "--kv-heads", "2", "--mlp", "128", "--vocab", "256", "--mesh", "tensor=2", "--json",
    )  # fmt: skip
    assert described.returncode == 0, described.stderr
    assert '"k_proj"' in described.stdout or "k_proj" in described.stdout
    refused = shardemu("describe", "--model", "gpt", "--layers", "2", "--hidden", "64",
                       "--heads", "8", "--kv-heads", "2")  # fmt: skip
    assert refused.returncode == 2 and "--kv-heads 2 goes with grouped-query" in refused.stderr
