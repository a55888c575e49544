"""`shardemu.plan`: one entry point that hands a layout to the planner it needs and
returns its `Plan`, refusing settings that belong to the other planner instead of
dropping them."""

import pytest

import shardemu
from shardemu.config import ConfigError, Parallelism, PhasedConfig, TrainConfig
from shardemu.models import get_preset
from shardemu.predict.plan_resident import plan_resident
from shardemu.predict.profiles import PROFILES

TINY = get_preset("gpt-tiny")
TRAIN = TrainConfig(batch=4, seq=16)
HW = PROFILES["a100-80gb"]


def test_a_resident_plan_is_plan_residents_own():
    planned = shardemu.plan(TINY, Parallelism(replica=2), TRAIN, HW, recompute="none")
    direct = plan_resident(TINY, Parallelism(replica=2), TRAIN, 2, HW, "none")
    assert isinstance(planned, shardemu.Plan)
    assert planned.report["microbatch_size"] == 2  # the whole batch per replica
    assert planned.step_time_s == direct.report["step_time_s"] > 0
    assert len(planned.ledger.events) == len(direct.ledger.events)
    assert planned.timeline is not None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"phased": PhasedConfig(), "recompute": "none"}, "recompute='none' and attention="),
        ({"phased": PhasedConfig(), "attention": "fused"}, "PhasedConfig.activations"),
        ({}, "a resident plan is timed on a hardware profile"),
    ],
)
def test_settings_of_the_other_planner_are_refused(settings, message):
    hardware = None if not settings else HW
    with pytest.raises(ConfigError, match=message):
        shardemu.plan(TINY, Parallelism(), TRAIN, hardware, **settings)


def test_a_resident_plan_shards_by_the_rules_it_is_given():
    """`rules=` reaches the resident planner's count: Megatron-LM's rules (the default,
    or given) all-reduce activations over `tensor`; rules that split nothing over it
    leave no collective on `tensor` and hold each layer's weights whole."""
    par = Parallelism(tensor=2)
    whole = tuple((name, None) for name, _ in shardemu.megatron_rules())

    def tensor_bytes(planned: shardemu.Plan) -> int:
        return sum(e.bytes for e in planned.ledger.events if e.axis == "tensor")

    default = shardemu.plan(TINY, par, TRAIN, HW, recompute="none")
    given = shardemu.plan(TINY, par, TRAIN, HW, recompute="none", rules=shardemu.megatron_rules())
    replicated = shardemu.plan(TINY, par, TRAIN, HW, recompute="none", rules=whole)
    assert tensor_bytes(default) == tensor_bytes(given) > 0
    assert tensor_bytes(replicated) == 0
    held = [p.report["memory_per_device"]["device"]["bytes"] for p in (default, replicated)]
    assert held[1] > held[0]


def test_a_plan_without_hardware_has_no_step_time():
    planned = shardemu.Plan({"model": "m"}, ledger=None, timeline=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no prediction"):
        _ = planned.step_time_s
