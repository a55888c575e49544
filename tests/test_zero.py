"""ZeRO stage 1 (`TrainConfig.zero`): the optimizer state and FP32 master weights split
over `replica` (Rajbhandari et al. 2020, P_os), on the resident engine and in resident
plans: equal to one device, the state a device holds halved, the updated weights
all-gathered in the ledger as the hand formula says, and a plan's memory Rajbhandari's
2 Psi + 2 Psi + 12 Psi / N_d."""

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


def test_a_plan_holds_rajbhandaris_memory():
    """bf16 with FP32 Adam (K = 12 bytes a parameter), one microbatch a replica, on 4
    replicas: weights 2 Psi, gradients 2 Psi, optimizer state 12 Psi / 4, and the
    layers' activations (the report's), within 1%; the updated weights' all-gather
    over replica, 2 Psi (4 - 1) / 4 a device."""
    model = custom_model("gpt", 4, 256, 4, 1024, 128)
    psi = shardemu.param_count(Model(model).abstract_params()[0])
    train = TrainConfig(batch=4, seq=128, precision="bf16", zero=1)
    hw = shardemu.get_hardware("a100-80gb")
    planned = shardemu.plan(model, Parallelism(replica=4), train, hw, recompute="full")
    r = planned.report
    activations = r["activation_bytes_per_layer"]["target"] * model.num_layers
    held = r["memory_per_device"]["device"]["bytes"] - activations
    assert held == pytest.approx(2 * psi + 2 * psi + 12 * psi / 4, rel=0.01)
    gathered = [e for e in planned.ledger.events if e.op == "all-gather"]
    assert sum(e.bytes for e in gathered) == pytest.approx(2 * psi * 3 / 4 * 4, rel=0.01)


def test_what_zero_does_not_cover_is_refused():
    with pytest.raises(ConfigError, match="TrainConfig.zero must be 0 or 1, got 2"):
        TrainConfig(zero=2)
    with pytest.raises(ConfigError, match="ZeRO runs on the resident engine, not the pipelined"):
        PipelinedTrainer(TINY, make_mesh(pipe=2, devices=jax.devices()[:2]), TRAIN)
    with pytest.raises(ConfigError, match="rts_opt"):
        shardemu.plan(TINY.cfg, Parallelism(replica=2), TRAIN, shardemu.get_hardware("cs2"),
                      phased=PhasedConfig())  # fmt: skip
