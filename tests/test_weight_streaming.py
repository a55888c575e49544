"""Weight streaming (Cerebras CS-2 clusters): the phased engine with SwarmX semantics.

A run on 4 systems is compared with plain single-device jax.jit (loss each step, the
first step's gradients, parameters after three steps); the SwarmX ledger with the
parameters' own bytes; the cost model with a timeline computed by hand.
"""

import dataclasses

import jax
import numpy as np
import pytest

from shardemu.accounting.ledger import Event, Phase
from shardemu.cli import main
from shardemu.config import ConfigError, Parallelism, PhasedConfig, TrainConfig
from shardemu.data import SyntheticCorpus
from shardemu.errors import CapacityError
from shardemu.models import param_bytes
from shardemu.parallel.mesh import make_mesh
from shardemu.phased.trainer import PhasedTrainer
from shardemu.predict.costmodel import build_timeline
from shardemu.predict.hardware import Hardware
from shardemu.predict.plan_phased import plan_phased
from shardemu.predict.profiles import PROFILES

TRAIN = TrainConfig(batch=8, seq=16, seed=0)
STEPS = 3
SYSTEMS = 4


# One activation policy a model: BERT the CS-2's own (its ledger is checked below), GPT
# recomputation
POLICY = {"bert": "keep-activations", "gpt": "recompute"}


def kept_run(runs, model):
    """BERT's run with kept activations (GPT runs the other policy)."""
    if model.cfg.family != "bert":
        pytest.skip("BERT runs keep-activations (POLICY)")
    return runs("keep-activations")


@pytest.fixture(scope="module")
def reference(tiny_model, single_device_reference):
    return single_device_reference(tiny_model, TRAIN, STEPS)


@pytest.fixture(scope="module")
def runs(tiny_model, reference):
    """Per activation policy: (trainer, final state, step results) on 4 systems."""
    cache = {}

    def get(activations: str):
        if activations not in cache:
            cfg = PhasedConfig(activations=activations, weight_streaming=True)
            mesh = make_mesh(replica=SYSTEMS, devices=jax.devices()[:SYSTEMS])
            trainer = PhasedTrainer(tiny_model, mesh, TRAIN, cfg)
            state = trainer.init(reference["init"])
            corpus = SyntheticCorpus(tiny_model.cfg.vocab_size, seed=TRAIN.seed)
            results = []
            for s in range(STEPS):
                batch = tiny_model.batch(corpus, s, TRAIN.batch, TRAIN.seq)
                results.append(trainer.step(state, batch))
                state = results[-1].state
                assert all(t.held == {} for t in trainer.tiers)
            cache[activations] = trainer, state, results
        return cache[activations]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["keep-activations", "recompute"])
def test_weight_streaming_equals_single_device(
    tiny_model, reference, runs, activations, assert_params_close
):
    if POLICY[tiny_model.cfg.family] != activations:
        pytest.skip("each model runs one policy (POLICY)")
    trainer, state, results = runs(activations)
    np.testing.assert_allclose([r.loss for r in results], reference["losses"], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        jax.device_get(trainer.params(results[0].grads)),
        reference["grads"],
    )
    assert_params_close(trainer.params(state), reference["final"], TRAIN.learning_rate)


@pytest.mark.slow
def test_swarmx_moves_each_layer_twice_and_each_gradient_once(tiny_model, runs):
    """Per step and per link: broadcast = 2 fetches x the layers' bytes + the shared
    weights once; reduce = every weight's bytes once (into MemoryX). Nothing streams
    through the host link, and no gradient is all-reduced between devices."""
    trainer, state, _ = kept_run(runs, tiny_model)
    layers = param_bytes(state.layers)  # the host tier's arrays, one copy each
    shared = param_bytes(state.shared)
    assert trainer.plan().per_phase[0].fetches == 2
    for step in range(STEPS):
        events = trainer.ledger.step(step)
        totals = trainer.ledger.step_totals(step)
        assert totals["bytes_broadcast"] == 2 * layers + shared
        assert totals["bytes_reduce"] == layers + shared
        assert totals["bytes_h2d"] == totals["bytes_d2h"] == 0
        swarmx = [e for e in events if e.kind in ("broadcast", "reduce")]
        assert {(e.axis, e.devices) for e in swarmx} == {("swarmx", SYSTEMS)}
        # BERT's loss normalisation sums a token count (4 bytes) over the systems; a
        # gradient all-reduce would move kilobytes
        assert sum(e.bytes for e in events if e.kind == "collective") < 100
    # one layer a phase, and what stays on the device between forward and backward
    # is the activations: less than the recompute policy keeps plus the weights
    rows = trainer.plan().per_phase
    assert len(rows) == tiny_model.cfg.num_layers
    assert all(r.activation_bytes_per_device > 0 for r in rows)


@pytest.mark.slow
def test_keep_activations_recomputes_nothing(runs, tiny_model):
    keep = kept_run(runs, tiny_model)[0].ledger.step(0)
    assert sum(e.recompute_flops for e in keep) == 0


def _hand_step(systems: int) -> list[Event]:
    """A two-layer model's weight-streaming step with round numbers, per system:
    weights 1 GB a layer and 1 GB shared, gradients as much; compute 1e12 FLOPs for the
    embedding, the head, the embedding's backward and each update, 2e12 per layer
    forward and 4e12 per layer backward. FLOPs and devices are over all systems."""
    n, gb, tf = systems, 10**9, 1e12

    def comp(phase: Phase, flops: float, on: str = "device") -> Event:
        return Event(0, phase, "compute", "", flops=flops * n, devices=n, on=on)

    def link(kind: str, phase: Phase, carries: str) -> Event:
        return Event(0, phase, kind, carries, gb, axis="swarmx", devices=n)

    fwd = [Phase("forward", i, (i, i + 1)) for i in (0, 1)]
    bwd = [Phase("backward", i, (i, i + 1)) for i in (0, 1)]
    upd = [Phase("update", i, (i, i + 1)) for i in (0, 1)]
    return [  # the program order of phased/program.py
        link("broadcast", Phase("shared"), "weights"),
        comp(Phase("embed"), tf),
        link("broadcast", fwd[0], "weights"),
        link("broadcast", fwd[1], "weights"),  # one phase ahead
        comp(fwd[0], 2 * tf),
        comp(fwd[1], 2 * tf),
        comp(Phase("head"), tf),
        link("broadcast", bwd[1], "weights"),
        link("broadcast", bwd[0], "weights"),
        comp(bwd[1], 4 * tf),
        link("reduce", bwd[1], "gradients"),
        comp(bwd[0], 4 * tf),
        link("reduce", bwd[0], "gradients"),
        comp(Phase("embed-backward"), tf),
        comp(Phase("shared-backward"), 0.0),  # the tied embedding's two halves added
        link("reduce", Phase("shared-backward"), "gradients"),
        comp(upd[0], tf, "host"),
        comp(upd[1], tf, "host"),
        comp(Phase("update"), tf, "host"),
    ]


# 1 TFLOP/s at full efficiency, 1 GB/s links (so 1 s per GB), a binary SwarmX tree with
# 1 ms per level: 1 level for 1 system, 2 for 4
HAND = Hardware(
    "hand", peak_tflops=1.0, device_memory_gb=1.0, host_memory_gb=1.0, host_link_gbps=1.0,
    intra_node_gbps=1.0, inter_node_gbps=1.0, devices_per_node=1, efficiency=1.0,
    host_tflops=1.0, swarmx_fanout=2, swarmx_hop_us=1000.0,
)  # fmt: skip


@pytest.mark.parametrize(
    "systems, hop, starts",
    [
        # with l = one SwarmX transfer (1 s + latency): shared weights [0, l]; embed
        # after them [l, l+1]; w0 after the embed (one phase ahead) [l+1, 2l+1]; w1
        # [2l+1, 3l+1]; fwd0 [2l+1, 2l+3]; fwd1 [2l+3, 2l+5]; head [2l+5, 2l+6]; w1, w0
        # again from 2l+6 to 4l+6; bwd1 [3l+6, 3l+10], its gradients out [3l+10, 4l+10];
        # bwd0 [3l+10, 3l+14], out [3l+14, 4l+14]; embed backward [3l+14, 3l+15]; the
        # shared gradients out [4l+14, 5l+14]; three host updates of 1 s each after
        (1, 1.001, {"embed": 1.001, "fwd0": 3.002, "bwd1": 9.003, "update0": 19.005}),
        (4, 1.002, {"embed": 1.002, "fwd0": 3.004, "bwd1": 9.006, "update0": 19.010}),
    ],
)
def test_swarmx_timeline_by_hand(systems, hop, starts):
    timeline = build_timeline(_hand_step(systems), HAND, Parallelism(replica=systems))
    assert timeline.step_time_s == pytest.approx(5 * hop + 17, rel=1e-12)
    by_name = {str(s.phase): s.start for s in timeline.spans if s.stream in ("compute", "host")}
    for name, start in starts.items():
        assert by_name[name] == pytest.approx(start, rel=1e-12)
    assert timeline.breakdown["host_update_s"] == pytest.approx(3.0, rel=1e-12)


def test_swarmx_levels_and_profile_keys():
    cs2 = PROFILES["cs2"]
    assert [cs2.swarmx_levels(n) for n in (1, 4, 5, 16, 17, 64)] == [1, 1, 2, 2, 3, 3]
    assert cs2.swarmx_seconds(150 * 10**9, 16) == pytest.approx(1.0 + 2e-6)
    with pytest.raises(Exception, match="swarmx_fanout"):
        dataclasses.replace(cs2, swarmx_fanout=1)
    with pytest.raises(Exception, match="memoryx_gbps"):
        dataclasses.replace(cs2, memoryx_gbps=0.0)


def test_bad_weight_streaming_settings_are_refused(capsys):
    with pytest.raises(ConfigError, match="PhasedConfig.rts 2"):
        PhasedConfig(weight_streaming=True, rts=2, activations="keep-activations")
    with pytest.raises(ConfigError, match="PhasedConfig.activations keep"):
        PhasedConfig(weight_streaming=True, activations="keep")
    with pytest.raises(ConfigError, match="set PhasedConfig.weight_streaming"):
        PhasedConfig(activations="keep-activations")
    for mesh in (Parallelism(tensor=2, replica=2), Parallelism(context=2)):
        with pytest.raises(ConfigError, match="tensor, pipe, context and expert must be 1"):
            PhasedConfig(weight_streaming=True).check_mesh(mesh)
    for argv, message in (
        (["--systems", "4"], "--systems 4 goes with --weight-streaming"),
        (["--weight-streaming", "--systems", "4", "--mesh", "tensor=4"], "drop --mesh"),
        (["--weight-streaming", "--phases", "2"], "one layer a phase"),
    ):
        assert main(["plan", "--model", "gpt-tiny", "--json", *argv]) == 2
        assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.slow
def test_a_batch_whose_activations_do_not_fit_a_system_is_refused(tiny_model, runs):
    """Refused, suggesting recomputation only to a plan that does not recompute yet.
    (The recomputing plan counts the pieces GPT's run above compiled.)"""
    if tiny_model.cfg.family == "bert":
        pytest.skip("one model shows the refusal")
    small = dataclasses.replace(PROFILES["cs2"], device_memory_gb=1e-4)  # 100 kB
    for activations in ("keep-activations", "recompute"):
        if activations == POLICY["gpt"]:
            runs(activations)
        with pytest.raises(CapacityError, match="100,000") as err:
            plan_phased(
                tiny_model.cfg, Parallelism(replica=SYSTEMS), TRAIN,
                PhasedConfig(activations=activations, weight_streaming=True), hardware=small,
            )  # fmt: skip
        suggested = "PhasedConfig.activations recompute" in str(err.value)
        assert suggested == (activations != "recompute") and "use more systems" in str(err.value)


def test_a_phased_plan_counted_first_leaves_weight_streamings_count_alone():
    """Weight streaming's per-system pieces take the names and the inputs of the phased
    engine's (`stages/systems.py`), and a counter that had counted a phased plan gave a
    streaming plan of the same model and mesh the phased pieces' outputs: a raw sharding
    error from JAX, or with other shapes a wrong count (found by a fuzzed sequence of
    `plan` commands in one process). The streaming plan counted after a phased one on
    one counter, and on a fresh counter: the same step."""
    from shardemu.accounting.count import Counter
    from shardemu.models import Model, get_preset

    model, mesh = Model(get_preset("gpt-tiny")), make_mesh(replica=2, devices=jax.devices()[:2])
    shared = Counter()
    PhasedTrainer(model, mesh, TRAIN, PhasedConfig(), counter=shared).plan()
    streaming = PhasedConfig(weight_streaming=True, activations="keep-activations")
    after = PhasedTrainer(model, mesh, TRAIN, streaming, counter=shared).plan()
    alone = PhasedTrainer(model, mesh, TRAIN, streaming, counter=Counter()).plan()
    assert after.step_totals == alone.step_totals
    assert after.step_totals["bytes_broadcast"] > 0
