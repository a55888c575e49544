"""The settings the command line's flags stand for: the config objects the library takes
(`ModelConfig`, `Parallelism`, `PhasedConfig`, `SparsityConfig`, a search's `Space`),
built from a parsed command line (`args.py` declares the flags) and checked together,
with errors that name the flags."""

from __future__ import annotations

import argparse
from typing import Any

from shardemu.config import (
    PRECISIONS,
    ConfigError,
    ModelConfig,
    Parallelism,
    PhasedConfig,
    SparsityConfig,
)
from shardemu.models import FAMILIES, custom_model, get_preset
from shardemu.report.trackers import TrackingConfig


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.model is None:
        raise ConfigError("the following argument is required: --model (or --resume RUN_DIR)")
    dims = {"--layers": args.layers, "--hidden": args.hidden, "--heads": args.heads}
    if args.model in FAMILIES:
        missing = [flag for flag, value in dims.items() if value is None]
        if missing:
            raise ConfigError(f"--model {args.model} needs {', '.join(missing)} (or a preset name)")
        positions = getattr(args, "seq", None) or 0
        cfg = custom_model(args.model, args.layers, args.hidden, args.heads, args.vocab, positions)
    else:
        given = [
            flag for flag, value in {**dims, "--vocab": args.vocab}.items() if value is not None
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} go with --model gpt or --model bert, not a preset"
            )
        cfg = get_preset(args.model)
    if args.max_predictions is not None:
        if cfg.family != "bert" or args.max_predictions < 1:
            raise ConfigError(
                f"--max-predictions goes with a BERT model and is a positive number of "
                f"positions, got {args.max_predictions} for {cfg.name} ({cfg.family})"
            )
        cfg = cfg.replace(max_predictions=args.max_predictions)
    return cfg if args.pad_vocab is None else cfg.pad_vocab(args.pad_vocab)


def sparsity_config(args: argparse.Namespace) -> SparsityConfig | None:
    """The sparsity settings, or None; sparse flags without --sparsity are an error."""
    d = SparsityConfig()
    fields = {
        "block": ("--block", args.block, d.block),
        "mode": ("--sparse-mode", args.sparse_mode, d.mode),
        "updates": ("--sparse-updates", args.sparse_updates, d.updates),
        "prune_ratio": ("--prune-ratio", args.prune_ratio, d.prune_ratio),
        "regrow": ("--regrow", args.regrow, d.regrow),
        "distribution": ("--sparse-distribution", args.sparse_distribution, d.distribution),
    }
    if args.sparsity is None:
        given = [flag for flag, value, default in fields.values() if value != default]
        if given:
            raise ConfigError(f"{', '.join(given)} need --sparsity")
        return None
    return SparsityConfig(args.sparsity, **{name: v[1] for name, v in fields.items()})


def tracking_config(args: argparse.Namespace) -> TrackingConfig | None:
    """The trackers the flags ask for beside the run directory (None: none)."""
    if args.wandb is None and not args.tensorboard:
        return None
    return TrackingConfig(wandb=args.wandb, tensorboard=args.tensorboard)


def search_space(args: argparse.Namespace, profile_precisions: tuple[str, ...]) -> Any:
    """The `Space` of a `search` command line; precisions checked against the profile."""
    from shardemu.predict.layouts import Space

    if args.precision is None:
        precisions = profile_precisions
    else:
        precisions = tuple(p.strip() for p in args.precision.split(",") if p.strip())
        unknown = [p for p in precisions if p not in PRECISIONS]
        if unknown or not precisions:
            raise ConfigError(
                f"--precision takes a comma-separated list of {', '.join(PRECISIONS)}, got "
                f"{args.precision!r}"
            )
    for flag, value in (
        ("--max-tensor", args.max_tensor),
        ("--max-microbatch", args.max_microbatch),
    ):
        if value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    return Space(
        precisions, args.modes, args.max_tensor, args.max_microbatch, overlap_config(args),
        args.attention,
    )  # fmt: skip


def pipeline_config(args: argparse.Namespace) -> dict[str, Any]:
    """`TrainConfig`'s schedule, virtual and stage_layers from the flags."""
    virtual = args.virtual
    if virtual is None:
        virtual = 2 if args.schedule == "interleaved" else 1
    elif args.schedule != "interleaved" and virtual != 1:
        raise ConfigError(
            f"--virtual {virtual} splits stages into chunks, which only the interleaved "
            f"schedule runs; add --schedule interleaved (or drop --virtual)"
        )
    text = getattr(args, "stage_layers", None)
    stage_layers = None
    if text is not None:
        try:
            stage_layers = tuple(int(n) for n in text.split(","))
        except ValueError:
            raise ConfigError(
                f"--stage-layers needs comma-separated layer counts, one per stage "
                f"(e.g. 3,7,7,7), got {text!r}"
            ) from None
    return {"schedule": args.schedule, "virtual": virtual, "stage_layers": stage_layers}


def overlap_config(args: argparse.Namespace) -> Any:
    from shardemu.predict.overlap import Overlap

    return Overlap(args.grad_reduce, args.bucket_mb, args.pipe_sends)


def phased_config(args: argparse.Namespace) -> PhasedConfig | None:
    """The phased settings, or None; phased flags without --phased are an error."""
    d = PhasedConfig()
    given = [
        flag
        for flag, value, default in (
            ("--phases", args.phases, None),
            ("--device-memory", args.device_memory, None),
            ("--rts", args.rts, d.rts),
            ("--rts-optimizer", args.rts_optimizer, None),
            ("--activations", args.activations, None),
            ("--optimizer-on", args.optimizer_on, d.optimizer_on),
            ("--no-prefetch", args.prefetch, d.prefetch),
        )
        if value != default
    ]
    streaming = args.weight_streaming  # a configuration of phased execution
    if not (args.phased or streaming):
        if given:
            raise ConfigError(f"{', '.join(given)} need --phased")
        return None
    default_activations = "keep-activations" if streaming else d.activations
    return PhasedConfig(
        phases=args.phases,
        device_memory=args.device_memory,
        rts=args.rts,
        rts_optimizer=args.rts_optimizer,
        activations=args.activations or default_activations,
        optimizer_on=args.optimizer_on,
        prefetch=args.prefetch,
        weight_streaming=streaming,
    )


def parallelism(args: argparse.Namespace) -> Parallelism:
    """The mesh of --mesh, or of --systems N with --weight-streaming: replica=N."""
    par = Parallelism.parse(args.mesh)
    systems = getattr(args, "systems", None)
    if systems is None:
        return par
    if not getattr(args, "weight_streaming", False):
        raise ConfigError(f"--systems {systems} goes with --weight-streaming")
    if systems < 1:
        raise ConfigError(f"--systems must be a positive number of systems, got {systems}")
    if args.mesh and par != Parallelism(replica=systems):
        raise ConfigError(
            f"--systems {systems} is the mesh replica={systems}, but --mesh says {par}; drop --mesh"
        )
    return Parallelism(replica=systems)
