"""The command line's flags, in groups that several commands share (the model, a run,
phased execution, sparsity, pipelines, overlap, tracking): their names, types, defaults
(the config fields' own), choices and help. `parser.py` puts them together per command;
`settings.py` turns them into the config objects the library takes."""

from __future__ import annotations

import argparse

from shardemu.config import (
    DATASETS,
    PRECISIONS,
    PhasedConfig,
    SparsityConfig,
    TrainConfig,
)
from shardemu.models import FAMILIES, PRESETS
from shardemu.parallel.schedules import SCHEDULES
from shardemu.report.trackers import DEFAULT_WANDB_PROJECT


def model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        help=f"a preset ({', '.join(PRESETS)}), or a family ({' / '.join(FAMILIES)}) with "
        "--layers --hidden --heads [--vocab]",
    )
    for flag in ("--layers", "--hidden", "--heads", "--vocab"):
        p.add_argument(flag, type=int, default=None, help=f"custom model {flag[2:]}")
    p.add_argument(
        "--pad-vocab",
        type=int,
        default=None,
        metavar="M",
        help="round the vocabulary up to a multiple of M (Megatron's vocab padding)",
    )
    p.add_argument(
        "--max-predictions",
        type=int,
        default=None,
        metavar="P",
        help="BERT: masked positions a sequence its masked-LM head predicts "
        "(max_predictions_per_seq; default 15%% of --seq, rounded up)",
    )


def run_args(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    p.add_argument(
        "--devices", type=int, default=None, help="virtual CPU devices (default: the mesh size)"
    )
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch", type=int, default=defaults.batch, help="global batch (all replicas)")
    p.add_argument("--seq", type=int, default=defaults.seq, help="sequence length")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--microbatches",
        type=int,
        default=defaults.microbatches,
        help="microbatches per step, run through the pipeline --schedule over the pipe axis",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=defaults.grad_accum,
        help="gradient accumulation steps (global batch = b * M * replica * K)",
    )
    p.add_argument("--optimizer", choices=("adamw", "lamb"), default=defaults.optimizer)
    p.add_argument("--lr", type=float, default=defaults.learning_rate, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=defaults.warmup_steps, help="warm-up steps")
    p.add_argument(
        "--data",
        choices=DATASETS,
        default=defaults.data,
        help="training text: the synthetic Markov corpus, or the Python standard library's "
        "source as bytes (with a held-out validation split)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="K",
        help="the loss of held-out batches every K steps and after the last (val_loss)",
    )
    p.add_argument("--out", default=None, help="run directory (default runs/<model>-<timestamp>)")
    precision_arg(p)
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split layer norms and residual adds over tensor by sequence (Korthikanti et "
        "al. 2022): reduce-scatter + all-gather instead of all-reduce, nothing repeated",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="K",
        help="save the state to RUN_DIR/checkpoints every K steps and at the end",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="run as N processes on this machine, joined by jax.distributed with gloo "
        "collectives, each with devices / N virtual devices (resident runs)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue RUN_DIR from its last checkpoint, with its own settings (--steps, "
        "--mesh, --devices, --out, --hardware and --checkpoint-every may change)",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="add the predicted step on a profile (ipu-pod16, a100-80gb, ...) or a .toml file",
    )
    phased_args(p)
    sparsity_args(p)


def sparsity_args(p: argparse.ArgumentParser) -> None:
    d = SparsityConfig()
    p.add_argument(
        "--sparsity",
        type=float,
        default=None,
        metavar="S",
        help="block-sparse layer kernels: the fraction of zero blocks, in [0, 1)",
    )
    p.add_argument("--block", type=int, default=d.block, help="square blocks: 1, 4, 8 or 16")
    p.add_argument(
        "--sparse-mode",
        choices=("static", "dynamic"),
        default=d.mode,
        help="static pattern, or dynamic prune-and-regrow",
    )
    p.add_argument(
        "--sparse-updates",
        type=int,
        default=d.updates,
        metavar="N",
        help="dynamic: pattern updates over the run",
    )
    p.add_argument(
        "--prune-ratio",
        type=float,
        default=d.prune_ratio,
        help="dynamic: fraction of non-zero blocks pruned at first, cosine-decayed",
    )
    p.add_argument(
        "--regrow",
        choices=("random", "gradient"),
        default=d.regrow,
        help="dynamic: which zero blocks regrow",
    )
    p.add_argument(
        "--sparse-distribution",
        choices=("uniform", "erk"),
        default=d.distribution,
        help="the same density in every kernel, or Erdos-Renyi-Kernel",
    )


def phased_args(p: argparse.ArgumentParser) -> None:
    d = PhasedConfig()
    p.add_argument(
        "--phased", action="store_true", help="weights in the host tier, streamed per phase"
    )
    p.add_argument(
        "--phases",
        type=int,
        default=None,
        help="phases (default: the fewest that fit --device-memory, else one per layer)",
    )
    p.add_argument(
        "--device-memory", type=int, default=None, metavar="BYTES", help="device tier capacity"
    )
    p.add_argument("--rts", type=int, default=d.rts, help="replicated tensor sharding over replica")
    p.add_argument(
        "--rts-optimizer",
        type=int,
        default=None,
        metavar="R2",
        help="rts' for optimizer state: 1, --rts, or the replica size (default: --rts)",
    )
    p.add_argument(
        "--activations",
        choices=("keep", "offload", "recompute", "keep-activations"),
        default=None,
        help="what a phase's backward gets from its forward (default: recompute; with "
        "--weight-streaming, keep-activations)",
    )
    p.add_argument(
        "--optimizer-on",
        choices=("host", "device"),
        default=d.optimizer_on,
        help="where the update runs (host: the MemoryX arrangement)",
    )
    p.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="fetch a phase's weights only when it runs (default: one phase ahead)",
    )
    p.add_argument(
        "--weight-streaming",
        action="store_true",
        help="train as a Cerebras weight-streaming cluster: phased, one layer a phase, "
        "weights broadcast to --systems over SwarmX, gradients reduced into MemoryX",
    )
    p.add_argument(
        "--systems",
        type=int,
        default=None,
        metavar="N",
        help="with --weight-streaming: the systems (the mesh replica=N; default 1)",
    )


def tracking_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wandb",
        nargs="?",
        const=DEFAULT_WANDB_PROJECT,
        default=None,
        metavar="PROJECT",
        help=f"log to Weights & Biases, offline unless WANDB_MODE says otherwise "
        f"(project default {DEFAULT_WANDB_PROJECT!r}; needs shardemu[wandb])",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="write TensorBoard event files to RUN_DIR/tensorboard (needs shardemu[tensorboard])",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="settings from a .toml file (keys are these flags) or a run's config.json; "
        "flags given here win",
    )


def pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=TrainConfig().schedule,
        help="pipeline schedule over the pipe axis (Narayanan et al. 2021)",
    )
    p.add_argument(
        "--virtual",
        type=int,
        default=None,
        metavar="V",
        help="model chunks per stage, interleaved schedule only (default 2)",
    )
    p.add_argument(
        "--stage-layers",
        default=None,
        metavar="N,N,...",
        help="layers of each pipeline stage, e.g. 3,7,7,7 (default: even); plans: resident only",
    )


def precision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=TrainConfig().precision,
        help="fp32; or 16-bit weights, activations and gradients with FP32 master weights "
        "and optimizer state: bf16, fp16-mixed (with dynamic loss scaling)",
    )


def overlap_args(p: argparse.ArgumentParser) -> None:
    """How the training system overlaps communication (`predict/overlap.py`)."""
    from shardemu.predict.overlap import GRAD_REDUCE, PIPE_SENDS, Overlap

    d = Overlap()
    p.add_argument(
        "--grad-reduce",
        choices=GRAD_REDUCE,
        default=d.grad_reduce,
        help="resident plans: all-reduce gradients in buckets during the last backward "
        "(PyTorch DDP, Megatron --overlap-grad-reduce) or all at the end (Megatron-LM 2021)",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=d.bucket_mb,
        help="gradient bucket size in MiB for --grad-reduce bucketed (DDP's bucket_cap_mb)",
    )
    p.add_argument(
        "--pipe-sends",
        choices=PIPE_SENDS,
        default=d.pipe_sends,
        help="pipeline sends overlap the sender's next computation, or block it",
    )


def attention_arg(p: argparse.ArgumentParser) -> None:
    from shardemu.predict.resident_count import ATTENTION

    p.add_argument(
        "--attention",
        choices=ATTENTION,
        default=ATTENTION[0],
        help="resident plans: the attention core as XLA emits it, its [s, s] scores in "
        "memory, or fused (FlashAttention) without them",
    )


def shape_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--batch", type=int, default=d.batch, help="global batch (all replicas)")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length")
