"""The command line's arguments, and the settings they stand for.

Every flag is parsed here and turned into the config objects the library takes
(`ModelConfig`, `TrainConfig`, `PhasedConfig`); `__init__.py` runs the commands.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from shardemu import __version__
from shardemu.config import (
    DATASETS,
    PRECISIONS,
    ConfigError,
    ModelConfig,
    Parallelism,
    PhasedConfig,
    SparsityConfig,
    TrainConfig,
)
from shardemu.models import FAMILIES, PRESETS, custom_model, get_preset
from shardemu.parallel.schedules import SCHEDULES
from shardemu.report.trackers import DEFAULT_WANDB_PROJECT, TrackingConfig


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
        "--data", choices=DATASETS, default=defaults.data,
        help="training text: the synthetic Markov corpus, or the Python standard library's "
        "source as bytes (with a held-out validation split)",
    )  # fmt: skip
    p.add_argument(
        "--eval-every", type=int, default=None, metavar="K",
        help="the loss of held-out batches every K steps and after the last (val_loss)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="run directory (default runs/<model>-<timestamp>)")
    precision_arg(p)
    p.add_argument(
        "--sequence-parallel", action="store_true",
        help="split layer norms and residual adds over tensor by sequence (Korthikanti et "
        "al. 2022): reduce-scatter + all-gather instead of all-reduce, nothing repeated",
    )  # fmt: skip
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
        "--sparse-mode", choices=("static", "dynamic"), default=d.mode,
        help="static pattern, or dynamic prune-and-regrow",
    )  # fmt: skip
    p.add_argument(
        "--sparse-updates", type=int, default=d.updates, metavar="N",
        help="dynamic: pattern updates over the run",
    )  # fmt: skip
    p.add_argument(
        "--prune-ratio", type=float, default=d.prune_ratio,
        help="dynamic: fraction of non-zero blocks pruned at first, cosine-decayed",
    )  # fmt: skip
    p.add_argument(
        "--regrow", choices=("random", "gradient"), default=d.regrow,
        help="dynamic: which zero blocks regrow",
    )  # fmt: skip
    p.add_argument(
        "--sparse-distribution", choices=("uniform", "erk"), default=d.distribution,
        help="the same density in every kernel, or Erdos-Renyi-Kernel",
    )  # fmt: skip


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


def tracking_config(args: argparse.Namespace) -> TrackingConfig | None:
    """The trackers the flags ask for beside the run directory (None: none)."""
    if args.wandb is None and not args.tensorboard:
        return None
    return TrackingConfig(wandb=args.wandb, tensorboard=args.tensorboard)


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit status 2), like every
    other error of shardemu, instead of the usage text and the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="shardemu", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"shardemu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="train a model for real on a mesh of virtual devices", allow_abbrev=False
    )
    model_args(run, required=False)
    run.add_argument("--mesh", default="", help="pipe=P,tensor=T,replica=R (missing axes are 1)")
    run_args(run, TrainConfig())
    pipeline_args(run)
    tracking_args(run)

    demo = sub.add_parser(
        "demo", help="a short gpt-tiny run on 8 virtual devices (tensor=2, replica=4)"
    )
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--out", default=None, help="run directory (default runs/demo-<timestamp>)")

    describe = sub.add_parser(
        "describe", help="every parameter's shape, logical axes, spec and bytes per device"
    )
    model_args(describe)
    describe.add_argument("--mesh", default="", help="pipe=P,tensor=T,replica=R")
    describe.add_argument("--json", action="store_true", help="emit JSON instead of a table")
    shape_args(describe)
    phased_args(describe)

    plan = sub.add_parser(
        "plan", help="count a phased step in abstract mode: any preset, any mesh, no weights"
    )
    model_args(plan, required=False)  # required, but it may come from --config
    plan.add_argument("--mesh", default="", help="pipe=P,tensor=T,replica=R")
    plan.add_argument("--json", action="store_true", help="emit JSON instead of a table")
    plan.add_argument(
        "--hardware",
        default=None,
        help="predict the step on a profile (ipu-pod256, a100-80gb, ...) or a .toml/.json file",
    )
    plan.add_argument(
        "--out",
        default=None,
        help="run directory (default with --hardware: runs/plan-<model>-<time>)",
    )
    shape_args(plan)
    precision_arg(plan)
    overlap_args(plan)
    phased_args(plan)
    sparsity_args(plan)
    plan.add_argument(
        "--microbatch-size",
        type=int,
        default=None,
        help="sequences per microbatch per replica (default: the whole batch at once); "
        "phased plans run the batch as pipelined passes of this size",
    )
    pipeline_args(plan)
    plan.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default="full",
        help="resident plans: activation recomputation",
    )
    attention_arg(plan)
    tracking_args(plan)
    compare = sub.add_parser(
        "compare", help="runs side by side: the settings that differ, final metrics, a plot"
    )
    compare.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run directories, globs, or directories of runs"
    )
    compare.add_argument("--json", action="store_true", help="emit JSON instead of a table")
    compare.add_argument(
        "--plot", default="compare.png", metavar="PNG", help="where the figure goes"
    )

    sweep = sub.add_parser(
        "sweep", help="run or plan every trial of a W&B-style sweep file (TOML), resumably"
    )
    sweep.add_argument("sweep_file", metavar="SWEEP.toml")
    sweep.add_argument(
        "--out", default=None, help="sweep directory (default runs/sweep-<file name>)"
    )
    sweep.add_argument(
        "--count", type=int, default=None, metavar="N", help="run at most N unfinished trials"
    )
    search_args(sub.add_parser(
        "search", help="the auto-planner: every layout of a model on N devices, ranked"
    ))  # fmt: skip
    for command in sub.choices.values():
        command.allow_abbrev = False  # a flag is written in full: `given_options` relies on it
    parser.commands = sub.choices
    return parser


def search_args(p: argparse.ArgumentParser) -> None:
    from shardemu.predict.layouts import MODES, Space

    d = Space(precisions=())
    model_args(p)
    p.add_argument("--hardware", required=True, help="profile name or a .toml/.json file")
    p.add_argument("--devices", type=int, required=True, help="devices to lay the model out on")
    shape_args(p)
    p.add_argument(
        "--precision", default=None, metavar="P[,P...]",
        help="precisions to search (default: every one the profile computes in)",
    )  # fmt: skip
    p.add_argument(
        "--modes", choices=MODES, default=d.modes,
        help="resident, phased, both, or auto: phased only when no resident layout fits",
    )  # fmt: skip
    overlap_args(p)
    attention_arg(p)
    p.add_argument("--max-tensor", type=int, default=d.max_tensor, help="largest tensor axis")
    p.add_argument(
        "--max-microbatch", type=int, default=d.max_microbatch, help="largest microbatch size"
    )
    p.add_argument("--top", type=int, default=5, help="layouts to plan whole and print")
    p.add_argument("--out", default=None, help="output folder (default runs/search-<model>-<time>)")
    p.add_argument("--json", action="store_true", help="print search.json instead of a table")
    p.add_argument(
        "--no-verify", action="store_true",
        help="skip training the winner's scaled-down layout against one device",
    )  # fmt: skip


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


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the options `argv` writes out for its command (the ones a
    user chose, as opposed to defaults). Abbreviations are off, so an option is given
    exactly when its full name, or `name=value`, is one of the words."""
    command = parser.commands.get(argv[0]) if argv else None
    if command is None:
        return set()
    words = {word.split("=", 1)[0] for word in argv[1:] if word.startswith("-")}
    return {a.dest for a in command._actions if words.intersection(a.option_strings)}


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


def precision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--precision", choices=PRECISIONS, default=TrainConfig().precision,
        help="fp32; or 16-bit weights, activations and gradients with FP32 master weights "
        "and optimizer state: bf16, fp16-mixed (with dynamic loss scaling)",
    )  # fmt: skip


def overlap_args(p: argparse.ArgumentParser) -> None:
    """How the training system overlaps communication (`predict/overlap.py`)."""
    from shardemu.predict.overlap import GRAD_REDUCE, PIPE_SENDS, Overlap

    d = Overlap()
    p.add_argument(
        "--grad-reduce", choices=GRAD_REDUCE, default=d.grad_reduce,
        help="resident plans: all-reduce gradients in buckets during the last backward "
        "(PyTorch DDP, Megatron --overlap-grad-reduce) or all at the end (Megatron-LM 2021)",
    )  # fmt: skip
    p.add_argument(
        "--bucket-mb", type=float, default=d.bucket_mb,
        help="gradient bucket size in MiB for --grad-reduce bucketed (DDP's bucket_cap_mb)",
    )  # fmt: skip
    p.add_argument(
        "--pipe-sends", choices=PIPE_SENDS, default=d.pipe_sends,
        help="pipeline sends overlap the sender's next computation, or block it",
    )  # fmt: skip


def attention_arg(p: argparse.ArgumentParser) -> None:
    from shardemu.predict.resident_count import ATTENTION

    p.add_argument(
        "--attention", choices=ATTENTION, default=ATTENTION[0],
        help="resident plans: the attention core as XLA emits it, its [s, s] scores in "
        "memory, or fused (FlashAttention) without them",
    )  # fmt: skip


def overlap_config(args: argparse.Namespace) -> Any:
    from shardemu.predict.overlap import Overlap

    return Overlap(args.grad_reduce, args.bucket_mb, args.pipe_sends)


def shape_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--batch", type=int, default=d.batch, help="global batch (all replicas)")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length")


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
