"""ZeRO (`TrainConfig.zero`) over `replica` (Rajbhandari et al. 2020). Stage 1, the
optimizer state and FP32 master weights split (P_os), on the resident engine and in
resident plans: equal to one device, the state a device holds halved, the updated
weights all-gathered in the ledger as the hand formula says, and a plan's memory
Rajbhandari's 2 Psi + 2 Psi + 12 Psi / N_d. Stages 2 (+ gradients, P_os+g) and 3 (+
weights, P_os+g+p: FSDP) on the resident engine: equal to one device, the gradients
reduce-scattered, the weights stored split and all-gathered; and in plans, each
stage's memory and collectives as Table 1 and the ring formulas say. Stages 1 to 3 on
the pipelined engine (the staged pieces' rts', gradient split and rts), equal to one
device."""

import dataclasses

import jax
import pytest

import shardemu
from shardemu.accounting.count import Counter, with_shardings
from shardemu.accounting.sizes import bytes_per_device
from shardemu.config import ConfigError, Parallelism, PhasedConfig, TrainConfig
from shardemu.models import Model, custom_model, get_preset
from shardemu.parallel.mesh import make_mesh
from shardemu.pipelined.trainer import PipelinedTrainer
from shardemu.predict.overlap import Overlap
from shardemu.resident.trainer import Trainer

TINY = Model(get_preset("gpt-tiny"))
TRAIN = TrainConfig(batch=8, seq=16, seed=0, zero=1)


@pytest.fixture(scope="module")
def reference(single_device_reference):
    return single_device_reference(TINY, TRAIN, 3)


def test_zero_1_equals_one_device_with_half_the_state(reference, train_and_compare):
    """tensor 2 x replica 2: every loss, the first gradients and the final weights as
    one device's; each device holds half the optimizer state it holds without ZeRO; the
    ledger all-gathers the updated (FP32) weights over replica: each of the 4 devices
    sends (2 - 1) / 2 of its weights' bytes."""
    mesh = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    trainer = Trainer(TINY, mesh, TRAIN)
    train_and_compare(trainer, reference)

    def state_bytes(t: Trainer) -> int:
        return bytes_per_device(
            with_shardings(jax.eval_shape(t.tx.init, t.param_shapes), t.opt_shardings)
        )

    plain = Trainer(TINY, mesh, dataclasses.replace(TRAIN, zero=0))
    assert state_bytes(trainer) == pytest.approx(state_bytes(plain) / 2, rel=1e-4)
    weights = bytes_per_device(with_shardings(trainer.param_shapes, trainer.param_shardings))
    gathered = [e for e in trainer.step_events(Counter(), 0) if e.op == "all-gather"]
    assert [(e.axis, e.bytes) for e in gathered] == [("replica", 4 * weights // 2)]
    assert not [e for e in plain.step_events(Counter(), 0) if e.op == "all-gather"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_plan_holds_rajbhandaris_memory(stage):
    """bf16 with FP32 Adam (K = 12 bytes a parameter), one microbatch a replica, on 4
    replicas (Rajbhandari et al. 2020, Table 1), within 1%, beside the layers'
    activations (the report's): weights 2 Psi, gradients 2 Psi (stages 2 and 3: 2 Psi /
    4), optimizer state 12 Psi / 4; stage 3 also the layers' weights 2 Psi_L / 4, and
    two layers gathered whole (FSDP's computing and prefetched), and the shared weights
    (Psi_S) split too, 2 Psi_S / 4, with what the head reads (the tied token embedding
    and the final layer norm: Psi_H) gathered whole at the head, and its gradient, 2
    Psi_H each; beside the activations, the larger of the loss's working set and (stage 3)
    a layer's reduce-scatter: its whole gradient, 2 Psi_L / L, and what FSDP2's
    reduce-scatter input holds beyond the layer's gathered weights it frees first (in
    FP32: 4 Psi_L / L less 2 Psi_L / L; `resident_memory._reduce_scatter`), less what the
    layer kept for its backward, freed by then.
    Collectives a device sends over replica: the gradients'
    reduce-scatter, (3/4) 2 Psi (Megatron-LM's distributed optimizer, at stage 1 too);
    the updated weights' all-gather (3/4) 2 Psi (stage 3: what the embedding reads, the
    token and position embeddings, and what the head reads, before the forward; each
    layer's for the forward and again for the backward, each but the first of a slot
    starting while the layer before it computes)."""
    model = custom_model("gpt", 4, 256, 4, 1024, 128)
    shapes = Model(model).abstract_params()[0]
    psi = shardemu.param_count(shapes)
    psi_l = shardemu.param_count(shapes[Model(model).stack_key])
    train = TrainConfig(batch=4, seq=128, precision="bf16", zero=stage)
    hw = shardemu.get_hardware("a100-80gb")
    planned = shardemu.plan(model, Parallelism(replica=4), train, hw, recompute="full")
    r = planned.report
    activations = r["activation_bytes_per_layer"]["target"] * model.num_layers
    held = r["memory_per_device"]["device"]["bytes"] - activations
    # the loss's working set at the head: 128 positions x 1024 logits in BF16, an FP32
    # copy, log-softmax and gradient (activations.loss_bytes)
    loss = 128 * 1024 * (2 + 12)
    psi_layer = psi_l / model.num_layers

    def reduce_scatter(width: int) -> float:  # a reduction `width` bytes an element,
        # after the layer's backward has freed what it kept
        scatter = 2 * psi_layer + max(0, (width - 2) * psi_layer) - activations / 4
        return scatter if stage == 3 else 0

    psi_s, d = psi - psi_l, 256
    psi_e, psi_h = 1024 * d + 2048 * d, 1024 * d + 2 * d  # wte and wpe (2048 positions); wte, ln_f
    weights = 2 * psi if stage < 3 else 2 * psi_s / 4 + 2 * psi_h + 2 * psi_l / 4 + 4 * psi_l / 4
    grads = 2 * psi / (4 if stage >= 2 else 1) + (2 * psi_h if stage == 3 else 0)
    state = weights + grads + 12 * psi / 4
    assert held == pytest.approx(state + max(loss, reduce_scatter(2)), rel=0.01)
    if stage == 3:  # reduced in FP32 (TorchTitan's default): the input 4 bytes an element
        fp32 = Overlap(grad_reduce_in_fp32=True)
        wider = shardemu.plan(
            model, Parallelism(replica=4), train, hw, recompute="full", overlap=fp32
        ).report["memory_per_device"]["device"]["bytes"]
        assert wider - activations == pytest.approx(state + max(loss, reduce_scatter(4)), rel=0.01)
    gathered = sum(e.bytes for e in planned.ledger.events if e.op == "all-gather")
    gathers = 2 * psi if stage < 3 else 2 * (psi_e + psi_h) + 2 * 2 * psi_l
    assert gathered == pytest.approx(gathers * 3 / 4 * 4, rel=0.01)
    if stage == 3:  # FSDP's prefetch: each layer's gather runs while the one before computes
        spans = sorted(planned.timeline.spans, key=lambda sp: sp.index)
        for i, sp in enumerate(spans):
            if sp.event.op == "all-gather" and sp.event.phase.kind in ("forward", "backward"):
                before = [c for c in spans[:i] if c.stream == "compute"]
                assert not before or sp.start < before[-1].end, (sp, before[-1])
    op, factor = ("reduce-scatter", 1)  # at every stage: Megatron's distributed optimizer
    reduced = [e for e in planned.ledger.events if e.axis == "replica" and e.carries == "gradients"]
    assert {e.op for e in reduced} == {op}
    assert sum(e.bytes for e in reduced) == pytest.approx(factor * 2 * psi * 3 / 4 * 4, rel=0.01)


@pytest.mark.slow
def test_zero_2_and_3_equal_one_device_and_reduce_scatter_the_gradients(
    reference, train_and_compare
):
    """tensor 2 x replica 2. Stage 2: the gradients' reduction over replica is a
    reduce-scatter: of the ring's (2 - 1) / 2 of the FP32 gradients a device sends (the
    hand formula), XLA's CPU pipeline sends at least 90% so (the rest it reshards with an
    all-to-all or reduces whole), and all of it is about half an all-reduce's 2 (2 - 1) /
    2. Stage 3: also each device's weights halved, and all-gathered over replica."""
    mesh = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    weights = None
    for stage in (2, 3):
        trainer = Trainer(TINY, mesh, dataclasses.replace(TRAIN, zero=stage))
        train_and_compare(trainer, reference)
        held = bytes_per_device(with_shardings(trainer.param_shapes, trainer.param_shardings))
        weights = weights or held  # stage 2 stores them whole
        events = trainer.step_events(Counter(), 0)
        over = {op: sum(e.bytes for e in events if e.axis == "replica" and e.op == op)
                for op in ("reduce-scatter", "all-reduce", "all-to-all", "all-gather")}  # fmt: skip
        ring = (2 - 1) / 2 * weights * 4  # each of 4 devices, its gradients once
        assert 0.9 * ring <= over["reduce-scatter"] <= ring, over
        assert over["reduce-scatter"] + over["all-reduce"] + over["all-to-all"] < 0.55 * 2 * ring
        assert over["all-gather"] > 0
        if stage == 3:
            assert held == pytest.approx(weights / 2, rel=1e-3)


@pytest.mark.slow
def test_the_pipelined_engine_runs_stages_2_and_3_equal_to_one_device(
    reference, staged_like_reference
):
    """pipe 2 x replica 2, two microbatches: stage 2 holds half the optimizer state a
    device, reduce-scatters the gradients into each replica's share and all-gathers the
    updated weights over replica (stage 1 is the same without the reduce-scatter);
    stage 3 (FSDP) also holds half the weights, gathered inside each piece; both as one
    device, every loss and the final weights."""
    mesh = make_mesh(pipe=2, replica=2, devices=jax.devices()[:4])
    plain = PipelinedTrainer(TINY, mesh, dataclasses.replace(TRAIN, zero=0, microbatches=2))
    weights, state = plain.sizes().values()
    # stage: (weight bytes a device, the collectives over replica that show it)
    expected = {
        2: (weights, {("backward", "reduce-scatter"), ("update", "all-gather")}),
        3: (weights / 2, {("backward", "reduce-scatter"), ("forward", "all-gather")}),
    }
    for stage, (held, collectives) in expected.items():
        train = dataclasses.replace(TRAIN, zero=stage, microbatches=2)
        trainer = PipelinedTrainer(TINY, mesh, train)
        staged_like_reference(trainer, trainer.place(reference["init"]), reference)
        got = trainer.sizes()
        assert got["opt_state_bytes_per_device"] == pytest.approx(state / 2, rel=1e-4)
        assert got["param_bytes_per_device"] == pytest.approx(held, rel=1e-3)
        ops = {(e.phase.kind, e.op) for e in trainer.ledger.events if e.axis == "replica"}
        assert collectives <= ops
        assert ("backward", "all-reduce") not in ops  # the gradients: reduce-scattered


def test_what_zero_does_not_cover_is_refused():
    with pytest.raises(ConfigError, match="TrainConfig.zero must be 0, 1, 2 or 3, got 4"):
        TrainConfig(zero=4)
    with pytest.raises(ConfigError, match="rts_opt"):
        shardemu.plan(TINY.cfg, Parallelism(replica=2), TRAIN, shardemu.get_hardware("cs2"),
                      phased=PhasedConfig())  # fmt: skip
