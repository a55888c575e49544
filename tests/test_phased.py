"""Phased execution: weights in the host tier (pinned_host), streamed in per phase.
Same numbers as plain single-device jax.jit; the ledger's bytes equal what the rules
table says the shards weigh; the device tier ends each step empty and never overflows.
Runs are cached per (model, phases) so each configuration compiles once."""

import jax
import numpy as np
import pytest

from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.data import SyntheticCorpus
from shardemu.describe import describe
from shardemu.mesh import make_mesh
from shardemu.phased.scheduler import PhasedTrainer
from shardemu.phased.tiers import CapacityError

TRAIN = TrainConfig(batch=8, seq=16, seed=0)
STEPS = 3
CAPACITY = 10**7  # bytes per device: every run below must stay within it


@pytest.fixture(scope="module")
def reference(tiny_model, single_device_reference):
    return single_device_reference(tiny_model, TRAIN, STEPS)


def run_phased(model, init, phases, device_memory=CAPACITY):
    trainer = PhasedTrainer(model, make_mesh(tensor=2, replica=4), TRAIN, phases, device_memory)
    state = trainer.init(init)
    corpus = SyntheticCorpus(model.cfg.vocab_size, seed=TRAIN.seed)
    losses = []
    for s in range(STEPS):
        result = trainer.step(state, model.batch(corpus, s, TRAIN.batch, TRAIN.seq))
        state = result.state
        losses.append(result.loss)
        assert trainer.device.held == {}  # nothing is left in the device tier
    return trainer, state, losses


@pytest.fixture(scope="module")
def runs(tiny_model, reference):
    cache = {}

    def get(phases):
        if phases not in cache:
            cache[phases] = run_phased(tiny_model, reference["init"], phases)
        return cache[phases]

    return get


@pytest.mark.parametrize("phases", [1, 2, 4])
def test_phased_equals_single_device(reference, runs, phases, assert_params_close):
    trainer, state, losses = runs(phases)
    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
    # the host tier holds exactly the updated weights
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state.layers))
    assert_params_close(trainer.params(state), reference["final"], TRAIN.learning_rate)
    assert 0 < trainer.device.high_water <= CAPACITY


def test_ledger_bytes_equal_the_shards_that_moved(tiny_model, runs):
    trainer = runs(2)[0]
    rows = describe(tiny_model.cfg, Parallelism(tensor=2, replica=4))["params"]
    devices, stack = 8, tiny_model.stack_key + "/"
    layer_bytes = devices * sum(r["bytes_per_device"] for r in rows if r["path"].startswith(stack))
    shared_bytes = devices * sum(
        r["bytes_per_device"] for r in rows if not r["path"].startswith(stack)
    )
    for step in range(STEPS):
        totals = trainer.ledger.step_totals(step)
        # layers come in twice (forward, backward), shared weights once, per step
        assert totals["bytes_h2d_weights"] == 2 * layer_bytes + shared_bytes
        assert totals["bytes_d2h_gradients"] == layer_bytes + shared_bytes


def test_ledger_flops_add_up_the_same_for_any_phase_count(runs):
    """Per-phase FLOPs are one compiled layer times the phase's layers, so one phase of 4
    layers and four phases of 1 count the same work."""
    one = runs(1)[0].ledger.step_totals(0)["flops"]
    four = runs(4)[0].ledger.step_totals(0)["flops"]
    assert one == pytest.approx(four, rel=1e-6) and one > 0


def test_a_plan_that_does_not_fit_is_refused(tiny_model, reference):
    with pytest.raises(CapacityError, match=r"phase 'shared'.*capacity is 1,000"):
        run_phased(tiny_model, reference["init"], phases=4, device_memory=1000)


def test_phases_must_divide_layers(tiny_model):
    with pytest.raises(ConfigError, match="--phases 3 does not divide the model's 4 layers"):
        PhasedTrainer(tiny_model, make_mesh(tensor=2, replica=4), TRAIN, phases=3)
