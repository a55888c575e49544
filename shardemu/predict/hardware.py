"""A hardware profile: what one device computes and holds, and how fast bytes move
(the built-in ones, with their sources, and profile files: `profiles.py`).

A profile describes one device (an IPU, a CS-2 system, a GPU, a TPU chip) and the links
around it. Devices are grouped into nodes of `devices_per_node` (an IPU-M2000, an 8-GPU
NVLink box, a TPU host); a collective whose devices all sit in one node uses
`intra_node_gbps`, else `inter_node_gbps` (times the group's devices in a node, for a
ring collective on a profile with a NIC a device: `nic_per_device`). All bandwidths
are per device and per direction, in GB/s (10^9 bytes/s). `efficiency` is the one
calibration constant per profile: the fraction of peak FLOP/s that compute achieves
(see benchmarks/validation.py; it is not tuned per result).

Every figure cites its source next to it. Users add profiles from TOML or JSON with the
same keys (`load_profile`), validated with errors that name the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shardemu.config import BLOCK_SIZES, PRECISIONS
from shardemu.errors import HardwareError

GB = 1e9


def gib(n: float) -> float:
    """GB (the profiles' unit, 10^9 bytes) of `n` GiB (2^30 bytes): the unit NVML and
    the TPU docs give device memory in."""
    return n * 2**30 / GB


# The roofline's GPU parameters, measured with XLA (JAX 0.11.2) on an H100 SXM
# (benchmarks/gpu_calibration.py): 248 bfloat16 and float32 matmuls from 64^3 to 16384^3
# fit a large-matmul efficiency of 0.73 and a fixed 13.5 us per matmul kernel (median
# |log error| 0.12). The sweep, run again on a lent H100 on 2026-11-26, is stored
# (benchmarks/measured/gpu_calibration_h100_matmuls.json) and `benchmarks/matmul_fit.py`
# times it with the roofline: these figures 0.120 median |log error|, its least-squares
# pair (0.72, 12.0 us) 0.111, so they stay. The same sweep on a lent H200
# (gpu_calibration_h200_matmuls.json) gives its bfloat16 rows 0.116 and a mean log
# error of +0.007 with them on `h200-sxm`, which keeps them (its TF32 matmuls ran 13%
# slower than this model: `--precision fp32` on an H200 is that optimistic); an elementwise
# kernel over 4 GiB moves 2.77 TB/s of the datasheet's 3.35 (0.83). The A100 and TPU
# profiles share them: our assumption, unmeasured there. The IPU and CS-2 profiles keep
# their own efficiencies: the IPU's (0.306) calibrated on one published Bow Pod16 run
# (predict/graphcore.py), the CS-2's (0.5) with no measurement.
KERNEL_FUSION = ("emitted", "fused")  # `Hardware.kernel_fusion`
MEASURED_ON_H100 = {"efficiency": 0.73, "matmul_latency_us": 13.5, "memory_efficiency": 0.83}
# The two matmul kernels whose rate a GEMM's efficiency does not give, measured on an H100
# SXM at its 700 W limit (benchmarks/kernel_rates.py, PyTorch 2.11, CUDA 13;
# benchmarks/measured/kernel_rates_torch.json; calibration, 2026-11-26):
# - FP8 (`fp8_efficiency`): torch._scaled_mm (cuBLASLt, E4M3, per-tensor scales, BF16
#   output, as torchao's float8 training calls it) on Llama 3 8B's projections at 16k
#   tokens and on 8192^3: 1211-1348 TFLOP/s, median 0.65 of 1979 (BF16 in the same run:
#   0.74 of 989, the GEMM calibration's 0.73);
# - fused attention (`attention_efficiency`): head width 128, sequences 2k to 128k,
#   causal and not, forward + backward with FLOPs as FlashAttention counts them (3.5 x
#   the forward's): cuDNN's kernel, which PyTorch 2.11's scaled_dot_product_attention
#   picks on an H100 (benchmarks/measured/torch_llama_layers.json, `default_sdpa`) and
#   JAX's cuDNN path runs, 438-569 TFLOP/s, median 0.55 of 989 (JAX's 0.54);
#   FlashAttention-2, PyTorch's default from 2.5.1 (cuDNN's opt-in: pytorch/pytorch
#   issue 138649, October 2024) until cuDNN's, 246-328 TFLOP/s, median 0.33: a run of
#   that time gives `FLASH_ATTENTION_2_H100`.
# A Llama 3 8B layer in PyTorch on the same H100 (benchmarks/torch_layers.py),
# predicted from these figures within 0-7% (benchmarks/torch_layers_check.py): validation.
# On a lent H200 (700 W) the same kernels ran at 0.54 (cuDNN), 0.33 (FlashAttention-2),
# 0.67 (FP8) and its layers within 4% (kernel_rates_torch_h200.json,
# torch_llama_layers_h200.json): the H200 takes the H100's figures.
MEASURED_KERNELS_H100 = {"attention_efficiency": 0.55, "fp8_efficiency": 0.65}
FLASH_ATTENTION_2_H100 = 0.33
# FlashAttention-2 reaches "50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023,
# "FlashAttention-2", abstract): its middle for forward + backward, our assumption.
A100_ATTENTION = 0.62
# How well those are known (`Hardware.efficiency_spread`): on the H100, the fit's median
# |log error| (0.12, same calibration); on the GPUs and TPUs that borrow them, 0.2, our
# assumption, between that and the 0.3 we assume where nothing was measured.
SPREAD_MEASURED, SPREAD_BORROWED = 0.12, 0.2
# PyTorch's CUDA caching allocator, which Megatron-LM, DeepSpeed and Transformer Engine
# runs use, leaves fragmented memory it cannot hand out: 15% on average, 33% at worst,
# over eight LLMs trained on A100-80GB (Guo et al., "GMLake", ASPLOS 2024, abstract: the
# fragmentation their stitching allocator removes); ZeRO (Rajbhandari et al., SC 2020,
# section 3.2) saw out-of-memory with over 30% of memory free. XLA on TPUs, Poplar on
# IPUs and the CS-2 assign every buffer when they compile: no fragmentation is charged.
GPU_FRAGMENTATION = {"memory_fragmentation": 0.15, "memory_fragmentation_max": 0.33}


def _real(value: Any) -> bool:
    """A finite int or float (not a bool, not NaN, not infinite)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense 16-bit matmul peak per device, TFLOP/s (bf16, fp16-mixed)
    device_memory_gb: float  # in-processor memory / HBM per device
    host_memory_gb: float  # streaming memory / host DRAM available per device
    host_link_gbps: float  # host tier <-> device, per device, per direction
    intra_node_gbps: float  # device <-> device inside a node, per device, per direction
    inter_node_gbps: float  # device <-> device across nodes, per device, per direction
    devices_per_node: int
    efficiency: float = 0.5  # achieved / peak FLOP/s for model compute (one per profile)
    host_tflops: float = 1.0  # optimizer updates run in the host tier at this rate
    description: str = ""
    # (block size, speed): the FLOP/s a block-sparse matmul achieves on its non-zero
    # blocks, as a fraction of the dense rate. A block size not listed runs as a masked
    # dense matmul (no faster than dense). TOML: block_sparse_speed = [[16, 0.1]]
    block_sparse_speed: tuple[tuple[int, float], ...] = ()
    # Weight streaming (SwarmX between MemoryX and the systems): a tree of broadcast /
    # reduce nodes with `swarmx_fanout` children each, `swarmx_hop_us` of latency per
    # level, reducing at line rate; MemoryX feeds (and takes from) the tree at
    # `memoryx_gbps` (None: no limit beyond each system's host link).
    swarmx_fanout: int = 4
    swarmx_hop_us: float = 1.0
    memoryx_gbps: float | None = None
    # FP32 matmul peak per device, TFLOP/s (`--precision fp32`); None: a profile that
    # does not tell them apart, whose FP32 runs at peak_tflops
    fp32_tflops: float | None = None
    # the `--precision` modes the device computes in (IPUs have no bfloat16, TPUs no
    # fp16; `fp8` only with `fp8_tflops`)
    precisions: tuple[str, ...] = ("fp32", "bf16", "fp16-mixed")
    # FP8 matmul peak per device, TFLOP/s: the rate of a matmul on FP8 operands
    # (`--precision fp8`; `roofline.py`); None: a device without FP8 tensor cores
    fp8_tflops: float | None = None
    # the roofline (`roofline.py`): device memory bandwidth per device, GB/s (None: time
    # computations as FLOPs at peak x efficiency), the fraction of it kernels achieve,
    # and the fixed cost of one matmul kernel
    memory_gbps: float | None = None
    memory_efficiency: float = 1.0
    matmul_latency_us: float = 0.0
    # which kernels the roofline times the non-matmul bytes of: "emitted", those XLA's
    # CPU backend compiled (a ceiling: it splits a layer's elementwise work into more
    # kernels than an accelerator), or "fused", the work between two matmuls fused into
    # one kernel as XLA on a GPU or TPU and Transformer Engine's kernels fuse it
    # (`accounting/fusion.py`: a floor). The validation (docs/results.md) is "emitted"'s,
    # but for its FP8 rows (`fp8_kernel_fusion`).
    kernel_fusion: str = "emitted"
    # the same, for an `fp8` layout (`at_precision`). FP8 is trained through stacks that
    # fuse its amax and casts into the neighbouring kernels (Transformer Engine's
    # LayerNormLinear casts the norm's output to FP8 in the norm's kernel, and its
    # cast_transpose makes the FP8 copy and its transpose in one pass; NVIDIA TE docs,
    # "Using FP8 with Transformer Engine"), where XLA's CPU backend emits each amax,
    # scale and cast as kernels of their own. Measured on an H100 (PyTorch 2.11,
    # benchmarks/torch_fp8_forward.py, benchmarks/measured/torch_fp8_forward.json):
    # a Llama 3 8B layer's forward with FP8 projections took 17.9 ms with its casts as
    # separate passes, 9.7 ms through torch.compile (Inductor fuses them), 9.1 ms with
    # its weights cast once; the roofline's FP8 forward piece is 12.8 ms emitted and
    # 10.3 ms fused. Calibration of this choice, not of a validation row.
    fp8_kernel_fusion: str = "fused"
    # The estimates a prediction rests on, whose spread is its low-high band
    # (`predict/band.py`): `efficiency` is known within a factor e^(+-efficiency_spread)
    # (0.3 where it is unmeasured: our assumption), and the allocator cannot hand out
    # `memory_fragmentation` of the device memory (the band: none to
    # `memory_fragmentation_max`). Profiles give their figures and sources.
    efficiency_spread: float = 0.3
    memory_fragmentation: float = 0.0
    memory_fragmentation_max: float = 0.0
    # Each device has its own link out of its node (`inter_node_gbps`: a GPU's NIC in a
    # DGX), and reaches its node's other links over `intra_node_gbps`: a ring collective
    # (all-reduce, all-gather, reduce-scatter) whose group holds k devices of each node
    # splits its traffic over their k links (NCCL: "we can use NVLink to split the
    # operations in N parts then balance the traffic onto the N NICs", NVIDIA/nccl issue
    # 601), so each device moves its bytes at k x `inter_node_gbps`, at most
    # `intra_node_gbps` (`durations.collective_gbps`). False: one device's link is all a
    # collective across nodes has (an IPU-M2000's gateway, whose figure is already a
    # share of the machine's).
    nic_per_device: bool = False
    # The rates of the two matmul kernels that a plain GEMM's `efficiency` does not
    # describe (`roofline.py`), as fractions of their peak: a fused attention core
    # (FlashAttention: its forward's two products and its backward's five, the scores
    # recomputed, as FlashAttention counts them; `Matmul.fused`) of `peak_tflops`, and
    # an FP8 matmul of `fp8_tflops`. None: `efficiency` (a profile that does not tell
    # them apart). Both follow `efficiency` across the band (`band.py`).
    attention_efficiency: float | None = None
    fp8_efficiency: float | None = None

    def __post_init__(self) -> None:
        for key in (
            "peak_tflops",
            "device_memory_gb",
            "host_memory_gb",
            "host_link_gbps",
            "intra_node_gbps",
            "inter_node_gbps",
            "host_tflops",
        ):
            value = getattr(self, key)
            if not _real(value) or value <= 0:
                raise HardwareError(
                    f"hardware {self.name!r}: {key} must be a finite positive number, got {value!r}"
                )
            if key.endswith("_gb") and value * GB >= 2**63:  # bytes are counted in int64
                raise HardwareError(
                    f"hardware {self.name!r}: {key} = {value!r} is more memory than any "
                    f"machine holds (at most {2**63 / GB:.3g} GB)"
                )
        if not isinstance(self.nic_per_device, bool):
            raise HardwareError(
                f"hardware {self.name!r}: nic_per_device must be true or false, got "
                f"{self.nic_per_device!r}"
            )
        for key, least in (("devices_per_node", 1), ("swarmx_fanout", 2)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                what = "a positive integer" if least == 1 else f"an integer of at least {least}"
                raise HardwareError(f"hardware {self.name!r}: {key} must be {what}, got {value!r}")
        for key in ("swarmx_hop_us", "matmul_latency_us"):
            value = getattr(self, key)
            if not (_real(value) and value >= 0):
                raise HardwareError(
                    f"hardware {self.name!r}: {key} must be a finite number >= 0, got {value!r}"
                )
        for key, left_out in (
            ("memoryx_gbps", "no limit"),
            ("memory_gbps", "no roofline"),
            ("fp32_tflops", "FP32 at peak_tflops"),
            ("fp8_tflops", "no FP8"),
        ):
            value = getattr(self, key)
            if value is not None and not (_real(value) and value > 0):
                raise HardwareError(
                    f"hardware {self.name!r}: {key} must be a finite positive number (or "
                    f"left out: {left_out}), got {value!r}"
                )
        self._check_precisions()
        self._check_estimates()
        for key in ("kernel_fusion", "fp8_kernel_fusion"):
            if getattr(self, key) not in KERNEL_FUSION:
                raise HardwareError(
                    f"hardware {self.name!r}: {key} must be one of "
                    f"{', '.join(KERNEL_FUSION)}, got {getattr(self, key)!r}"
                )
        if not isinstance(self.block_sparse_speed, list | tuple) or not all(
            isinstance(pair, list | tuple) for pair in self.block_sparse_speed
        ):
            raise HardwareError(
                f"hardware {self.name!r}: block_sparse_speed is a list of [block, speed] "
                f"pairs such as [[16, 0.1]], got {self.block_sparse_speed!r}"
            )
        speeds = tuple(tuple(pair) for pair in self.block_sparse_speed)
        object.__setattr__(self, "block_sparse_speed", speeds)  # lists from a profile file
        for pair in speeds:
            if (
                len(pair) != 2
                or pair[0] not in BLOCK_SIZES
                or not (_real(pair[1]) and 0 < pair[1] <= 1)
            ):
                raise HardwareError(
                    f"hardware {self.name!r}: block_sparse_speed entries are [block, speed] "
                    f"with block in {BLOCK_SIZES} and speed in (0, 1], got {list(pair)!r}"
                )

    def _check_estimates(self) -> None:
        """The efficiencies in (0, 1] (the kernels' own left out or so), and the band's
        spreads: efficiency_spread >= 0, 0 <= memory_fragmentation <=
        memory_fragmentation_max < 1."""
        optional = ("attention_efficiency", "fp8_efficiency")  # left out: `efficiency`
        for key in ("efficiency", "memory_efficiency", *optional):
            value = getattr(self, key)
            if not (value is None and key in optional or _real(value) and 0 < value <= 1):
                raise HardwareError(
                    f"hardware {self.name!r}: {key} must be in (0, 1], got {value!r}"
                )
        spread = self.efficiency_spread
        if not (_real(spread) and 0 <= spread <= 1):
            raise HardwareError(
                f"hardware {self.name!r}: efficiency_spread must be in [0, 1] (efficiency "
                f"known within a factor e^spread), got {spread!r}"
            )
        low, high = self.memory_fragmentation, self.memory_fragmentation_max
        if not (_real(low) and _real(high) and 0 <= low <= high < 1):
            raise HardwareError(
                f"hardware {self.name!r}: memory_fragmentation ({low!r}) and "
                f"memory_fragmentation_max ({high!r}) must satisfy 0 <= memory_fragmentation "
                f"<= memory_fragmentation_max < 1 (fractions of the device memory)"
            )

    def _check_precisions(self) -> None:
        """`precisions` a non-empty list of known precisions, `fp8` with its peak."""
        if not isinstance(self.precisions, list | tuple):  # a string would split in letters
            raise HardwareError(
                f'hardware {self.name!r}: precisions must be a list such as ["bf16"], got '
                f"{self.precisions!r}"
            )
        object.__setattr__(self, "precisions", tuple(self.precisions))  # a list from a file
        if not self.precisions or any(p not in PRECISIONS for p in self.precisions):
            raise HardwareError(
                f"hardware {self.name!r}: precisions must be a non-empty list of "
                f"{', '.join(PRECISIONS)}, got {list(self.precisions)!r}"
            )
        if ("fp8" in self.precisions) != (self.fp8_tflops is not None):
            raise HardwareError(
                f"hardware {self.name!r}: precisions {list(self.precisions)!r} and "
                f"fp8_tflops = {self.fp8_tflops!r} disagree; a device computes in fp8 "
                f"exactly when it has an FP8 matmul peak (give both, or neither)"
            )

    def kernel_efficiencies(self) -> dict[str, float]:
        """The fraction of its peak each kind of matmul kernel runs at, as the roofline
        times it (`rates`; a left-out figure resolved to `efficiency`): what a report
        states it used."""
        return {
            "matmul": self.efficiency,
            "fused_attention": self.attention_efficiency or self.efficiency,
            "fp8": self.fp8_efficiency or self.efficiency,
        }

    def rates(self) -> tuple[float, float, float]:
        """FLOP/s of a plain matmul, an FP8 matmul and a fused attention core (each its
        peak x its efficiency; FP8 at the 16-bit peak on a profile without one, which
        `roofline.run_seconds` refuses before it multiplies FP8 operands)."""
        kernel = self.kernel_efficiencies()
        peak = self.peak_tflops * 1e12
        fp8_peak = (self.fp8_tflops or self.peak_tflops) * 1e12
        return peak * kernel["matmul"], fp8_peak * kernel["fp8"], peak * kernel["fused_attention"]

    def sparse_time(self, density: float, block: int) -> float:
        """The time of a block-sparse matmul at `density` with `block`-sized blocks, as a
        fraction of the dense matmul's: density / speed, never more than dense (a
        runtime that could not gain would run it dense and masked)."""
        speed = dict(self.block_sparse_speed).get(block)
        return 1.0 if speed is None else min(1.0, density / speed)

    def swarmx_levels(self, systems: int) -> int:
        """Levels of the SwarmX tree between MemoryX and `systems` systems: the depth
        of a `swarmx_fanout`-ary tree with that many leaves, at least one node."""
        levels = 1
        while self.swarmx_fanout**levels < systems:
            levels += 1
        return levels

    def swarmx_seconds(self, link_bytes: int, systems: int) -> float:
        """A broadcast to (or reduce from) `systems` systems of `link_bytes` per link:
        every link carries them at the slower of a system's I/O and MemoryX's rate
        (the tree's nodes forward, and reduce, at line rate), plus one hop latency per
        level (cerebras.net glossary, "SwarmX": nodes grow linearly with the systems,
        latency as log N)."""
        rate = min(self.host_link_gbps, self.memoryx_gbps or math.inf) * GB
        return link_bytes / rate + self.swarmx_levels(systems) * self.swarmx_hop_us * 1e-6

    def at_precision(self, precision: str) -> Hardware:
        """This profile computing in `precision`: `peak_tflops` is that precision's
        peak (FP32's for `fp32`), so step times and utilisation follow from it. Under
        `fp8` it stays the 16-bit peak (the attention core, the head and the other
        kernels run in BF16); matmuls on FP8 operands run at `fp8_tflops`, and the other
        kernels are timed as `fp8_kernel_fusion` says."""
        if precision not in self.precisions:
            raise HardwareError(
                f"hardware {self.name!r} does not compute in TrainConfig.precision {precision}; it "
                f"supports {', '.join(self.precisions)}"
            )
        if precision == "fp8":
            return dataclasses.replace(self, kernel_fusion=self.fp8_kernel_fusion)
        if precision != "fp32" or self.fp32_tflops is None:
            return self
        return dataclasses.replace(self, peak_tflops=self.fp32_tflops)

    @property
    def device_memory_bytes(self) -> int:
        """The device memory a step can use: what the allocator hands out of
        `device_memory_gb`, less `memory_fragmentation` (every fit is judged on it)."""
        return self.usable_device_bytes(self.memory_fragmentation)

    def usable_device_bytes(self, fragmentation: float) -> int:
        """Bytes of device memory an allocator wasting `fragmentation` of it hands out."""
        return int(self.device_memory_gb * GB * (1 - fragmentation))

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_gb * GB)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
