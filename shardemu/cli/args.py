"""The command line's flags, in groups that several commands share (the model, a run,
phased execution, sparsity, pipelines, overlap, tracking). A config field's flag (its
name, type, default, choices and help) is declared on the field (`config/flags.py`) and
added here by `fields.add_flags`; only the flags that are no field's are written out."""

from __future__ import annotations

import argparse

from shardemu.cli.fields import add_flags
from shardemu.config import PhasedConfig, SparsityConfig, TrainConfig
from shardemu.models import FAMILIES, PRESETS
from shardemu.predict.layouts import Space
from shardemu.predict.overlap import Overlap
from shardemu.report.trackers import TrackingConfig

# the TrainConfig fields `shardemu run` sets beside its pipeline and precision flags
RUN_FIELDS = (
    "steps", "batch", "seq", "seed", "microbatches", "grad_accum", "optimizer",
    "learning_rate", "warmup_steps", "weight_decay", "grad_clip", "data", "sequence_parallel",
)  # fmt: skip


def model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        help=f"a preset ({', '.join(PRESETS)}), or a family ({' / '.join(FAMILIES)}) with "
        "--layers --hidden --heads [--kv-heads] [--mlp] [--vocab]",
    )
    for flag in ("--layers", "--hidden", "--heads", "--vocab"):
        p.add_argument(flag, type=int, default=None, help=f"custom model {flag[2:]}")
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        metavar="G",
        help="custom model: key/value heads of grouped-query attention (llama; default --heads)",
    )
    p.add_argument(
        "--mlp", type=int, default=None, metavar="F", help="custom model: the MLP's width d_ff"
    )
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


def run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--devices", type=int, default=None, help="virtual CPU devices (default: the mesh size)"
    )
    add_flags(p, TrainConfig, RUN_FIELDS)
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
    p.add_argument(
        "--sparsity",
        type=float,
        default=None,
        metavar="S",
        help="block-sparse layer kernels: the fraction of zero blocks, in [0, 1)",
    )
    add_flags(p, SparsityConfig)


def phased_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--phased", action="store_true", help="weights in the host tier, streamed per phase"
    )
    add_flags(p, PhasedConfig)
    p.add_argument(
        "--systems",
        type=int,
        default=None,
        metavar="N",
        help="with --weight-streaming: the systems (the mesh replica=N; default 1)",
    )


def tracking_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, TrackingConfig)
    config_arg(p)


def config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="settings from a .toml file (keys are these flags) or a run's config.json; "
        "flags given here win",
    )


def pipeline_args(p: argparse.ArgumentParser) -> None:
    add_flags(
        p,
        TrainConfig,
        (
            "schedule",
            "virtual",
            "microbatch_group",
            "stage_layers",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        ),
    )


def precision_arg(p: argparse.ArgumentParser) -> None:
    """The precision, and ZeRO: what the weights and the optimizer state are held in,
    and where."""
    add_flags(p, TrainConfig, ("precision", "zero"))


def sequence_parallel_arg(p: argparse.ArgumentParser) -> None:
    """--sequence-parallel for a command without `run`'s training flags (`plan`)."""
    add_flags(p, TrainConfig, ("sequence_parallel",))


def overlap_args(p: argparse.ArgumentParser) -> None:
    """How the training system overlaps communication (`predict/overlap.py`)."""
    add_flags(p, Overlap)


def attention_arg(p: argparse.ArgumentParser) -> None:
    add_flags(p, Space, ("attention",))


def search_space_args(p: argparse.ArgumentParser) -> None:
    """What a search enumerates (`Space`), beside its --precision list."""
    add_flags(p, Space, ("modes", "max_tensor", "max_microbatch", "sequence_parallel"))
    overlap_args(p)
    attention_arg(p)


def shape_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, TrainConfig, ("batch", "seq"))
