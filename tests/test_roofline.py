"""The roofline (predict/roofline.py) of hand-built pieces against hand computation.

The piece is tanh(x @ w) * 2: one matmul, and one elementwise kernel that reads and
writes the [m, n] product. Its counts go through the real path (Counter.count ->
piece_events -> costmodel.duration), the expected times are written out by hand.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from shardemu.accounting.count import Counter, piece_events
from shardemu.accounting.ledger import Phase
from shardemu.accounting.matmuls import kernels
from shardemu.config import Parallelism
from shardemu.predict.costmodel import duration
from shardemu.predict.hardware import Hardware

M, K, N = 64, 128, 256
# 1 TFLOP/s at half efficiency, 1 GB/s at half efficiency, 2 us per matmul
TOY = Hardware(
    "toy", peak_tflops=1.0, device_memory_gb=1.0, host_memory_gb=1.0, host_link_gbps=1.0,
    intra_node_gbps=1.0, inter_node_gbps=1.0, devices_per_node=1, efficiency=0.5,
    memory_gbps=1.0, memory_efficiency=0.5, matmul_latency_us=2.0,
)  # fmt: skip
PAR = Parallelism(pipe=1, tensor=1, replica=1)


def _counted(dtype: jnp.dtype):  # noqa: ANN202
    mesh = jax.make_mesh((1,), ("replica",), devices=jax.devices()[:1])
    args = (jax.ShapeDtypeStruct((M, K), dtype), jax.ShapeDtypeStruct((K, N), dtype))
    piece = jax.jit(lambda x, w: jnp.tanh(x @ w) * 2)
    return Counter().count("tanh-matmul", piece, mesh, args)


@pytest.mark.parametrize("dtype, width", [(jnp.float32, 4), (jnp.bfloat16, 2)])
def test_roofline_of_a_hand_built_piece(dtype: jnp.dtype, width: int) -> None:
    counted = _counted(dtype)
    dot_flops = 2 * M * K * N
    dot_bytes = width * (M * K + K * N + M * N)  # bf16 counted as written, not widened
    assert [(m.flops, m.bytes) for m in counted.matmuls] == [(dot_flops, dot_bytes)]
    assert counted.memory_bytes == width * 2 * M * N  # the tanh kernel: read and write
    rate, bandwidth = 0.5e12, 0.5e9
    rest = counted.flops_per_device - dot_flops
    one_run = (
        max(dot_flops / rate, dot_bytes / bandwidth) + 2e-6
        + max(rest / rate, 2 * M * N * width / bandwidth)
    )  # fmt: skip
    for repeat in (1, 3):
        (event,) = piece_events(counted, 0, Phase("forward"), 0, repeat=repeat)
        assert duration(event, TOY, PAR) == pytest.approx(repeat * one_run, rel=1e-12)


def test_compute_bound_matmul_and_a_profile_without_a_roofline() -> None:
    """With fast memory the matmul is compute-bound; without memory_gbps every
    computation is FLOPs at peak x efficiency, as before the roofline."""
    (event,) = piece_events(_counted(jnp.float32), 0, Phase("forward"), 0)
    fast = dataclasses.replace(TOY, memory_gbps=1e9, matmul_latency_us=0.0)
    assert duration(event, fast, PAR) == pytest.approx(event.flops / 0.5e12, rel=1e-6)
    flat = dataclasses.replace(TOY, memory_gbps=None)
    assert duration(event, flat, PAR) == event.flops / 0.5e12


def test_batched_matmul_flops_and_layout_copies_are_not_memory_traffic() -> None:
    """A batched dot (attention's) counts batch x 2 m k n; a transpose-only kernel moves
    nothing an accelerator would not fold into its matmul."""
    b, s, d = 4, 32, 16
    q = jax.ShapeDtypeStruct((b, s, d), jnp.float32)
    compiled = jax.jit(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k)).lower(q, q).compile()
    matmuls, _ = kernels(compiled.as_text())
    assert sum(m.flops for m in matmuls) == 2 * b * s * s * d
    assert sum(m.flops for m in matmuls) == compiled.cost_analysis()["flops"]
    transpose = jax.jit(lambda x: x.T).lower(jax.ShapeDtypeStruct((64, 32), jnp.float32))
    assert kernels(transpose.compile().as_text())[1] == 0
