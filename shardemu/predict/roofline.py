"""The time of one device computation: a roofline per kernel of its compiled piece.

Williams, Waterman and Patterson 2009, "Roofline": a kernel takes the longer of its
FLOPs at the compute rate and its bytes at the memory bandwidth. Per run of a piece:

- each matmul XLA emitted (`accounting/matmuls.py`) takes
  max(FLOPs / (peak x efficiency), bytes / (memory_gbps x memory_efficiency))
  + matmul_latency_us (of its FLOPs the `Matmul.share` its kernel computes: a causal
  fused attention core's), at its kernel's rate (`Hardware.rates`): `fp8_tflops` x
  `fp8_efficiency` when it multiplies FP8 operands, peak x `attention_efficiency`
  inside a fused attention kernel (FlashAttention); the latency is the efficiency
  curve of small matmuls (a fixed cost per kernel: launch, tile prologue, a last
  partial wave), which dominates below about 10^10 FLOPs on an H100;
- the piece's other kernels (softmax, layer norm, GELU, the optimizer's update) take
  max(their FLOPs / (peak x efficiency), their bytes / bandwidth): memory-bound wherever
  they are, as they almost always are. Their bytes are those of the kernels XLA's CPU
  backend emitted, or, with the profile's `kernel_fusion = "fused"`, of the same work
  fused between matmuls as an accelerator stack fuses it (`accounting/fusion.py`).

The parameters of the built-in GPU profiles were measured with XLA on an H100
(`benchmarks/gpu_calibration.py`): large-matmul efficiency 0.73 and 13.5 us per matmul
(fitted to 248 matmul shapes, median |log error| 0.12; the sweep is stored in
`benchmarks/measured/` and `benchmarks/matmul_fit.py` refits it), and 83% of the HBM bandwidth
(2.77 TB/s of 3.35 for an elementwise kernel over 4 GiB). No parameter was fitted to
whole layers: predicted GPT layers of width 768 to 8192 match measured ones within 19%
(median 5.5%; docs/results.md). The FP8 and fused-attention rates were measured on an
H100 too (`benchmarks/kernel_rates.py`; `profiles.py`). A profile without `memory_gbps`
(or an event counted before the roofline existed) times computations as their FLOPs at
their kernels' rates.
"""

from __future__ import annotations

import functools

from shardemu.accounting import flops
from shardemu.accounting.ledger import Event, Matmul
from shardemu.config import TrainConfig
from shardemu.errors import HardwareError
from shardemu.models import Model
from shardemu.predict.hardware import GB, Hardware


@functools.lru_cache(maxsize=4096)  # a step repeats a few pieces thousands of times
def run_seconds(
    run_flops: float, matmuls: tuple[Matmul, ...], memory_bytes: int, hw: Hardware
) -> float:
    """Seconds of one run of a piece on one device (see the module docstring)."""
    rate, fp8_rate, attention_rate = hw.rates()
    if hw.fp8_tflops is None and any(m.fp8 for m in matmuls):
        raise HardwareError(
            f"hardware {hw.name!r} has no FP8 matmul peak (fp8_tflops), but the program "
            f"multiplies FP8 operands; give the profile fp8_tflops, or plan another precision"
        )

    def computed(m: Matmul) -> float:  # seconds of its FLOPs at its kernel's rate
        return m.flops * m.share / (fp8_rate if m.fp8 else attention_rate if m.fused else rate)

    if hw.memory_gbps is None:
        rest = max(run_flops - sum(m.flops for m in matmuls), 0.0)
        return rest / rate + sum(map(computed, matmuls))
    bandwidth = hw.memory_gbps * hw.memory_efficiency * GB
    latency = hw.matmul_latency_us * 1e-6
    seconds = sum(max(computed(m), m.bytes / bandwidth) + latency for m in matmuls)
    rest = max(run_flops - sum(m.flops for m in matmuls), 0.0)
    return seconds + max(rest / rate, memory_bytes / bandwidth)


def least_step_seconds(flops: float, devices: int, hw: Hardware, fp8: bool = False) -> float:
    """No step that computes `flops` FLOPs over `devices` devices of `hw` is faster:
    each run of a piece takes at least its FLOPs at the fastest rate a kernel of it can
    have (`run_seconds`: each matmul's term, and the rest's, is at least its FLOPs at
    its kernel's rate, `Hardware.rates`; FP8's only with `fp8`), a stage's computations
    run one after another on its compute stream (`costmodel.build_timeline`), and some
    stage computes at least the average share. So no layout's utilisation exceeds the
    fastest kernel's efficiency."""
    rate, fp8_rate, attention_rate = hw.rates()
    fastest = max(rate, attention_rate, fp8_rate if fp8 and hw.fp8_tflops else 0.0)
    return flops / (devices * fastest)


def least_training_step(model: Model, train: TrainConfig, devices: int, hw: Hardware) -> float:
    """`least_step_seconds` of a training step of `train`'s batch and sequence: the
    least FLOPs it computes (`flops.least_training_flops`), FP8's peak where `train`
    runs FP8."""
    step = flops.least_training_flops(model, train.batch, train.seq)
    return least_step_seconds(step, devices, hw, train.precision == "fp8")


def projection_seconds(event: Event, hw: Hardware) -> float:
    """Seconds of a device computation event's matmuls other than attention cores (its
    runs times each matmul's roofline term): what a chunked tensor-parallel collective
    hides behind (`overlap.exposed_chunked`)."""
    if event.run_flops <= 0:
        return 0.0
    runs = event.flops / max(event.devices, 1) / event.run_flops
    matmuls = tuple(m for m in event.matmuls if not m.attention)
    flops = sum(m.flops for m in matmuls)
    return runs * run_seconds(flops, matmuls, 0, hw)


def compute_seconds(event: Event, hw: Hardware) -> float:
    """Seconds of a device computation event: its runs (the FLOPs it holds, which
    schedules, repeats and sparsity scale, over one run's) times one run's roofline."""
    per_device = event.flops / max(event.devices, 1)
    if event.run_flops <= 0:  # no kernels counted: all of it FLOPs at the compute rate
        return run_seconds(per_device, (), 0, hw)
    runs = per_device / event.run_flops
    fused = hw.kernel_fusion == "fused"  # the profile's kernels (`Hardware.kernel_fusion`)
    memory = event.fused_memory_bytes if fused else event.memory_bytes
    return runs * run_seconds(event.run_flops, event.matmuls, memory, hw)
