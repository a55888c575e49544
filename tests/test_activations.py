"""Activation memory as the target keeps it (`predict/activations.py`): the layer's
saved tensors, summed, against Korthikanti et al. 2022's closed forms (Table 2), and a
resident plan reporting it beside the CPU compile's count."""

import itertools
import json
from pathlib import Path

import pytest

import shardemu
from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.models import Model, custom_model, get_preset
from shardemu.predict.activations import korthikanti, layer_bytes, saved_tensors


@pytest.mark.parametrize("name", ["gpt3-1.3b", "gpt3-13b", "gpt3-175b"])
def test_a_gpt_layer_tensor_by_tensor_is_korthikantis_table_2(name):
    """16-bit activations with dropout, as the paper counts them: no parallelism,
    tensor parallel, tensor and sequence parallel, each without recomputation and with
    selective recomputation, and full recomputation; at three widths."""
    model = Model(get_preset(name))
    cfg, s, b = model.cfg, 2048, 1
    for t, sp, rec in itertools.product((1, 8), (False, True), ("none", "selective")):
        ours = layer_bytes(model, b, s, 2, t, sp, rec, dropout=True)
        theirs = korthikanti(s, b, cfg.embed_dim, cfg.num_heads, t, sp, rec)
        assert ours == pytest.approx(theirs, rel=1e-12), (t, sp, rec)
    full = layer_bytes(model, b, s, 2, 8, recompute="full", dropout=True)
    assert full == korthikanti(s, b, cfg.embed_dim, cfg.num_heads, 8, recompute="full")


def test_without_dropout_and_with_a_gated_mlp():
    """shardemu's layers have no dropout: 32 sbh + 2 a s^2 b at 16 bits (Table 2 less
    the three masks and the dropout's output); 7 sbh less in FP8. Llama's gated MLP
    keeps three [s, b, f] tensors for GPT's two, and grouped-query attention K and V at
    G / A of the width."""
    gpt = Model(get_preset("gpt3-1.3b"))
    cfg, s, b = gpt.cfg, 1024, 2
    sbh, scores = s * b * cfg.embed_dim, cfg.num_heads * s * s * b
    assert layer_bytes(gpt, b, s, 2) == 32 * sbh + 2 * scores
    # FP8: the QKV, projection, MLP (sbh each) and second matmul (4 sbh) inputs kept at
    # one byte an element, as Transformer Engine keeps their FP8 casts
    fp8 = gpt.replace(param_dtype="bfloat16", fp8_matmuls=True)
    assert layer_bytes(fp8, b, s, 2) == (32 - 7) * sbh + 2 * scores
    llama = Model(get_preset("llama3-8b"))
    lc = llama.cfg
    sbh, sbf = s * b * lc.embed_dim, s * b * lc.mlp_dim
    kv = s * b * lc.kv_heads * lc.head_dim
    want = 2 * (6 * sbh + 2 * kv + 3 * sbf) + 2 * lc.num_heads * s * s * b
    assert layer_bytes(llama, b, s, 2) == want
    names = [t.name for t in saved_tensors(llama, b, s, 2)]
    assert "gate output" in names and "activation input" not in names
    # 8 key/value heads on tensor 16: replicated, K and V whole on every device, with
    # sequence parallelism too; everything else as when they split
    for sp in (False, True):
        split = layer_bytes(llama, b, s, 2, 16, sp)
        replicated = layer_bytes(llama, b, s, 2, 16, sp, kv_split=False)
        assert replicated - split == pytest.approx(2 * 2 * kv * (1 - 1 / 16))


def test_a_resident_plan_reports_both_witnesses_and_holds_the_targets():
    """The CPU compile keeps more than the target does (its fusions keep intermediates
    a GPU kernel does not); with full recomputation both keep the layer's input alone,
    exactly (the plan's memory holds the target's: test_zero.py's formula)."""
    model = custom_model("gpt", 2, 128, 4, 256, 64)
    hw, par = shardemu.get_hardware("a100-80gb"), Parallelism(tensor=2)
    train = TrainConfig(batch=2, seq=64, precision="bf16")
    kept = {
        rec: shardemu.plan(model, par, train, hw, recompute=rec).report[
            "activation_bytes_per_layer"
        ]
        for rec in ("none", "full")
    }
    assert kept["none"]["counted"] > kept["none"]["target"] > 0
    assert kept["full"]["counted"] == kept["full"]["target"] == 2 * 64 * 128 * 2


def test_a_sequence_parallel_plan_splits_what_the_target_keeps():
    """`TrainConfig.sequence_parallel` reaches the resident planner (it was planned as
    if off): the layer norms' and the column-parallel matmuls' inputs split over
    tensor too, Korthikanti's sbh (34 / t + 5 a s / (h t)) less dropout's terms; a
    sequence the tensor size does not divide is refused."""
    model = custom_model("gpt", 2, 128, 4, 256, 64)
    hw, par = shardemu.get_hardware("a100-80gb"), Parallelism(tensor=2)
    train = TrainConfig(batch=2, seq=64, precision="bf16", sequence_parallel=True)
    kept = shardemu.plan(model, par, train, hw, recompute="none").report[
        "activation_bytes_per_layer"
    ]
    s, b, h, a, t = 64, 2, 128, 4, 2
    assert kept["target"] == s * b * h * (32 / t + 2 * a * s / (h * t))
    odd = TrainConfig(batch=2, seq=63, precision="bf16", sequence_parallel=True)
    with pytest.raises(ConfigError, match="does not divide TrainConfig.seq 63"):
        shardemu.plan(model, par, odd, hw, recompute="none")


def test_a_mixture_of_experts_keeps_its_slots():
    """moe-tiny: the attention's tensors as Llama's, and the MLP's over the E x C slots
    of each sequence (capacity factor 1, top 2: C = 2 s / E), with the router's FP32
    probabilities, the dispatched tokens and the experts' outputs."""
    model = Model(get_preset("moe-tiny"))
    cfg, s, b, p = model.cfg, 16, 2, 2
    sbh, slots = s * b * cfg.embed_dim, b * cfg.num_experts * cfg.capacity(s)
    kv = s * b * cfg.kv_heads * cfg.head_dim
    attention = p * (6 * sbh + 2 * kv) + p * cfg.num_heads * s * s * b
    mlp = 4 * s * b * cfg.num_experts + p * slots * (2 * cfg.embed_dim + 3 * cfg.mlp_dim)
    assert cfg.capacity(s) == 2 * s // cfg.num_experts
    assert layer_bytes(model, b, s, p) == attention + mlp


MEASURED = Path(__file__).parent.parent / "benchmarks" / "measured" / "torch_layer_memory.json"


def test_a_pytorch_layer_on_an_h200_keeps_what_the_model_says():
    """The second witness against a measured one: a Megatron-style GPT layer in PyTorch
    (BF16, dropout 0.1, `benchmarks/torch_layer_memory.py`) kept, per layer, what the
    CUDA caching allocator held after its forward on an NVIDIA H200, at three widths and
    two batches, with the attention core unfused and as FlashAttention
    (`scaled_dot_product_attention`). The unfused layer also keeps its s x s causal
    mask (one byte an element), which Megatron-LM's fused masked softmax does not; what
    is left, 16 bytes a token, is the layer norms' float32 statistics, which the
    model leaves out (under 0.05%)."""
    measured = json.loads(MEASURED.read_text())
    assert measured["device"] == "NVIDIA H200" and len(measured["rows"]) == 12
    for row in measured["rows"]:
        s, b, flash = row["seq"], row["batch"], row["core"] == "sdpa"
        model = Model(custom_model("gpt", 1, row["hidden"], row["heads"], None, s))
        ours = layer_bytes(model, b, s, 2, dropout=True, fused_attention=flash)
        ours += 0 if flash else s * s
        assert row["per_layer"]["allocated"] == pytest.approx(ours + 16 * s * b, rel=1e-4), row


def test_torchtitans_selective_op_keeps_every_other_projection_and_recomputes_the_rest():
    """TorchTitan's selective-op checkpointing, by hand: a layer keeps its input, the
    fused core's output and its float32 log-sum-exp, and the outputs of the 1st, 3rd,
    ... projection matmuls. Llama's seven (Q, K, V, output, gate, up, down) alternate
    between two saved sets from step to step, so the fuller one (Q, V, gate, down) sets
    the memory and the plan recomputes, on average, half of its projections' FLOPs
    (K, output, up in one step; Q, V, gate, down in the next). GPT's six keep Q, V and
    the MLP's first output in every step."""
    s, b = 1024, 2
    llama = Model(get_preset("llama3-8b"))
    lc = llama.cfg
    sbh, sbf, kv = s * b * lc.embed_dim, s * b * lc.mlp_dim, s * b * lc.kv_heads * lc.head_dim
    lse = b * lc.num_heads * s * 4
    want = 2 * (sbh + sbh) + lse + 2 * max(sbh + kv + sbf + sbh, kv + sbh + sbf)
    assert layer_bytes(llama, b, s, 2, recompute="selective-op") == want
    gpt = Model(get_preset("gpt3-1.3b"))
    sbh, sbf = s * b * gpt.cfg.embed_dim, s * b * gpt.cfg.mlp_dim
    lse = b * gpt.cfg.num_heads * s * 4
    assert (
        layer_bytes(gpt, b, s, 2, recompute="selective-op")
        == 2 * (sbh + sbh + sbh + sbh + sbf) + lse
    )

    model = custom_model("llama", 2, 128, 4, 256, 64, kv_heads=2, mlp=384)
    hw, par = shardemu.get_hardware("a100-80gb"), Parallelism(tensor=2)
    train = TrainConfig(batch=2, seq=64, precision="bf16")
    plans = {
        rec: shardemu.plan(model, par, train, hw, recompute=rec, attention="fused").report
        for rec in ("none", "selective-op")
    }
    tokens, d, f, g = 2 * 64, 128, 384, 2 * 32
    projections = {"Q": (d, d), "K": (d, g), "V": (d, g), "output": (d, d),
                   "gate": (d, f), "up": (d, f), "down": (f, d)}  # fmt: skip
    half = sum(2 * tokens * i * o for i, o in projections.values()) / 2
    extra = plans["selective-op"]["flops"] - plans["none"]["flops"]
    assert extra == pytest.approx(2 * half, rel=1e-9)  # 2 layers; the step's, all devices
    kept = plans["selective-op"]["activation_bytes_per_layer"]
    assert kept["counted"] is None  # the CPU compile has no witness of this policy
    assert kept["target"] == layer_bytes(Model(model), 2, 64, 2, 2, recompute="selective-op")
    with pytest.raises(ConfigError, match="plan it with `attention` 'fused'"):
        shardemu.plan(model, par, train, hw, recompute="selective-op")
    moe = Model(get_preset("moe-tiny"))
    with pytest.raises(ConfigError, match="TorchTitan's policy for dense layers"):
        layer_bytes(moe, 2, 64, 2, recompute="selective-op")


def test_the_loss_working_set_is_every_positions_logits_four_times():
    """The head and loss at their peak hold, for each position with a loss, its logits
    in the activations' dtype, an FP32 copy, the FP32 log-softmax and its FP32 gradient
    (14 bytes a vocabulary entry in BF16, 12 in FP32, where the copy is the logits),
    the vocabulary split over tensor and the positions over context; BERT's loss is at
    its masked positions only. (test_zero.py holds a plan's bytes to Rajbhandari et
    al.'s with this term.)"""
    from shardemu.predict.activations import loss_bytes

    llama = Model(get_preset("llama3-8b"))
    vocab = llama.cfg.vocab_size
    assert loss_bytes(llama, 2, 8192, 2) == 2 * 8192 * vocab * 14
    assert loss_bytes(llama, 2, 8192, 2, tensor=8, context=2) == 2 * 8192 * vocab * 14 / 16
    assert loss_bytes(llama, 2, 8192, 4) == 2 * 8192 * vocab * 12
    bert = Model(get_preset("bert-large"))
    masked = bert.cfg.predictions(128)
    assert loss_bytes(bert, 4, 128, 2) == 4 * masked * bert.cfg.vocab_size * 14
