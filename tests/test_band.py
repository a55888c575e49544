"""A prediction's band (`predict/band.py`): the step timed at both ends of the spread of
the profile's estimates, against closed forms of the same step; and the allocator's
fragmentation, which every fit is judged on."""

import dataclasses
import math
import re

import pytest

from shardemu.accounting.ledger import Event, Matmul, Phase
from shardemu.config import Parallelism
from shardemu.errors import HardwareError
from shardemu.predict.hardware import GB
from shardemu.predict.prediction import predict
from shardemu.predict.profiles import get_hardware, load_profile

ONE = Parallelism()
A100 = get_hardware("a100-80gb")
FLOPS = 3e12


def compute(flops: float, **roofline) -> Event:
    return Event(0, Phase("step"), "compute", "", flops=flops, **roofline)


def test_a_compute_bound_step_spans_the_efficiency_spread():
    """No roofline: the step is FLOPs / (peak x efficiency), so its ends are the same with
    the efficiency times e^(-+spread) (capped at 1): closed forms, not the cost model."""
    hw = dataclasses.replace(A100, memory_gbps=None, efficiency=0.5, efficiency_spread=0.2)
    _, p = predict([compute(FLOPS)], hw, ONE, FLOPS, tokens=1)
    peak = hw.peak_tflops * 1e12
    assert p.step_time_s == pytest.approx(FLOPS / (peak * 0.5), rel=1e-12)
    assert p.band.step_time_s[0] == pytest.approx(FLOPS / (peak * 0.5 * math.exp(0.2)), rel=1e-12)
    assert p.band.step_time_s[1] == pytest.approx(FLOPS / (peak * 0.5 * math.exp(-0.2)), rel=1e-12)
    assert p.band.kernel_fusion == ("emitted", "emitted")  # no roofline: fusion moves nothing

    capped = dataclasses.replace(hw, efficiency=0.9)  # 0.9 e^0.2 > 1: the peak, no faster
    _, p = predict([compute(FLOPS)], capped, ONE, FLOPS, tokens=1)
    assert p.band.step_time_s[0] == pytest.approx(FLOPS / peak, rel=1e-12)
    assert p.band.efficiency[1] == 1.0

    exact = dataclasses.replace(hw, efficiency_spread=0.0)  # a figure known exactly
    _, p = predict([compute(FLOPS)], exact, ONE, FLOPS, tokens=1)
    assert p.band.step_time_s == (p.step_time_s, p.step_time_s)


def test_a_fused_attention_core_spans_the_spread_at_its_own_rate():
    """A fused attention core of 4e12 FLOPs (causal: half computed) beside a 1e12 GEMM,
    no roofline: each at its kernel's efficiency (`attention_efficiency`, the A100's
    0.62, and `efficiency`, 0.73), and both scaled by e^(-+spread) at the band's ends."""
    hw = dataclasses.replace(A100, memory_gbps=None, efficiency_spread=0.2)
    core = Matmul(4e12, 0, attention=True, share=0.5, fused=True)
    event = compute(5e12, run_flops=5e12, matmuls=(core, Matmul(1e12, 0)))
    _, p = predict([event], hw, ONE, 5e12, tokens=1)
    peak = hw.peak_tflops * 1e12
    by_hand = [
        2e12 / (peak * 0.62 * f) + 1e12 / (peak * 0.73 * f) for f in (1, math.e**0.2, math.e**-0.2)
    ]
    assert (p.step_time_s, *p.band.step_time_s) == pytest.approx(by_hand, rel=1e-12)


def test_a_memory_bound_kernel_spans_fused_to_emitted_bytes():
    """On a roofline a kernel of few FLOPs takes its bytes / bandwidth: the fast end moves
    the bytes fused as an accelerator fuses them, the slow end those the CPU emitted."""
    emitted, fused = 8 * 10**9, 3 * 10**9
    event = compute(1e6, run_flops=1e6, memory_bytes=emitted, fused_memory_bytes=fused)
    _, p = predict([event], A100, ONE, 1e6, tokens=1)
    bandwidth = A100.memory_gbps * A100.memory_efficiency * GB
    assert p.step_time_s == pytest.approx(emitted / bandwidth, rel=1e-9)  # the profile's
    assert p.band.step_time_s == pytest.approx((fused / bandwidth, emitted / bandwidth), rel=1e-9)
    assert p.band.kernel_fusion == ("fused", "emitted")


def test_fits_are_judged_after_the_allocators_fragmentation():
    """A GPU's caching allocator cannot hand out 15% of its memory (33% at worst): 75 GB
    fits an "80 GB" A100's memory (80 GiB, 81,920 MiB as NVML reports it) but not what it
    hands out; the band says it would fit with no fragmentation and not with the most."""
    assert A100.device_memory_bytes == int(80 * 2**30 * 0.85)
    used = 75 * 10**9
    _, p = predict([compute(FLOPS)], A100, ONE, FLOPS, 1, memory={"device": used, "host": 0})
    device = p.memory_per_device["device"]
    assert (device.capacity, device.fits, device.fragmentation) == (73_014_444_032, False, 0.15)
    assert p.band.device_fits == (True, False)
    assert p.to_json()["band"]["memory_fragmentation"] == [0.0, 0.33]
    tpu = get_hardware("tpu-v5p")  # XLA assigns a TPU's buffers when it compiles
    assert tpu.device_memory_bytes == int(tpu.device_memory_gb * GB)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("efficiency_spread = -0.1", "efficiency_spread must be in [0, 1]"),
        ("memory_fragmentation = 0.4", "memory_fragmentation (0.4) and memory_fragmentation_max"),
        ("memory_fragmentation_max = 1.0", "< 1 (fractions of the device memory)"),
        ("attention_efficiency = 1.2", "attention_efficiency must be in (0, 1], got 1.2"),
        ('fp8_efficiency = "high"', "fp8_efficiency must be in (0, 1], got 'high'"),
    ],
)
def test_a_profile_with_impossible_spreads_is_refused(tmp_path, line, message):
    path = tmp_path / "gpu.toml"
    path.write_text(f'base = "a100-80gb"\n{line}\n')
    with pytest.raises(HardwareError, match=re.escape(message)):
        load_profile(path)


def test_a_plan_without_its_band_has_the_same_step():
    """`plan(..., band=False)`, as a search plans: the same step and breakdown, and no
    band (its ends not timed), on a pipeline timed from two short steps and on one
    stage timed whole."""
    from shardemu.config import TrainConfig
    from shardemu.models import custom_model
    from shardemu.predict.planning import plan

    cfg = custom_model("gpt", 4, 64, 4, 128, 64)
    train = TrainConfig(batch=8, seq=64, precision="bf16")
    for par, size in ((Parallelism(pipe=2, replica=2), 1), (Parallelism(replica=2), 4)):
        banded, bare = (
            plan(cfg, par, train, A100, microbatch_size=size, band=band).prediction
            for band in (True, False)
        )
        assert banded.band is not None and bare.band is None
        assert bare.step_time_s == banded.step_time_s and bare.breakdown == banded.breakdown
