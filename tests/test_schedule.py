"""Pipeline schedules: the simulated slot lists reproduce the published bubble and
memory formulas, respect every dependency, and run each op exactly once."""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from shardemu.config import ConfigError, TrainConfig
from shardemu.parallel.schedules import make_schedule, programs

p_m = st.tuples(st.integers(1, 6), st.integers(1, 12))


@given(p_m, st.sampled_from(["gpipe", "1f1b"]))
def test_gpipe_and_1f1b_bubble(pm, name):
    p, m = pm
    assert make_schedule(name, p, m).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@given(st.integers(1, 5), st.integers(1, 4), st.integers(2, 4))
def test_interleaved_bubble(p, groups, v):
    m = p * groups
    sched = make_schedule("interleaved", p, m, v)
    assert sched.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@given(p_m)
def test_gpipe_holds_m_microbatches_and_1f1b_holds_p(pm):
    p, m = pm
    gpipe, one_f_one_b = make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)
    assert all(gpipe.peak_activations(s) == m for s in range(p))
    assert [one_f_one_b.peak_activations(s) for s in range(p)] == [min(p - s, m) for s in range(p)]


@given(p_m, st.sampled_from(["gpipe", "1f1b", "interleaved"]), st.integers(2, 3))
def test_every_op_once_in_dependency_order(pm, name, v):
    p, m = pm
    if name != "interleaved":
        v = 1
    else:
        m = p * m
    sched = make_schedule(name, p, m, v)
    when = {(s.kind, s.microbatch, sched.virtual_stage(s)): s.time for s in sched.slots}
    assert len(when) == len(sched.slots) == 2 * m * p * v
    last = p * v - 1
    for (kind, mb, j), t in when.items():
        if kind == "F" and j > 0:
            assert when[("F", mb, j - 1)] < t
        if kind == "B":
            assert when[("F", mb, j)] < t
            if j < last:
                assert when[("B", mb, j + 1)] < t
    busy = {(s.stage, s.time) for s in sched.slots}
    assert len(busy) == len(sched.slots)  # a device runs one op at a time
    assert sched.p2p_transfers == (2 * m * (p * v - 1) if p > 1 else 0)


@given(
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(2, 3),
    st.sampled_from(["gpipe", "1f1b", "interleaved"]),
)
def test_the_last_stage_ends_with_a_backward_of_its_first_chunk(p, groups, v, name):
    """What the search's pipeline bound (`Bounds.fill_and_drain`) rests on: the last
    stage's last operation is a backward of its first chunk, which the backward through
    every chunk before it follows."""
    v = v if name == "interleaved" else 1
    sched = make_schedule(name, p, p * groups, v)
    last = max((s for s in sched.slots if s.stage == p - 1), key=lambda s: s.time)
    assert (last.kind, last.chunk) == ("B", 0)


def test_gpipe_slots_are_the_diagonal_wavefront():
    sched = make_schedule("gpipe", 3, 4)
    forwards = {(s.time, s.stage): s.microbatch for s in sched.slots if s.kind == "F"}
    assert forwards == {(t, s): t - s for t in range(6) for s in range(3) if 0 <= t - s < 4}


def test_bad_schedules_are_refused():
    with pytest.raises(ConfigError, match="unknown schedule 'zigzag'"):
        make_schedule("zigzag", 2, 2)
    with pytest.raises(ConfigError, match="divisible by stages"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ConfigError, match="need 'interleaved'"):
        make_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ConfigError, match="interleaved 1F1B needs TrainConfig.virtual >= 2"):
        make_schedule("interleaved", 4, 8, 1)


def test_a_microbatch_group_runs_megatron_cores_table():
    """Megatron-Core's own examples (`ModelConfig.microbatch_group_size_per_vp_stage`'s
    docstring, PP=2, VP=2): each rank runs the forwards of microbatches 0 1 0 1 2 3 2 3
    with groups of 2 (m=4), and 0 1 2 0 1 2 3 4 3 4 with groups of 3 (m=5); groups of p
    are the default order."""
    for m, g, order in ((4, 2, [0, 1, 0, 1, 2, 3, 2, 3]), (5, 3, [0, 1, 2, 0, 1, 2, 3, 4, 3, 4])):
        for prog in programs("interleaved", 2, m, 2, g):
            assert [mb for kind, mb, _ in prog if kind == "F"] == order
    assert (
        make_schedule("interleaved", 2, 4, 2, 2).slots
        == make_schedule("interleaved", 2, 4, 2).slots
    )


@given(st.integers(1, 4), st.integers(2, 3), st.integers(1, 12), st.integers(0, 12))
def test_a_grouped_schedule_runs_every_op_once_and_warms_up_v_minus_1_groups(p, v, m, g):
    """Any group Megatron-Core takes: every op once, after what it needs, one at a time
    on a device; stage s holds its (p - s - 1) 2 + (v - 1) g warm-up forwards and one
    more (in chunks: 1/v of a stage's activations each)."""
    m, g = max(m, p), min(max(g, p), max(m, p))
    assume(m % g == 0 or m % g >= p)
    sched = make_schedule("interleaved", p, m, v, g)
    when = {(s.kind, s.microbatch, sched.virtual_stage(s)): s.time for s in sched.slots}
    assert len(when) == len(sched.slots) == 2 * m * p * v
    for (kind, mb, j), t in when.items():
        if kind == "F" and j > 0:
            assert when[("F", mb, j - 1)] < t
        if kind == "B":
            assert when[("F", mb, j)] < t and (j == p * v - 1 or when[("B", mb, j + 1)] < t)
    assert len({(s.stage, s.time) for s in sched.slots}) == len(sched.slots)
    for s in range(p):
        warm = min(m * v, (p - s - 1) * 2 + (v - 1) * g)
        assert sched.peak_activations(s) == min(m * v, warm + 1) / v


def test_bad_microbatch_groups_are_refused():
    with pytest.raises(ConfigError, match="between the 4 stages and the 8 microbatches"):
        make_schedule("interleaved", 4, 8, 2, 3)
    with pytest.raises(ConfigError, match="between the 4 stages and the 8 microbatches"):
        make_schedule("interleaved", 4, 8, 2, 9)
    with pytest.raises(ConfigError, match="last group of 2 of the 12 microbatches"):
        make_schedule("interleaved", 4, 12, 2, 5)
    with pytest.raises(ConfigError, match="set TrainConfig.schedule interleaved"):
        TrainConfig(schedule="1f1b", microbatch_group=4)
