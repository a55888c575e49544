"""Kernels as an accelerator fuses them (`accounting/fusion.py`), against hand counts:
the non-matmul work between two matmuls is one kernel that reads what enters it and
writes what leaves it, and work that a matmul lies between is never one kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import shardemu
from shardemu.accounting.matmuls import Kernels
from shardemu.errors import HardwareError
from shardemu.parallel.mesh import make_mesh
from shardemu.predict.roofline import compute_seconds, run_seconds

B, S, D = 2, 16, 64
BSD = B * S * D * 4  # bytes of one [b, s, d] float32 activation


def kernels_of(fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    return Kernels(jax.jit(fn).lower(*args).compile().as_text())


def pre_norm(x, w, g, beta):
    """Layer norm, a matmul, GELU and the residual add."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + beta
    return jax.nn.gelu(y @ w) + x


def test_a_pre_norm_layer_is_two_kernels_around_its_matmul():
    """Layer norm (two reductions, then the scaling) is one kernel: it reads x, the
    scale and the shift, and writes the matmul's input; GELU and the residual add are
    another: they read the product and x and write the output. 5 [b, s, d] + 2 [d]."""

    k = kernels_of(pre_norm, (B, S, D), (D, D), (D,), (D,))
    assert k.memory(target=True) == 5 * BSD + 2 * D * 4
    assert k.memory() > 5 * BSD  # the CPU's own kernels move more


def test_work_a_matmul_lies_between_is_not_fused():
    """relu(x) feeds the matmul and x feeds the add after it: fusing the relu and the
    add would make a cycle through the matmul, so they are two kernels (x read twice,
    relu(x) written, the product read, the output written)."""
    k = kernels_of(lambda x, w: x + jax.nn.relu(x) @ w, (B * S, D), (D, D))
    assert k.memory(target=True) == 5 * BSD


def test_a_profile_with_fused_kernels_times_the_fused_bytes():
    """`shardemu.count`'s event carries both counts; a profile with
    `kernel_fusion = "fused"` times the fused one, the default the CPU's kernels, each
    exactly as the roofline times that many bytes; a kernel_fusion it does not know is
    refused, naming the choices."""

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((B, S, D), (D, D), (D,), (D,))]
    ledger = shardemu.count(pre_norm, *args, mesh=make_mesh(devices=jax.devices()[:1]))
    (event,) = [e for e in ledger.step(0) if e.kind == "compute"]
    assert event.fused_memory_bytes == 5 * BSD + 2 * D * 4 < event.memory_bytes
    emitted = shardemu.get_hardware("h100-sxm")
    fused = dataclasses.replace(emitted, kernel_fusion="fused")
    mesh = make_mesh(devices=jax.devices()[:1])
    for hw, nbytes in ((emitted, event.memory_bytes), (fused, event.fused_memory_bytes)):
        want = run_seconds(event.run_flops, event.matmuls, nbytes, hw)
        assert compute_seconds(event, hw) == pytest.approx(want, rel=1e-12)
        _, prediction = shardemu.predict_ledger(ledger, hw, precision="fp32", mesh=mesh)
        assert prediction.to_json()["kernel_fusion"] == hw.kernel_fusion  # the report says
    with pytest.raises(HardwareError, match="kernel_fusion must be one of emitted, fused"):
        dataclasses.replace(emitted, kernel_fusion="xla")
