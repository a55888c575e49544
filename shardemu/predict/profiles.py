"""The built-in hardware profiles (IPU-POD, Cerebras CS-2, A100, H100, TPU), every figure
with its source beside it, and profiles read from TOML or JSON files (`load_profile`:
the same keys as `Hardware`, validated with errors that name the key and the fix).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tomllib
from pathlib import Path
from typing import Any

from shardemu.config import BLOCK_SIZES
from shardemu.config.files import read_text
from shardemu.errors import HardwareError
from shardemu.predict.graphcore import IPU_PROFILES
from shardemu.predict.hardware import (
    A100_ATTENTION,
    GPU_FRAGMENTATION,
    MEASURED_KERNELS_H100,
    MEASURED_ON_H100,
    SPREAD_BORROWED,
    SPREAD_MEASURED,
    Hardware,
    gib,
)

log = logging.getLogger("shardemu")


def _nvml(mib: int) -> float:
    """GB of device memory from NVML's total (nvidia-smi's `memory.total`, in MiB).

    NVIDIA's datasheets give HBM as a round number of "GB" that NVML reports in binary
    units, 6.8-7.4% more bytes than decimal GB: an "80 GB" A100 has 81,920 MiB, 85.9 GB
    (Modal, "Why does an NVIDIA H100 80GB card offer 85.52 GB?",
    thundergolfer.com/blog/nvidia-gpu-memory-capacity: NVML's totals of the A100 40GB and
    80GB, H100 SXM and H200). A profile holds what the device has, not the datasheet's
    round number. Not taken off: what CUDA and its context keep (PyTorch reports 79.15
    GiB of an A100 80GB's 80 GiB), about 1-2%, inside the fragmentation band."""
    return gib(mib / 1024)


def _gpu(
    name: str,
    tflops: float,
    tf32: float,
    hbm_gb: float,
    hbm_gbps: float,
    nvlink: float,
    pcie: float,
    ib: float,
    desc: str,
    fp8: float | None = None,
    **figures: Any,
) -> Hardware:
    """An NVIDIA GPU: `tflops` BF16/FP16 dense; FP32 matmuls run on the tensor cores as
    TF32 (`tf32`), as XLA's default precision and cuBLAS's TF32 mode do on Ampere and
    Hopper; `fp8` dense FP8 (Hopper and later; `--precision fp8`); `figures`, the
    profile's own estimates over the borrowed ones."""
    estimates = {"efficiency_spread": SPREAD_BORROWED, **MEASURED_ON_H100, **figures}
    return Hardware(
        name=name,
        peak_tflops=tflops,
        fp32_tflops=tf32,
        fp8_tflops=fp8,
        precisions=("fp32", "bf16", "fp16-mixed") + (("fp8",) if fp8 else ()),
        device_memory_gb=hbm_gb,
        host_memory_gb=128.0,  # DGX A100: 1 TB (2 TB option) / 8 GPUs; DGX H100: 2 TB / 8
        host_link_gbps=pcie,
        intra_node_gbps=nvlink,
        inter_node_gbps=ib,
        devices_per_node=8,
        host_tflops=2.0,
        description=desc,
        memory_gbps=hbm_gbps,
        **estimates,  # the H100 sets its own spread: SPREAD_MEASURED
        **GPU_FRAGMENTATION,
        nic_per_device=True,  # DGX / HGX nodes: a NIC a GPU (`ib`), NVLink between them
    )


def _tpu(
    name: str,
    tflops: float,
    hbm_gb: float,
    hbm_gbps: float,
    host_gb: float,
    ici: float,
    chips_per_host: int = 4,
    torus: str = "3D",
) -> Hardware:
    """A TPU chip, `chips_per_host` per host; `ici` GB/s per direction inside and across
    hosts (one torus); the host link (16 GB/s, PCIe) is our estimate. The MXU multiplies
    bfloat16: FP32 matmuls take three bfloat16 passes (XLA's `HIGH` precision, bf16_3x),
    so a third of the peak (our estimate), and there is no FP16 or FP8 arithmetic."""
    return Hardware(
        name=name,
        peak_tflops=tflops,
        fp32_tflops=tflops / 3,
        precisions=("fp32", "bf16"),
        device_memory_gb=hbm_gb,
        host_memory_gb=host_gb,
        host_link_gbps=16.0,
        intra_node_gbps=ici,
        inter_node_gbps=ici,
        devices_per_node=chips_per_host,
        host_tflops=1.0,
        description=f"Google TPU {name.split('-')[1]} ({torus} torus ICI)",
        memory_gbps=hbm_gbps,
        efficiency_spread=SPREAD_BORROWED,
        **MEASURED_ON_H100,
    )


PROFILES: dict[str, Hardware] = {
    **IPU_PROFILES,  # Graphcore's GC200 and Bow IPUs (predict/graphcore.py)
    # Cerebras CS-2 with MemoryX and SwarmX (Hot Chips 33, 2021; MISSION.md): 40 GB of
    # on-wafer SRAM, 850,000 cores; weights stream from MemoryX (up to 2.4 PB) over the
    # system's 1.2 Tb/s I/O (12 x 100 GbE: Cerebras CS-2 datasheet) = 150 GB/s, and SwarmX
    # broadcasts weights / reduces gradients between systems over the same links. Cerebras
    # does not publish a peak FLOP/s; 7,500 TFLOP/s FP16 is a third-party estimate (override
    # it with a profile file). One device = one CS-2 system; MemoryX runs the optimizer.
    # Sparsity: the WSE's dataflow cores compute only on non-zero weights, at any
    # granularity ("a sparse GEMM becomes one AXPY per non-zero weight": MISSION.md; Lie,
    # "Cerebras Architecture Deep Dive", Hot Chips 34, 2022): the dense rate on the
    # non-zeros for every block size.
    # SwarmX (cerebras.net glossary, "SwarmX"; MISSION.md): a tree of broadcast/reduce
    # nodes with 100 Gb/s interfaces and a 1:4 fan-out, reducing gradients at line rate;
    # each system takes weights at up to its 1.2 Tb/s I/O (host_link_gbps above).
    # Not published, so profile keys to override: the latency per tree level (1 us, our
    # estimate of one switch hop), and MemoryX's own rate into the tree (assumed equal
    # to one system's I/O, so that a single system is fed at line rate). MemoryX runs the
    # optimizer; its compute rate is not published either: host_tflops = 10 is our
    # estimate (a profile key). FP32: the WSE computes FP16/cbfloat16 and FP32; its FP32
    # rate is not published either: a quarter of the 16-bit rate is our estimate.
    "cs2": Hardware(
        name="cs2",
        peak_tflops=7500.0,
        device_memory_gb=40.0,
        host_memory_gb=2.4e6,
        host_link_gbps=150.0,
        intra_node_gbps=150.0,
        inter_node_gbps=150.0,
        devices_per_node=1,
        efficiency=0.5,
        host_tflops=10.0,
        description="Cerebras CS-2 (WSE-2) with MemoryX and SwarmX",
        block_sparse_speed=tuple((b, 1.0) for b in BLOCK_SIZES),
        swarmx_fanout=4,
        swarmx_hop_us=1.0,
        memoryx_gbps=150.0,
        fp32_tflops=7500.0 / 4,
        memory_gbps=20e6,  # 20 PB/s of on-wafer memory bandwidth (CS-2 datasheet)
    ),
    # NVIDIA A100 datasheet (2021): 312 TFLOP/s BF16 dense, 156 TF32; 40 GB HBM2 at
    # 1555 GB/s / 80 GB HBM2e at 2039 GB/s (NVML: 40,960 / 81,920 MiB, `_nvml`);
    # NVLink 3: 600 GB/s per GPU (300 per direction); PCIe Gen4 x16: 32 GB/s per direction.
    # DGX A100: 8 GPUs per node, 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
    "a100-40gb": _gpu(
        "a100-40gb",
        312.0,
        156.0,
        _nvml(40960),
        1555.0,
        300.0,
        32.0,
        25.0,
        "NVIDIA A100 40GB, DGX A100 nodes, HDR IB",
        attention_efficiency=A100_ATTENTION,
    ),
    "a100-80gb": _gpu(
        "a100-80gb",
        312.0,
        156.0,
        _nvml(81920),
        2039.0,
        300.0,
        32.0,
        25.0,
        "NVIDIA A100 80GB, DGX A100 nodes, HDR IB",
        attention_efficiency=A100_ATTENTION,
    ),
    # NVIDIA H100 datasheet: SXM5 989 TFLOP/s BF16 dense, 494.5 TF32 dense (989 with
    # sparsity), 1979 FP8 dense (3958 with sparsity); 80 GB HBM3 (NVML: 81,559 MiB) at
    # 3.35 TB/s; NVLink 4: 900 GB/s
    # per GPU (450 per direction); PCIe Gen5 x16: 64 GB/s per direction. DGX H100: 8 GPUs,
    # 8 x 400 Gb/s NDR InfiniBand = 50 GB/s per GPU.
    "h100-sxm": _gpu(
        "h100-sxm",
        989.0,
        494.5,
        _nvml(81559),
        3350.0,
        450.0,
        64.0,
        50.0,
        "NVIDIA H100 SXM5, DGX H100 nodes, NDR IB",
        fp8=1979.0,
        efficiency_spread=SPREAD_MEASURED,  # where the roofline's figures were measured
        **MEASURED_KERNELS_H100,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (2024): the H100 SXM's compute (989 TFLOP/s
    # BF16 dense, 494.5 TF32 dense, 1979 FP8 dense) with 141 GB of HBM3e (NVML: 143,771
    # MiB) at 4.8 TB/s;
    # NVLink 4 at 900 GB/s per GPU (450 per direction), PCIe Gen5 x16; DGX H200: 8 GPUs,
    # 8 x 400 Gb/s NDR InfiniBand = 50 GB/s per GPU.
    # Its FP8 and fused-attention rates are the H100's, which an H200 matched within 3%
    # (benchmarks/measured/kernel_rates_torch_h200.json; `MEASURED_KERNELS_H100`).
    "h200-sxm": _gpu(
        "h200-sxm",
        989.0,
        494.5,
        _nvml(143771),
        4800.0,
        450.0,
        64.0,
        50.0,
        "NVIDIA H200 SXM, DGX H200 nodes, NDR IB",
        fp8=1979.0,
        **MEASURED_KERNELS_H100,
    ),
    # NVIDIA B200 in an HGX / DGX B200 at 1000 W (NVIDIA Blackwell architecture technical
    # brief, as tabulated at glennklockwood.com/garden/processors/B200): 2250 TFLOP/s
    # BF16 dense, 1100 TF32 dense, 4500 FP8 dense (twice each with 2:4 sparsity). DGX B200
    # datasheet: 1,440 GB of HBM3e for 8 GPUs (180 GB each; NVML: 183,359 MiB, as
    # nvidia-smi lists a DGX B200's GPUs with driver 570) at 8 TB/s per GPU; NVLink 5
    # at 1.8 TB/s per GPU (900 GB/s per direction); 8 x 400 Gb/s ConnectX-7 = 50 GB/s
    # per GPU; the host link is PCIe Gen5 x16 (64 GB/s per direction) as on DGX H100.
    # The roofline's efficiency, matmul latency, FP8 and attention rates: the H100's GEMM
    # figures (unmeasured here; the H100's attention figure is a Hopper kernel's).
    "b200": _gpu(
        "b200",
        2250.0,
        1100.0,
        _nvml(183359),
        8000.0,
        900.0,
        64.0,
        50.0,
        "NVIDIA B200 (HGX/DGX B200, 1000 W), NDR IB",
        fp8=4500.0,
    ),
    # NVIDIA GB200 NVL72 (NVIDIA's GB200 NVL72 page: 72 Blackwell GPUs and 36 Grace CPUs
    # a rack, one NVLink domain of 130 TB/s, 13.4 TB of HBM3e at 576 TB/s; the Blackwell
    # architecture technical brief's GB200 figures at 1200 W, as tabulated at
    # glennklockwood.com/garden/processors/B200): 2500 TFLOP/s BF16 dense, 1250 TF32
    # dense, 5000 FP8 dense a GPU; 186 GB of HBM3e (NVML: 189,471 MiB, as nvidia-smi lists
    # a GB200 tray's GPUs) at 8 TB/s a GPU; NVLink 5 at 1.8 TB/s a
    # GPU (900 per direction) to all 72 GPUs of the rack (one node here); each Grace's
    # 480 GB of LPDDR5X serves its two GPUs over NVLink-C2C at 900 GB/s (450 per
    # direction); between racks 400 Gb/s InfiniBand a GPU (50 GB/s). The roofline's
    # figures as the B200's.
    "gb200-nvl72": dataclasses.replace(
        _gpu(
            "gb200-nvl72",
            2500.0,
            1250.0,
            _nvml(189471),
            8000.0,
            900.0,
            450.0,
            50.0,
            "NVIDIA GB200 NVL72: 72 Blackwell GPUs a rack in one NVLink domain",
            fp8=5000.0,
        ),
        devices_per_node=72,
        host_memory_gb=240.0,
    ),
    # Google Cloud TPU docs, "TPU v4": 275 TFLOP/s BF16 per chip, 32 GiB HBM2 at
    # 1200 GB/s, 4096 chips per pod with 1.1 PB/s of all-reduce bandwidth per pod: 269 GB/s
    # per chip, our per-direction collective bandwidth. Host link (PCIe) and host memory
    # per chip are our estimates (4 chips per host); override them with a profile file.
    "tpu-v4": _tpu(
        "tpu-v4", tflops=275.0, hbm_gb=gib(32), hbm_gbps=1200.0, host_gb=100.0, ici=269.0
    ),
    # Google Cloud TPU docs, "TPU v5p": 459 TFLOP/s BF16 per chip, 95 GB HBM2e at
    # 2765 GB/s, inter-chip interconnect 4800 Gbps per chip (1200 GB/s bidirectional:
    # 600 GB/s per direction), data-center network 50 Gbps per chip; 4 chips per host
    # (the 2x2x1 slice is one host) with 448 GB of RAM; the host link is our estimate.
    "tpu-v5p": _tpu(
        "tpu-v5p", tflops=459.0, hbm_gb=95.0, hbm_gbps=2765.0, host_gb=112.0, ici=600.0
    ),
    # Google Cloud TPU docs, "TPU v5e": 197 TFLOP/s BF16 per chip, 16 GB HBM2 at 819
    # GB/s, 400 GB/s bidirectional ICI per chip (200 per direction), 8 chips and 512 GiB
    # of DRAM per host (64 GiB a chip), 256 chips per pod in a 2D torus.
    "tpu-v5e": _tpu(
        "tpu-v5e", 197.0, 16.0, 819.0, gib(512 / 8), 200.0, chips_per_host=8, torus="2D"
    ),
    # Google Cloud TPU docs, "TPU v6e" (Trillium): 918 TFLOP/s BF16 per chip, 32 GiB of HBM
    # ("Trillium's 32GiB of HBM": maxtext, docs/guides/optimization/custom_model.md) at
    # 1638 GB/s, 800 GB/s bidirectional ICI per chip (400 per direction), 8 chips and 1536
    # GiB of DRAM per host (192 GiB a chip), 256 chips a pod in a 2D torus.
    "tpu-v6e": _tpu("tpu-v6e", 918.0, gib(32), 1638.0, gib(1536 / 8), 400.0, 8, "2D"),
}


def get_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name, or one loaded from a .toml / .json file."""
    if not isinstance(name_or_path, str | Path):
        raise HardwareError(
            f"get_hardware takes a profile name ({', '.join(sorted(PROFILES))}) or a .toml / "
            f".json path, got {name_or_path!r}"
        )
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".toml", ".json"):
        return load_profile(path)
    raise HardwareError(
        f"unknown hardware {name_or_path!r}; use one of {', '.join(sorted(PROFILES))}, or a "
        f"profile file ending in .toml or .json"
    )


def load_profile(path: str | Path) -> Hardware:
    """A profile from TOML or JSON with `Hardware`'s keys; `base = "NAME"` starts from a
    built-in profile and overrides the keys given."""
    path = Path(path)
    text = read_text(path, "hardware profile", HardwareError)
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise HardwareError(f"hardware profile {str(path)!r} does not parse: {err}") from None
    if not isinstance(data, dict):
        raise HardwareError(
            f"hardware profile {str(path)!r} holds a {type(data).__name__}; it must be a "
            f"table (TOML) or an object (JSON) of Hardware keys, e.g. peak_tflops = 312"
        )
    for key in ("name", "description", "base"):
        if not isinstance(data.get(key, ""), str):
            raise HardwareError(
                f"hardware profile {str(path)!r}: {key} must be a string, got {data[key]!r}"
            )
    fields = {f.name for f in dataclasses.fields(Hardware)}
    base = data.pop("base", None)
    unknown = sorted(set(data) - fields)
    if unknown:
        raise HardwareError(
            f"hardware profile {str(path)!r}: unknown key(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(fields))}"
        )
    if base is not None:
        if base not in PROFILES:
            raise HardwareError(f"hardware profile {str(path)!r}: unknown base {base!r}")
        profile = dataclasses.replace(PROFILES[base], **{"name": path.stem, **data})  # checked
        fp32 = PROFILES[base].fp32_tflops
        if "peak_tflops" in data and "fp32_tflops" not in data and fp32 is not None:
            log.warning(
                "hardware profile %s: peak_tflops sets the 16-bit peak only; an fp32 plan "
                "computes at %s's fp32_tflops = %g (give fp32_tflops to change that too)",
                path, base, fp32,
            )  # fmt: skip
        return profile
    missing = sorted(
        f.name
        for f in dataclasses.fields(Hardware)
        if f.default is dataclasses.MISSING and f.name not in data and f.name != "name"
    )
    if missing:
        raise HardwareError(
            f"hardware profile {str(path)!r} is missing {', '.join(missing)}; give them, or "
            f'start from a built-in profile with base = "a100-80gb" (for example)'
        )
    return Hardware(**{"name": path.stem, **data})
