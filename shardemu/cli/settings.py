"""The settings the command line's flags stand for: the config objects the library takes
(`ModelConfig`, `Parallelism`, `TrainConfig`, `PhasedConfig`, `SparsityConfig`, a
search's `Space`), built from a parsed command line by `fields.from_args` where the flags
are fields, and by hand for the model and the mesh, with errors that name the flags."""

from __future__ import annotations

import argparse
from typing import Any

from shardemu.cli.fields import changed, from_args
from shardemu.config import (
    PRECISIONS,
    ConfigError,
    ModelConfig,
    Parallelism,
    PhasedConfig,
    SparsityConfig,
    TrainConfig,
)
from shardemu.models import FAMILIES, custom_model, get_preset
from shardemu.predict.layouts import Space
from shardemu.predict.overlap import Overlap
from shardemu.report.trackers import TrackingConfig


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.model is None:
        others = [f for f, dest in (("--resume RUN_DIR", "resume"), ("--config FILE", "config"))
                  if hasattr(args, dest)]  # fmt: skip
        also = f" (or {' or '.join(others)})" if others else ""
        raise ConfigError(f"the following argument is required: --model{also}")
    dims = {"--layers": args.layers, "--hidden": args.hidden, "--heads": args.heads}
    extra = {"--kv-heads": args.kv_heads, "--mlp": args.mlp, "--vocab": args.vocab}
    if args.model in FAMILIES:
        missing = [flag for flag, value in dims.items() if value is None]
        if missing:
            raise ConfigError(f"--model {args.model} needs {', '.join(missing)} (or a preset name)")
        positions = getattr(args, "seq", None) or 0
        cfg = custom_model(
            args.model, args.layers, args.hidden, args.heads, args.vocab, positions,
            kv_heads=args.kv_heads, mlp=args.mlp,
        )  # fmt: skip
    else:
        given = [flag for flag, value in (dims | extra).items() if value is not None]
        if given:
            families = " or ".join(f"--model {name}" for name in FAMILIES)
            raise ConfigError(f"{', '.join(given)} go with {families}, not a preset")
        cfg = get_preset(args.model)
    if args.max_predictions is not None:
        if cfg.family != "bert" or args.max_predictions < 1:
            raise ConfigError(
                f"--max-predictions goes with a BERT model and is a positive number of "
                f"positions, got {args.max_predictions} for {cfg.name} ({cfg.family})"
            )
        cfg = cfg.replace(max_predictions=args.max_predictions)
    return cfg if args.pad_vocab is None else cfg.pad_vocab(args.pad_vocab)


def train_config(args: argparse.Namespace, **given: Any) -> TrainConfig:
    """The run's `TrainConfig` from the flags the command has, its sparsity from
    --sparsity, and `given` for fields the command fixes itself."""
    return from_args(TrainConfig, args, sparsity=sparsity_config(args), **given)


def sparsity_config(args: argparse.Namespace) -> SparsityConfig | None:
    """The sparsity settings, or None; sparse flags without --sparsity are an error."""
    if getattr(args, "sparsity", None) is None:
        given = changed(SparsityConfig, args)
        if given:
            raise ConfigError(f"{', '.join(given)} need --sparsity")
        return None
    return from_args(SparsityConfig, args, sparsity=args.sparsity)


def tracking_config(args: argparse.Namespace) -> TrackingConfig | None:
    """The trackers the flags ask for beside the run directory (None: none)."""
    tracking: TrackingConfig = from_args(TrackingConfig, args)
    return tracking if tracking.wanted() else None


def search_space(args: argparse.Namespace, profile_precisions: tuple[str, ...]) -> Space:
    """The `Space` of a `search` command line; precisions checked against the profile."""
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
    stages = _integers(args.zero_stages)
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ConfigError(
            f"--zero-stages takes a comma-separated list of 0, 1, 2 and 3, got {args.zero_stages!r}"
        )
    sizes = _integers(args.context_sizes)
    if not sizes or any(c < 1 or args.seq % c for c in sizes):
        raise ConfigError(
            f"--context-sizes takes a comma-separated list of positive integers that divide "
            f"--seq {args.seq}, got {args.context_sizes!r}"
        )
    return from_args(
        Space,
        args,
        precisions=precisions,
        overlap=overlap_config(args),
        zero_stages=stages,
        context_sizes=sizes,
    )


def _integers(text: str) -> tuple[int, ...]:
    """A comma-separated list of non-negative integers; empty where any part is not
    one (or there is none), for the caller to refuse with its flag's message."""
    parts = [s.strip() for s in text.split(",") if s.strip()]
    return tuple(int(s) for s in parts) if all(s.isdigit() for s in parts) else ()


def overlap_config(args: argparse.Namespace) -> Overlap:
    return from_args(Overlap, args)


def phased_config(args: argparse.Namespace) -> PhasedConfig | None:
    """The phased settings, or None; phased flags without --phased are an error
    (--weight-streaming is a configuration of phased execution)."""
    if not (args.phased or args.weight_streaming):
        given = changed(PhasedConfig, args)
        if given:
            raise ConfigError(f"{', '.join(given)} need --phased")
        return None
    return from_args(PhasedConfig, args)


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


def refuse_idle_settings(args: argparse.Namespace, par: Parallelism) -> None:
    """Flags given on the command line that would change nothing on mesh `par` (or beside
    another flag), refused rather than dropped: a user who asks for ZeRO on one replica,
    sequence parallelism on one tensor rank, a way of sending between pipeline stages
    where there is one stage, or a bucket size for gradients reduced at once has another
    layout or system in mind than the one planned or run."""
    given = set(changed(TrainConfig, args)) | set(changed(Overlap, args))
    mesh = "leave the flag out or change --mesh"
    idle = []
    if "--zero" in given and par.replica * par.context * par.expert == 1:
        idle.append(f"--zero {args.zero} shards over the devices that hold the same weights "
                    f"(replica, context), and {par} has one: {mesh}")  # fmt: skip
    if "--sequence-parallel" in given and par.tensor == 1:
        idle.append(f"--sequence-parallel splits over tensor, and {par} has tensor=1: {mesh}")
    if "--pipe-scatter-gather" in given:
        if par.pipe == 1:
            idle.append(
                f"--pipe-scatter-gather splits pipeline sends, and {par} has pipe=1: {mesh}"
            )
        elif par.tensor == 1:
            idle.append(f"--pipe-scatter-gather splits a send over tensor, and {par} has "
                        f"tensor=1: {mesh}")  # fmt: skip
        elif args.sequence_parallel:
            idle.append(
                "--pipe-scatter-gather splits what every tensor rank sends whole, and with "
                "--sequence-parallel each sends its own share already: leave out one of them"
            )
    for part in ("embedding", "loss"):
        flag = f"--account-for-{part}-in-pipeline-split"
        if flag in given and par.pipe == 1:
            idle.append(f"{flag} splits layers over pipeline stages, and {par} has pipe=1: {mesh}")
    if "--pipe-sends" in given and par.pipe == 1:
        idle.append(
            f"--pipe-sends {args.pipe_sends} times pipeline sends, and {par} has pipe=1: {mesh}"
        )
    if "--bucket-mb" in given and args.grad_reduce == "end":
        idle.append(
            "--bucket-mb sizes the buckets of --grad-reduce bucketed, and --grad-reduce end "
            "reduces all the gradients at once: leave out one of them"
        )
    if idle:
        raise ConfigError("; ".join(idle))
