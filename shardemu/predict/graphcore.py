"""Graphcore's IPU profiles: the GC200 in IPU-PODs of IPU-M2000s, and the Bow IPU in Bow
Pods of Bow-2000s, every figure with its source.

The IPU's one compute figure that no datasheet gives, the fraction of its peak that a
transformer layer's step reaches (`IPU_EFFICIENCY`), is calibrated on one published run
(`benchmarks/ipu_calibration.py`) and validated on others (`benchmarks/validation.py`).
"""

from __future__ import annotations

import dataclasses

from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import Overlap

# Calibrated 2026-11-27 (`python benchmarks/ipu_calibration.py`): the efficiency at which
# BERT-Large phase 1 (sequence 128) on a Bow Pod16, as Graphcore's TensorFlow 2 example
# ran it, is planned at its published 4528 sequences/s (graphcore.cn "Performance
# Results", Bow Pod16, SDK 3.1; graphcore/examples nlp/bert/tensorflow2 configs). It
# holds on both chips: the Bow's processor wafer is architecturally the GC200 (1,472
# tiles, 900 MB), clocked faster (Bow-2000 datasheet; TSMC/Graphcore, March 2022).
# Validated, not fitted, on BERT-Base on a Bow Pod16, BERT-Large on a Bow Pod64 and
# BERT-Base phase 2 on a GC200 IPU-POD16 (docs/results.md). Before it, the profiles
# assumed 0.4 unmeasured, and the GC200 row came out 23% fast.
IPU_EFFICIENCY = 0.306

# The IPU runs bulk-synchronous: local compute, global synchronisation and data exchange
# alternate (Graphcore, Memory and Performance Optimisation Guide, section 2.1); gradients
# are all-reduced once a step, after the accumulation, and pipeline exchanges block.
BULK_SYNCHRONOUS = Overlap(grad_reduce="end", pipe_sends="blocking")


def _ipu(name: str, ipus: int) -> Hardware:
    """A GC200 IPU in an IPU-POD of `ipus` IPUs (IPU-M2000s of 4 IPUs each).

    - 250 TFLOP/s FP16.16 per IPU (1 PFLOP/s per IPU-M2000 of 4), 62.5 TFLOP/s FP32:
      Graphcore IPU-M2000 datasheet, "Overview" (250 TFLOP/s FP32 per machine). The IPU
      computes in FP16 and FP32 only: no bfloat16 (Graphcore, "Mixed-Precision
      Arithmetic for AI: A Hardware Perspective").
    - 900 MB In-Processor-Memory per IPU: same datasheet; MISSION.md.
    - Streaming Memory: "typically 256 GB" per IPU-M2000 (MISSION.md; Bow-2000 datasheet:
      "up to 256GB Streaming Memory"), so 64 GB per IPU.
    - Streaming Memory bandwidth: Graphcore does not publish one figure; 20 GB/s per IPU
      is our estimate of the IPU-M2000's DDR4 path through the IPU-Gateway (measure and
      override it with a profile file).
    - IPU-Links: 320 GB/s per IPU (Colossus Mk2 GC200 figures, Graphcore; 10 links):
      160 GB/s per direction inside an IPU-M2000.
    - Block-sparse matmuls: PopSparse (Li et al. 2023, arXiv 2303.16999, abstract:
      "our static sparse implementation outperforms equivalent dense calculations in
      FP16 at lower sparsity (around 90%)", with large matrices and block size 16): at
      least break-even at density 0.1 with 16 x 16 blocks, i.e. speed 0.1 of the dense
      rate on the non-zero blocks. The paper's per-block-size figures are not in our
      sources, so smaller blocks run masked dense (no gain), and static and dynamic
      patterns share the figure although the paper finds dynamic slower.
    - IPU-Fabric between IPU-M2000s: 2.8 Tbps per IPU-M2000 through the IPU-Gateway
      (Graphcore launch, July 2020) = 350 GB/s per machine, 87.5 GB/s per IPU, halved per
      direction: 43.75 GB/s.
    - In-Processor-Memory bandwidth: 47.5 TB/s per IPU (GC200 datasheet); its per-kernel
      fixed cost is not published, so none is charged.
    - Efficiency: `IPU_EFFICIENCY`, calibrated.
    """
    return Hardware(
        name=name,
        peak_tflops=250.0,
        device_memory_gb=0.9,
        host_memory_gb=64.0,
        host_link_gbps=20.0,
        intra_node_gbps=160.0,
        inter_node_gbps=43.75,
        devices_per_node=4,
        efficiency=IPU_EFFICIENCY,
        host_tflops=0.5,
        description=f"Graphcore IPU-POD{ipus}: {ipus} GC200 IPUs in IPU-M2000s of 4",
        block_sparse_speed=((16, 0.1),),
        fp32_tflops=62.5,
        precisions=("fp32", "fp16-mixed"),
        memory_gbps=47_500.0,
    )


# The Bow IPU runs the GC200's tiles 1.4x faster: 1.4 PFLOP/s FP16.16 per Bow-2000 of 4
# IPUs (Bow-2000 datasheet, "Overview") against the IPU-M2000's 1 PFLOP/s, 1.85 GHz against
# the GC200's 1.33 GHz (Graphcore's Bow launch, March 2022), the same 900 MB a tile's
# worth at a time ("3.6GB In-Processor-Memory" per Bow-2000). The datasheet gives no FP32
# rate or In-Processor-Memory bandwidth: both are the GC200's scaled by the clock, our
# estimate. The Bow-2000 keeps the IPU-M2000's links, gateway and Streaming Memory ("up to
# 256GB"; "backwards compatible with the IPU-M2000", Bow Pod64 datasheet).
BOW_SPEEDUP = 1.4


def _bow(name: str, ipus: int) -> Hardware:
    """A Bow IPU in a Bow Pod of `ipus` IPUs (Bow-2000s of 4): the GC200's profile with
    its compute and on-chip memory bandwidth `BOW_SPEEDUP` faster."""
    gc200 = _ipu(name, ipus)
    return dataclasses.replace(
        gc200,
        peak_tflops=gc200.peak_tflops * BOW_SPEEDUP,
        fp32_tflops=gc200.fp32_tflops * BOW_SPEEDUP,
        memory_gbps=gc200.memory_gbps * BOW_SPEEDUP,
        description=f"Graphcore Bow Pod{ipus}: {ipus} Bow IPUs in Bow-2000s of 4",
    )


IPU_PROFILES: dict[str, Hardware] = {
    **{f"ipu-pod{n}": _ipu(f"ipu-pod{n}", n) for n in (16, 64, 128, 256)},
    "ipu-gc200": dataclasses.replace(
        _ipu("ipu-gc200", 4), description="one GC200 IPU (in an IPU-M2000)"
    ),
    **{f"bow-pod{n}": _bow(f"bow-pod{n}", n) for n in (16, 64, 256)},
}
