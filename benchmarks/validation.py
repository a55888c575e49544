"""Predicted vs published: the cost model against training runs (A100, H100, TPU, IPU).

Each case is planned in abstract mode (`plan_resident`: one microbatch counted by XLA per
layer, a step assembled from the pipeline schedule, placed on the hardware profile's
streams) with the configuration its source reports, bfloat16 (FP16 on the IPU, which has
no bfloat16) weights and activations with FP32 master weights. Nothing is tuned per case,
and nothing to these cases: the GPU and TPU profiles' roofline parameters were measured
on an H100 (`benchmarks/gpu_calibration.py`, predict/hardware.py), the calibration set, apart
from this validation set; the IPU's efficiency on one BERT-Large run on a Bow Pod16
(`benchmarks/ipu_calibration.py`), which is not a row here. Where the model differs
from ours the FLOPs (or, for a pipeline, its slowest stage) are matched and the
difference named.

Settings a source leaves unstated are its time's common practice, said in the case's
comment; one pair was taken after its effect on the rows was known (Llama 3 405B's
FlashAttention-2 rate and sequence parallelism, 2026-11-28: docs/results.md says so),
and those three rows are weaker evidence for it.

Memory rows (`MEMORY_CASES`): the device bytes a plan holds against published memory
readings and out-of-memory outcomes.

    python benchmarks/validation.py [--out benchmarks/results/validation.json]
    python benchmarks/validation.py --only "FP8" --out /tmp/fp8.json  # matching cases only
    python benchmarks/validation.py --compare OLD.json  # which predictions moved since
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shardemu.config import ModelConfig, Parallelism, TrainConfig
from shardemu.devices import use_virtual_devices
from shardemu.models import custom_model, get_preset
from shardemu.predict.graphcore import BULK_SYNCHRONOUS
from shardemu.predict.hardware import FLASH_ATTENTION_2_H100, gib
from shardemu.predict.overlap import Overlap
from shardemu.predict.plan_resident import plan_resident, plan_resident_auto
from shardemu.predict.profiles import PROFILES


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    model: ModelConfig
    par: Parallelism
    batch: int
    seq: int
    microbatch_size: int  # 0: not published, the planner's choice
    hardware: str
    schedule: str
    virtual: int
    recompute: str
    # "tflops_per_device" (executed, recomputation included), "mfu" or "sequences_per_s"
    metric: str
    published: float
    note: str
    overlap: Overlap = Overlap()  # how the published system overlapped its communication
    attention: str = "materialized"  # or "fused": FlashAttention (layouts.ATTENTION)
    # the fused attention kernel's rate, a fraction of peak, where the run's kernel is not
    # the profile's (None: `Hardware.attention_efficiency`, today's default kernel)
    attention_efficiency: float | None = None
    precision: str = "bf16"  # 16-bit weights and activations, FP32 master weights
    stage_layers: tuple[int, ...] | None = None  # layers per pipeline stage (None: even)
    zero: int = 0  # the ZeRO stage over the data-parallel replicas (`predict/zero.py`)
    sequence_parallel: bool = False  # Korthikanti et al. 2022's (`--sequence-parallel`)
    # the embedding and the loss counted as a layer each in the pipeline split (Megatron-
    # Core's `--account-for-embedding-in-pipeline-split` and `--account-for-loss-in-...`)
    ends_in_split: bool = False


# Megatron-LM as Narayanan et al. 2021 and Korthikanti et al. 2022 ran it: gradients
# all-reduced after the last backward (`train_step` calls `allreduce_gradients()` after
# `forward_backward_func`), pipeline sends that wait for their request before the
# stage computes on (`p2p_communication._communicate`), and those sends scattered over
# the tensor ranks and gathered again (§4.1; on by default in Megatron-LM's 2021 and
# 2022 code, and off under `--sequence-parallel`, which splits the tensor already):
# `predict/overlap.py`.
MEGATRON_2021 = Overlap(grad_reduce="end", pipe_sends="blocking", pipe_scatter_gather=True)
TORCHTITAN_OVERLAP = Overlap(grad_reduce_in_fp32=True)
# Graphcore's TensorFlow 2 BERT phase 1 on Bow Pods (graphcore.cn Performance Results):
# (size, pod, SDK, graphcore/examples config, micro-batch, replicas, sequences/s, our
# layers a stage, Graphcore's layers a stage)
BOW_BERT_RUNS = (
    ("base", "Bow Pod16", "SDK 3.1", "pretrain_base_128_phase1.json", 32, 4, 15157.0,
     (3, 4, 4, 1), "emb+0,4,4,4"),
    ("large", "Bow Pod64", "SDK 3.0", "pretrain_large_128_phase1_POD64.json", 4, 16, 18199.0,
     (4, 7, 7, 6), "emb+3,7,7,7"),
)  # fmt: skip


LLAMA2_13B = custom_model("llama", 40, 5120, 40, 32000, 4096, kv_heads=40, mlp=13824)
LLAMA2_70B = custom_model("llama", 80, 8192, 64, 32000, 4096, kv_heads=8, mlp=28672)
# TorchTitan (Liang et al. 2024), pytorch/torchtitan docs/performance.md, its tables of
# runs on 64 A100 80GB: FSDP2 (ZeRO stage 3) over all 64 GPUs, BF16 compute with FP32
# parameters, gradients and AdamW state, SDPA (FlashAttention), a local batch of 1 or 2
# with no accumulation, sequence 8192 (Llama 3) or 4096 (Llama 2); WPS is tokens a second
# a GPU. Its "selective op" checkpointing is `--recompute selective-op`; its "selective
# layer" (every other layer checkpointed) has no counterpart here and is left out.
TORCHTITAN_A100 = (  # (model, name, sequence, local batch, recomputation, WPS)
    (get_preset("llama3-8b"), "Llama 3 8B", 8192, 1, "selective-op", 2973),
    (get_preset("llama3-70b"), "Llama 3 70B", 8192, 1, "full", 331),
    (LLAMA2_13B, "Llama 2 13B", 4096, 2, "none", 2162),
    (LLAMA2_13B, "Llama 2 13B", 4096, 2, "selective-op", 1904),
    (LLAMA2_70B, "Llama 2 70B", 4096, 1, "selective-op", 355),
    (LLAMA2_70B, "Llama 2 70B", 4096, 2, "full", 353),
)


LLAMA3_405B_8K = Case(
    "Llama 3 405B, 8192 H100",
    "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4: 430 TFLOP/s per GPU, 43% MFU",
    # 126 layers: its interleaved schedule takes one layer from the first and from the
    # last stage so that the first stage's first chunk holds the embedding alone and the
    # last stage's last chunk the output projection and loss alone (Dubey et al. 2024,
    # §3.3.2, "Pipeline parallelism improvements"): the embedding and the loss counted
    # as a layer each in the split (`ends_in_split`), 128 chunks of one, 8 a stage on
    # 16 stages (128 layers until 2026-11-28, the embedding and the head beside the
    # first and the last layer).
    # Full recomputation: with selective or none this layout's plan holds more than
    # an H100's 80 GB (docs/results.md; 2 chunks a stage until 2026-11-27: -18.5%)
    get_preset("llama3-405b"),
    Parallelism(pipe=16, tensor=8, replica=64),
    2048,
    8192,
    1,
    "h100-sxm",
    "interleaved",
    8,
    "full",
    "mfu",
    0.43,
    "the Llama family (grouped-query attention, SwiGLU)",
    # the default Overlap(): FSDP's gradient reduce-scatter overlaps the backward and
    # pipeline sends are asynchronous (Dubey et al. 2024, §3.3)
    # a 2024 H100 stack's fused attention: FlashAttention-2 (Dao 2023), PyTorch's
    # default kernel until cuDNN's (pytorch/pytorch issue 138649, October 2024), at its
    # rate measured on an H100 (`FLASH_ATTENTION_2_H100`, 0.33 of peak; the profile's
    # 0.55 is cuDNN's, until 2026-11-28); the paper does not name its kernel
    attention="fused",
    attention_efficiency=FLASH_ATTENTION_2_H100,
    # Dubey et al. (§3.3.1) cite Korthikanti et al. (2022; MLSys 2023) for their tensor
    # parallelism, whose tensor parallelism splits the layer norms and the activations
    # between the tensor-parallel regions over the sequence (sequence parallelism), as
    # TorchTitan, Meta's PyTorch-native stack, pairs it with tensor parallelism (Liang et
    # al. 2024); the paper does not say so in words. Off until 2026-11-28
    # (docs/results.md: its effect was measured before it was taken)
    sequence_parallel=True,
    # FSDP over the data-parallel groups: "we shard the optimizer states and
    # gradients, but for model shards we do not reshard after forward computation"
    # (Dubey et al. 2024, §3.3.1): ZeRO stage 2's memory and collectives
    zero=2,
    ends_in_split=True,
)


CASES = [
    Case(
        "Megatron-LM GPT 1T, 3072 A100",
        "Narayanan et al. 2021, SC21, Table 1 and abstract: 502 PFLOP/s, 163 TFLOP/s per GPU",
        custom_model("gpt", 128, 25600, 160, 51200, 2048),
        Parallelism(pipe=64, tensor=8, replica=6),
        3072,
        2048,
        1,
        "a100-80gb",
        "interleaved",
        2,
        "full",
        "tflops_per_device",
        163.0,
        "their count includes recomputation (96 B s l h^2 ...), as ours does",
        MEGATRON_2021,
    ),
    Case(
        "PaLM 540B, 6144 TPU v4",
        "Chowdhery et al. 2022, Table 3: 46.2% model FLOPs utilisation",
        # SwiGLU with d_ff = 4d has three d x d_ff matrices: FLOPs of a 2-matrix MLP of 6d.
        # Multi-query attention is modelled as multi-head (K, V projections overcounted).
        custom_model("gpt", 118, 18432, 48, 256000, 2048).replace(mlp_dim=6 * 18432),
        Parallelism(pipe=1, tensor=12, replica=512),
        2048,
        2048,
        4,
        "tpu-v4",
        "1f1b",
        1,
        "full",
        "mfu",
        0.462,
        "no pipeline: 12-way tensor, 512-way fully sharded data parallel over 2 pods",
        # the default Overlap(): XLA's step schedules the data-parallel all-reduce
        # asynchronously beside the backward (not a setting the paper states)
        # Section 4: "12-way model parallelism and 256-way fully sharded data parallelism"
        # within each pod, the two pods data-parallel: ZeRO 3 over all 512 replicas stands
        # for it (a layer's gathers and its gradient's reduction move the same bytes a
        # chip, (n - 1) / n of them, for n = 256 or 512; its master weights and optimizer
        # state split 512 ways where PaLM split them 256)
        zero=3,
    ),
    LLAMA3_405B_8K,
    # Table 4's other rows, planned as the 8,192-GPU row (126 layers, a chunk each and
    # the embedding and the loss alone in theirs, full recomputation, fused attention,
    # ZeRO 2)
    dataclasses.replace(
        LLAMA3_405B_8K,
        name="Llama 3 405B, 16384 H100",
        source="Dubey et al. 2024, The Llama 3 Herd of Models, Table 4: 400 TFLOP/s per GPU, "
        "41% MFU, on 16,384 GPUs, TP 8, PP 16, DP 128, 16M tokens a batch",
        # twice the data-parallel groups: 16 sequences of 8,192 a replica, one a microbatch
        par=Parallelism(pipe=16, tensor=8, replica=128),
        published=0.41,
        note="the Llama family",
    ),
    dataclasses.replace(
        LLAMA3_405B_8K,
        name="Llama 3 405B 128K context, 16384 H100",
        source="Dubey et al. 2024, The Llama 3 Herd of Models, Table 4: 380 TFLOP/s per GPU, "
        "38% MFU, on 16,384 GPUs, TP 8, CP 16, PP 16, 16M tokens a batch (Balaji, SC'24, "
        "the same): data parallel 8",
        # its context split 16 ways: Llama 3's all-gather context parallelism with two
        # chunks a rank for the causal mask (§3.3.2, "Context parallelism";
        # `predict/context_parallel.py`); 128 sequences of 131,072 tokens
        par=Parallelism(pipe=16, tensor=8, replica=8, context=16),
        batch=128,
        seq=131072,
        published=0.38,
        note="the Llama family; data parallel 8 from the GPUs and the "
        "tokens (this project's notes of 2026-11-25 read the table's DP as 4, which would "
        "make 8,192 GPUs and 8M tokens: planned so, 46.9% MFU)",
    ),
    *(
        Case(
            f"Megatron-LM GPT {size}B, {gpus} A100",
            f"Narayanan et al. 2021, SC21, Table 1: {tflops} TFLOP/s per GPU",
            custom_model("gpt", layers, hidden, heads, 51200, 2048),
            Parallelism(pipe=pipe, tensor=tensor, replica=gpus // (pipe * tensor)),
            batch,
            2048,
            1 if pipe > 1 else 0,
            "a100-80gb",
            "1f1b",
            1,
            "full",
            "tflops_per_device",
            float(tflops),
            "microbatch size not published: 1 when pipelined, else the planner's choice",
            MEGATRON_2021,
        )
        for size, heads, hidden, layers, tensor, pipe, gpus, batch, tflops in (
            (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
            (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
            (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
            (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
            (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
            (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
            (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
            (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
            (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
        )
    ),
    *(
        Case(
            f"MT-NLG 530B, 2240 A100, {recompute} recomputation",
            f"Korthikanti et al. 2022, abstract: {mfu:.1%} MFU; batch 1920 as MT-NLG "
            "(Smith et al. 2022)",
            custom_model("gpt", 105, 20480, 128, 51200, 2048),
            Parallelism(pipe=35, tensor=8, replica=8),
            1920,
            2048,
            1,
            "a100-80gb",
            "1f1b",
            1,
            recompute,
            "mfu",
            mfu,
            "selective recomputation with sequence parallelism, the paper's two techniques; "
            "full recomputation without, its baseline",
            MEGATRON_2021,
            sequence_parallel=recompute == "selective",
        )
        for recompute, mfu in (("full", 0.421), ("selective", 0.542))
    ),
    Case(
        "BERT-Base phase 2 (seq 512), IPU-POD16",
        "Graphcore/bert-base-uncased model card (Hugging Face, optimum-graphcore), "
        "train_results.json: 2038 steps of 16384 sequences in 13858 s, 2409.4 sequences/s; "
        "ipu_config.json: 4 IPUs a replica, layers [0, 4, 4, 4], 4 replicas, "
        "microbatch 2, gradient accumulation 512, recomputation every layer, FP16 partials",
        # 76 masked positions a sequence: Graphcore's max_predictions_per_seq at 512 (its
        # MLPerf BERT, mlcommons/training_results_v2.0, run_mlperf_POD16.sh)
        get_preset("bert-base").replace(max_predictions=76),
        Parallelism(pipe=4, tensor=1, replica=4),
        16384,
        512,
        2,
        "ipu-pod16",
        "1f1b",
        1,
        "full",
        "sequences_per_s",
        2409.431,
        "layers 3,4,4,1 for Graphcore's 0,4,4,4: both pipelines are paced by stages of four "
        "layers. Graphcore's IPU 0 holds the embedding and the tied masked-LM head (76 "
        "masked positions a sequence); ours is on the last stage, so it gets one layer. "
        "The published rate covers the whole run "
        "(start-up and checkpoints included)",
        BULK_SYNCHRONOUS,
        precision="fp16-mixed",  # the IPU computes FP16, not bfloat16 (predict/graphcore.py)
        stage_layers=(3, 4, 4, 1),
    ),
    *(
        Case(
            f"BERT-{size.title()} phase 1 (seq 128), {pod}",
            f"graphcore.cn Performance Results (Bow Platform - Training, TensorFlow2, {sdk}): "
            f"{published:.0f} sequences/s; graphcore/examples nlp/bert/tensorflow2 configs/"
            f"{config}: micro-batch {mb}, {replicas} replicas, a global batch of 65,280, "
            "20 masked positions, vocabulary 30,400, LAMB, FP16.16, recomputation on",
            get_preset(f"bert-{size}").replace(vocab_size=30_400, max_predictions=20),
            Parallelism(pipe=4, tensor=1, replica=replicas),
            65_280,
            128,
            mb,
            pod.lower().replace(" ", "-"),
            "1f1b",
            1,
            "full",
            "sequences_per_s",
            published,
            f"layers {','.join(map(str, layers))} for Graphcore's {graphcore}: both pipelines "
            "paced by the same stages; Graphcore's first IPU also holds the heads, ours the "
            "last. Graphcore kept the LAMB state in Streaming Memory (optimizer_state_offchip), "
            "ours stays on the IPU: the plan does not fit its 900 MB, and is timed as planned. "
            "The calibration row (ipu_calibration.py) is BERT-Large on the Bow Pod16",
            BULK_SYNCHRONOUS,
            precision="fp16-mixed",
            stage_layers=layers,
        )
        for size, pod, sdk, config, mb, replicas, published, layers, graphcore in BOW_BERT_RUNS
    ),
    *(
        Case(
            f"BERT-Large phase 1 (seq 128), {gpus} A100",
            "NVIDIA DeepLearningExamples, PaddlePaddle/LanguageModeling/BERT/README.md, "
            "Pre-training NVIDIA DGX A100 (8x A100 80GB) and its multi-node table: mixed "
            f"precision, 256 sequences a GPU, {steps} accumulation steps: {rate} sequences/s",
            get_preset("bert-large"),  # 20 masked positions a sequence, as NVIDIA's phase 1
            Parallelism(replica=gpus),
            256 * steps * gpus,
            128,
            256,
            "a100-80gb",
            "1f1b",
            1,
            "none",
            "sequences_per_s",
            rate,
            "slow: a layer's other kernels move more bytes as XLA's CPU fusions count them "
            "than NVIDIA's BERT, which fuses the GEMMs' epilogues (bias, GELU: "
            "fuse_gemm_epilogue in its program.py)",
            precision="fp16-mixed",
            # the published rates came with cuDNN's fused attention (fuse_mha, on by
            # default in scripts/run_pretraining.sh; the README's tables were updated to
            # them in commit a5388a45, "integrate cuDNN fused MHA": 633 -> 694 on 1 GPU)
            attention="fused",
        )
        for gpus, steps, rate in ((1, 32, 694), (8, 32, 5541), (256, 1, 157952))
    ),
    *(
        Case(
            f"{name}, 64 A100, FSDP, local batch {b}, recompute {recompute}",
            f"Liang et al. 2024 (TorchTitan), docs/performance.md, 64 A100 80GB: {wps} "
            "tokens/s a GPU",
            model,
            Parallelism(replica=64),
            64 * b,
            seq,
            b,
            "a100-80gb",
            "1f1b",
            1,
            recompute,
            "sequences_per_s",
            wps * 64 / seq,
            "FSDP2 over every GPU (ZeRO-3 here); the rate is TorchTitan's tokens a second a "
            "GPU times 64 over the sequence",
            # FSDP reduce-scatters each layer's gradients during the backward and prefetches
            # the next layer's all-gather (the default overlap), in FP32: FSDP2's
            # MixedPrecisionPolicy(reduce_dtype=float32), TorchTitan's default
            # `training.mixed_precision_reduce` (pytorch/torchtitan, config/job_config.py)
            TORCHTITAN_OVERLAP,
            attention="fused",
            zero=3,
        )
        for model, name, seq, b, recompute, wps in TORCHTITAN_A100
    ),
    # NVIDIA-NeMo/Megatron-Bridge's H100 FP8 recipes (perf_recipes/llama/h100/, over
    # recipes/llama/h100/): no recomputation, FP8 current scaling, sequence parallel with
    # userbuffers' TP overlap, the distributed optimizer (ZeRO 1), overlapped gradient
    # reduce and parameter gather, TE's cuDNN attention, micro-batch 1, sequence 8192
    *(
        Case(
            name,
            "NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary-archive.md, 26.04.01 NeMo "
            f"container, DGX-H100: {tokens} tokens/s a GPU ({recipe})",
            model,
            par,
            batch,
            8192,
            1,
            "h100-sxm",
            "interleaved",
            virtual,
            "none",
            "sequences_per_s",
            tokens * par.num_devices / 8192,
            note,
            Overlap(tp_overlap="chunked"),
            attention="fused",
            precision="fp8",
            zero=1,
            sequence_parallel=True,
            ends_in_split=ends,
        )
        for name, recipe, model, par, batch, virtual, tokens, note, ends in (
            (
                "Llama 3 70B, 64 H100, FP8, p8 t4 r2, interleaved 5",
                "llama3_70b_pretrain_64gpu_h100_fp8cs_config",
                get_preset("llama3-70b"),
                Parallelism(pipe=8, tensor=4, replica=2),
                256,
                5,
                1664,
                "its pipeline layout puts the embedding and the loss in chunks of their own (80 "
                "layers in 40 chunks of 2 here)",
                False,
            ),
            # 126 layers with the embedding and the loss counted in the split, 2 a chunk:
            # recipes/llama/llama31_405b.py (3594df9) and recipes/llama/llama3.py set
            # `account_for_embedding_in_pipeline_split` and `..._loss_...` for 405B (128
            # layers for 126 until 2026-11-28)
            (
                "Llama 3.1 405B, 1024 H100, FP8, p8 t8 c2 r8, interleaved 8",
                "llama31_405b_pretrain_1024gpu_h100_fp8cs_config",
                get_preset("llama3-405b"),
                Parallelism(pipe=8, tensor=8, replica=8, context=2),
                1536,
                8,
                328,
                "one key/value group a device at tensor 8, one sequence a microbatch: its "
                "attention core's dots have no batch dimension, found by the model's attention "
                "shape (accounting/attention_core.py)",
                True,
            ),
        )  # fmt: skip
    ),
    Case(
        "Llama 2 70B, 256 TPU v6e, FSDP, batch 2 a chip",
        "AI-Hypercomputer/tpu-recipes, training/trillium/Llama2-70B-MaxText/README.md: "
        "llama2_70b_4096_sc on a v6e-256, 9.052 s a step, 905.021 tokens/s a chip",
        LLAMA2_70B,
        Parallelism(replica=256),
        # the logged step's total_weights, 2,097,152 tokens, are 512 sequences of 4096:
        # 2 a chip (the README lists per_device_batch_size 3 for the config; its log's
        # step is what was measured)
        512,
        4096,
        2,
        "tpu-v6e",
        "1f1b",
        1,
        # its remat policy "qkv_proj_offloaded" keeps the Q, K and V projections (in host
        # memory) and recomputes the rest: full recomputation here, which recomputes them
        # too (about 10% of the layer's forward matmul FLOPs more) and moves no offload
        "full",
        "sequences_per_s",
        905.021 * 256 / 4096,
        "MaxText: FSDP over all 256 chips (ici_fsdp_transpose_parallelism), Pallas flash "
        "attention, BF16; the rate is tokens a second a chip times 256 over the sequence",
        attention="fused",
        zero=3,
    ),
]


@dataclass(frozen=True)
class MemoryCase:
    """A published device-memory reading (`published_gib`) or outcome (`ran`: the run
    fitted, or stopped out of memory) of a layout, against the planned device bytes."""

    name: str
    model: ModelConfig
    replicas: int
    microbatch_size: int
    seq: int
    hardware: str
    recompute: str
    published_gib: float | None
    ran: bool


# TorchTitan (Liang et al. 2024, "TorchTitan: One-stop PyTorch native solution for
# production ready LLM pre-training"), pytorch/torchtitan docs/performance.md: FSDP2 (ZeRO
# stage 3) over every GPU, BF16 compute with FP32 parameters, gradients and AdamW state,
# FlashAttention (SDPA), sequence 8192 (its llama3_8b.toml), "selective op" activation
# checkpointing, gradients reduced in FP32 (TORCHTITAN_OVERLAP: FSDP2's reduce-scatter
# input, a layer in FP32, held in the backward: `resident_memory._reduce_scatter`).
# Table 1 and 3: Llama 3.1 8B on 8 and 128 H100s (Grand Teton, 96 GB
# HBM2e), local batch 2: 82.4 and 67.0 GiB, the largest `torch.cuda.max_memory_reserved`
# of any GPU (the caching allocator's reserve, its fragmentation included). Llama 2 70B
# on 64 A100 80GB, sequence 4096, local batch 1 ran (50.8% MFU); "70B training with
# local batch size 2 will cause an OOM error when selective activation checkpointing is
# used" (its footnote 1).
MEMORY_CASES = [
    MemoryCase("Llama 3.1 8B, 8 H100, FSDP, local batch 2", get_preset("llama3-8b"), 8, 2,
               8192, "h100-sxm", "selective-op", 82.4, True),
    MemoryCase("Llama 3.1 8B, 128 H100, FSDP, local batch 2", get_preset("llama3-8b"), 128, 2,
               8192, "h100-sxm", "selective-op", 67.0, True),
    MemoryCase("Llama 2 70B, 64 A100, FSDP, local batch 1", LLAMA2_70B, 64, 1, 4096,
               "a100-80gb", "selective-op", None, True),
    MemoryCase("Llama 2 70B, 64 A100, FSDP, local batch 2", LLAMA2_70B, 64, 2, 4096,
               "a100-80gb", "selective-op", None, False),
]  # fmt: skip


def run_memory(case: MemoryCase) -> dict:
    """The planned bytes a device holds, against the published reading or outcome."""
    train = TrainConfig(
        batch=case.replicas * case.microbatch_size, seq=case.seq, precision="bf16", zero=3
    )
    hw = PROFILES[case.hardware]
    if case.hardware == "h100-sxm":  # Grand Teton's H100s: 96 GB of HBM, of which PyTorch
        # reports 95.0396 GiB (pytorch/torchtitan PR 165, "can convert against 95.0396 GiB
        # GPU memory")
        hw = dataclasses.replace(hw, device_memory_gb=gib(95.0396))
    r = plan_resident(
        case.model, Parallelism(replica=case.replicas), train, case.microbatch_size, hw,
        recompute=case.recompute, attention="fused", overlap=TORCHTITAN_OVERLAP,
    ).report  # fmt: skip
    device = r["memory_per_device"]["device"]
    predicted_gib = device["bytes"] / 2**30
    return {
        "case": case.name, "hardware": case.hardware, "predicted_gib": predicted_gib,
        "published_gib": case.published_gib, "fits": device["fits"], "ran": case.ran,
        "error": predicted_gib / case.published_gib - 1 if case.published_gib else None,
        "outcome_right": device["fits"] == case.ran,
    }  # fmt: skip


def devices_for(cases: list[Case]) -> int:
    """The virtual devices the plans of `cases` count on: each a stage's tensor x context
    group (PaLM's tensor 12; Llama 3's 128K stage, tensor 8 x context 16), and never
    fewer than the 48 this harness started with before that stage was a row."""
    return max(48, *(c.par.tensor * c.par.context for c in cases))


def train_config(case: Case) -> TrainConfig:
    """The training settings `case` is planned with."""
    return TrainConfig(
        batch=case.batch, seq=case.seq, schedule=case.schedule, virtual=case.virtual,
        precision=case.precision, stage_layers=case.stage_layers, zero=case.zero,
        sequence_parallel=case.sequence_parallel,
        account_for_embedding_in_pipeline_split=case.ends_in_split,
        account_for_loss_in_pipeline_split=case.ends_in_split,
    )  # fmt: skip


def run(case: Case) -> dict:
    use_virtual_devices(devices_for([case]))  # a process of this row alone (plans.py)
    train = train_config(case)
    settings = {"recompute": case.recompute, "overlap": case.overlap, "attention": case.attention}
    hw = PROFILES[case.hardware]
    if case.attention_efficiency is not None:
        hw = dataclasses.replace(hw, attention_efficiency=case.attention_efficiency)
    if case.microbatch_size:
        r = plan_resident(case.model, case.par, train, case.microbatch_size, hw, **settings).report
    else:  # not published: the size `shardemu plan` picks
        r = plan_resident_auto(case.model, case.par, train, hw, **settings).report
    predicted = {
        "tflops_per_device": r["tflops_per_device"], "mfu": r["utilisation"],
        "sequences_per_s": case.batch / r["step_time_s"],
    }[case.metric]  # fmt: skip
    # every metric is inversely proportional to the step: the band's ends, slow then fast
    band = [predicted * r["step_time_s"] / end for end in reversed(r["band"]["step_time_s"])]
    return {
        "case": case.name,
        "source": case.source,
        "hardware": case.hardware,
        "efficiency": hw.efficiency,
        "attention_efficiency": hw.attention_efficiency,
        "metric": case.metric,
        "published": case.published,
        "predicted": predicted,
        "error": predicted / case.published - 1,
        "band": band,
        "published_in_band": band[0] <= case.published <= band[1],
        "step_time_s": r["step_time_s"],
        "breakdown": r["breakdown"],
        "overlap": r["overlap"],
        "attention": r["attention"],
        "memory_fits": r["memory_per_device"]["device"]["fits"],
        "model_flops_rel_err": r["model_flops_rel_err"],
        "note": case.note,
        "plan_s": r["elapsed_s"],
    }


def earlier_rows(path: str) -> dict[str, dict]:
    """An earlier run's rows by case, read before any plan is made: exits with one line
    where `path` is not a JSON this script wrote."""
    try:
        return {r["case"]: r for r in json.loads(Path(path).read_text())["rows"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(
            f"--compare {path}: not a JSON written by benchmarks/validation.py ({err!r})"
        ) from None


def compared(rows: list[dict], old: dict[str, dict], old_path: str) -> list[str]:
    """A line for each row whose prediction differs from the earlier run's (`old`, read
    from `old_path`) by more than 1e-9 relative, or that the earlier run lacks; or one
    line saying that none does."""
    lines = []
    for r in rows:
        before = old.get(r["case"])
        if before is None:
            lines.append(f"new: {r['case']}: {r['predicted']:.6g} ({r['error']:+.1%})")
        elif abs(r["predicted"] - before["predicted"]) > 1e-9 * abs(before["predicted"]):
            lines.append(
                f"moved: {r['case']}: {before['predicted']:.6g} -> {r['predicted']:.6g} "
                f"(error {before['error']:+.1%} -> {r['error']:+.1%})"
            )
    return lines or [f"every prediction equals {old_path}'s to 1e-9 relative ({len(rows)} rows)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/validation.json")
    parser.add_argument(
        "--only",
        default="",
        help="run only the cases whose name holds this text (and no memory rows)",
    )
    parser.add_argument(
        "--compare",
        default=None,
        metavar="OLD.json",
        help="name each row whose prediction moved since an earlier run's JSON",
    )
    args = parser.parse_args()
    old = earlier_rows(args.compare) if args.compare else None
    use_virtual_devices(devices_for(CASES))  # the widest first: the backend starts once
    rows = [run(case) for case in CASES if args.only in case.name]
    if not rows:
        raise SystemExit(
            f"--only {args.only!r} matches no case; names: " + "; ".join(c.name for c in CASES)
        )
    table = Table(title="shardemu cost model vs published training results")
    for col in ("case", "hardware (eff.)", "metric", "published", "predicted", "error",
                "band", "step s", "bubble s", "exposed comm s"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        fmt = "{:.1%}" if r["metric"] == "mfu" else "{:.1f}"
        table.add_row(
            r["case"], f"{r['hardware']} ({r['efficiency']})", r["metric"],
            fmt.format(r["published"]), fmt.format(r["predicted"]), f"{r['error']:+.0%}",
            " to ".join(map(fmt.format, r["band"])) + ("" if r["published_in_band"] else " (out)"),
            f"{r['step_time_s']:.1f}", f"{r['breakdown']['pipeline_bubble_s']:.1f}",
            f"{r['breakdown']['exposed_communication_s']:.1f}",
        )  # fmt: skip
    Console(width=160).print(table)
    errors = sorted(abs(r["error"]) for r in rows)
    summary = {
        "cases": len(rows),
        "sources": len({r["source"].split(",")[0] for r in rows}),
        "median_abs_error": statistics.median(errors),
        "worst_abs_error": errors[-1],
        "published_in_band": sum(r["published_in_band"] for r in rows),
        "plans_that_fit": sum(r["memory_fits"] for r in rows),
    }
    print(f"{summary['cases']} cases from {summary['sources']} sources: median |error| "
          f"{summary['median_abs_error']:.1%}, worst {summary['worst_abs_error']:.1%}; the "
          f"published figure inside the band in {summary['published_in_band']}; "
          f"{summary['plans_that_fit']} plans fit")  # fmt: skip
    if old is not None:
        print("\n".join(compared(rows, old, args.compare)))
    memory = [run_memory(case) for case in MEMORY_CASES if not args.only]
    table = Table(title="planned device memory vs published readings and outcomes")
    for col in ("case", "hardware", "predicted GiB", "published GiB", "error", "fits", "ran"):
        table.add_column(col, justify="right")
    for m in memory:
        published = f"{m['published_gib']:.1f}" if m["published_gib"] else "-"
        error = f"{m['error']:+.0%}" if m["error"] is not None else "-"
        table.add_row(m["case"], m["hardware"], f"{m['predicted_gib']:.1f}", published, error,
                      str(m["fits"]), str(m["ran"]))  # fmt: skip
    Console(width=160).print(table)
    summary["memory_outcomes_right"] = sum(m["outcome_right"] for m in memory)
    print(f"memory: {summary['memory_outcomes_right']} of {len(memory)} outcomes right")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**summary, "rows": rows, "memory": memory}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
