"""Reading collectives from HLO text: every replica-group syntax XLA prints, mapped to
the mesh axes a group varies along, with the ring algorithm's bytes sent per device
(Thakur et al. 2005). The mesh is (pipe=1, replica=2, tensor=2): device id = 2 r + t."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from shardemu.accounting.collectives import collectives

MESH = Mesh(
    np.array(jax.devices()[:4], dtype=object).reshape(1, 2, 2), ("pipe", "replica", "tensor")
)
F32_8x16 = 8 * 16 * 4  # bytes of the f32[8,16] buffers below


def one(line: str):
    (found,) = collectives(line, MESH)
    return found


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        ("replica_groups={{0,1},{2,3}}", ("tensor",)),  # explicit lists
        ("replica_groups={{0,2},{1,3}}", ("replica",)),
        ("replica_groups=[2,2]<=[4]", ("tensor",)),  # iota
        ("replica_groups=[2,2]<=[2,2]T(1,0)", ("replica",)),  # iota, transposed
        ("replica_groups=mesh['a'=2,'b'=2] {'b'}", ("tensor",)),  # mesh axes
        ("replica_groups=mesh['a'=2,'b'=2] {'a'}", ("replica",)),
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}", ("replica",)),
    ],
)
def test_every_replica_group_syntax_maps_to_its_mesh_axis(groups, axes):
    c = one(f"%ar = f32[8,16]{{1,0}} all-reduce(f32[8,16]{{1,0}} %x), {groups}, to_apply=%add")
    assert (c.op, c.axes, c.group, c.buffer_bytes) == ("all-reduce", axes, 2, F32_8x16)
    assert c.sent_bytes == 2 * (2 - 1) / 2 * F32_8x16  # ring all-reduce: 2 (n-1)/n S


def test_groups_over_both_axes_and_the_ring_formulas_per_op():
    every = "replica_groups={{0,1,2,3}}"
    gather = one(
        f"%ag = f32[8,16]{{1,0}} all-gather(f32[2,16]{{1,0}} %x), {every}, dimensions={{0}}"
    )
    assert gather.axes == ("replica", "tensor") and gather.group == 4
    assert gather.sent_bytes == 3 / 4 * F32_8x16  # (n-1)/n of the gathered buffer
    scatter = one(f"%rs = f32[2,16]{{1,0}} reduce-scatter(f32[8,16]{{1,0}} %x), {every}")
    assert scatter.buffer_bytes == F32_8x16  # the whole input: 4 x the result
    assert scatter.sent_bytes == 3 / 4 * F32_8x16
    permute = one(
        "%cp = f32[8,16]{1,0} collective-permute(f32[8,16]{1,0} %x), "
        "source_target_pairs={{0,2},{2,0}}"
    )
    assert (permute.axes, permute.group, permute.sent_bytes) == (("replica",), 2, F32_8x16)


def test_async_starts_count_the_larger_of_operand_and_result():
    c = one(
        "%ags = (f32[2,16]{1,0}, f32[8,16]{1,0}) all-gather-start(f32[2,16]{1,0} %x), "
        "replica_groups=[1,4]<=[4], dimensions={0}"
    )
    assert c.buffer_bytes == F32_8x16


def test_lines_without_collectives_are_ignored_and_unknown_groups_refused():
    assert collectives("%d = f32[8,16]{1,0} dot(f32[8,4] %a, f32[4,16] %b)", MESH) == []
    with pytest.raises(ValueError, match="unrecognised replica groups"):
        collectives("%ar = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups=?<>", MESH)
