"""Pipeline schedules: the simulated slot lists reproduce the published bubble and
memory formulas, respect every dependency, and run each op exactly once."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardemu.config import ConfigError
from shardemu.parallel.schedules import make_schedule

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
