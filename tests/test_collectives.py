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


def test_an_all_reduce_the_cpu_slices_after_elementwise_work_is_a_reduce_scatter():
    """XLA's CPU pipeline all-reduces a sequence-parallel layer's input gradient and
    slices it, where a GPU emits a reduce-scatter. Two tuple elements (the gradient
    through two projections) summed before the slice are one reduce-scatter of one
    buffer (the GPU reassociates the sum of all-reduces); a buffer scaled by a scalar
    first (FP8's descaling) is one of its own; an element read whole stays an
    all-reduce (a layer norm's parameter gradient)."""
    hlo = """
HloModule m

%sum (p0: f32[8,16], p1: f32[8,16]) -> bf16[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  %a = f32[8,16]{1,0} add(%p0, %p1)
  ROOT %c = bf16[8,16]{1,0} convert(%a)
}

%scale (q0: f32[], q1: f32[8,16]) -> f32[8,16] {
  %q0 = f32[] parameter(0)
  %q1 = f32[8,16]{1,0} parameter(1)
  %b = f32[8,16]{1,0} broadcast(%q0), dimensions={}
  ROOT %m = f32[8,16]{1,0} multiply(%b, %q1)
}

ENTRY %e (x: f32[8,16], y: f32[8,16], z: f32[16], w: f32[8,16], s: f32[], i: s32[]) -> bf16[4,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %y = f32[8,16]{1,0} parameter(1)
  %z = f32[16]{0} parameter(2)
  %w = f32[8,16]{1,0} parameter(3)
  %s = f32[] parameter(4)
  %i = s32[] parameter(5)
  %ar = (f32[8,16], f32[8,16], f32[16]) all-reduce(%x, %y, %z), replica_groups=[2,2]<=[4]
  %g0 = f32[8,16]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[8,16]{1,0} get-tuple-element(%ar), index=1
  %summed = bf16[8,16]{1,0} fusion(%g0, %g1), kind=kLoop, calls=%sum
  %ds = bf16[4,16]{1,0} dynamic-slice(%summed, %i, %i), dynamic_slice_sizes={4,16}
  %ar2 = f32[8,16]{1,0} all-reduce(%w), replica_groups=[2,2]<=[4]
  %scaled = f32[8,16]{1,0} fusion(%s, %ar2), kind=kLoop, calls=%scale
  ROOT %ds2 = f32[4,16]{1,0} dynamic-slice(%scaled, %i, %i), dynamic_slice_sizes={4,16}
}
"""
    found = sorted((c.op, c.buffer_bytes) for c in collectives(hlo, MESH))
    assert found == [
        ("all-reduce", 16 * 4),
        ("reduce-scatter", F32_8x16),
        ("reduce-scatter", F32_8x16),
    ]


def test_an_all_reduces_elements_read_narrowed_count_at_the_narrow_width():
    """XLA's CPU backend reduces a BF16 gradient in f32 and casts it back after, and
    its all-reduce combiner merges several such reductions into one tuple whose
    reduction is not marked `_promoted` (a sequence-parallel step's layer norms' and
    position table's gradients). An element whose every user converts it to BF16 first
    is counted at 2 bytes, as the program's array a GPU reduces; an element read in f32
    stays 4; a promoted all-reduce is halved once, not twice."""
    hlo = """
HloModule m

%norm (p0: f32[8,16], p1: f32[16]) -> bf16[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %b = bf16[8,16]{1,0} convert(%p0)
  ROOT %r = bf16[8,16]{1,0} bitcast(%b)
}

ENTRY %e (x: f32[8,16], z: f32[16], w: f32[8,16]) -> (bf16[8,16], f32[16], bf16[8,16]) {
  %x = f32[8,16]{1,0} parameter(0)
  %z = f32[16]{0} parameter(1)
  %w = f32[8,16]{1,0} parameter(2)
  %ar = (f32[8,16], f32[16]) all-reduce(%x, %z), replica_groups=[2,2]<=[4], to_apply=%add
  %g0 = f32[8,16]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[16]{0} get-tuple-element(%ar), index=1
  %t = f32[16,8]{1,0} transpose(%g0), dimensions={1,0}
  %narrow = bf16[8,16]{1,0} fusion(%g0, %g1), kind=kLoop, calls=%norm
  %c = bf16[16,8]{1,0} convert(%t)
  %twice = f32[16]{0} add(%g1, %g1)
  %ar2 = f32[8,16]{1,0} all-reduce(%w), replica_groups=[2,2]<=[4], to_apply=%add_promoted
  %c2 = bf16[8,16]{1,0} convert(%ar2)
  ROOT %out = (bf16[8,16], f32[16], bf16[8,16]) tuple(%narrow, %twice, %c2)
}
"""
    found = sorted(c.buffer_bytes for c in collectives(hlo, MESH))
    assert found == [F32_8x16 // 2, F32_8x16 // 2 + 16 * 4]
