"""The `shardemu` command's parser: one sub-command per command, each from the flag
groups of `args.py`; usage errors in one line."""

from __future__ import annotations

import argparse
from typing import NoReturn

from shardemu import __version__
from shardemu.cli.args import (
    attention_arg,
    config_arg,
    model_args,
    overlap_args,
    phased_args,
    pipeline_args,
    precision_arg,
    run_args,
    search_space_args,
    sequence_parallel_arg,
    shape_args,
    sparsity_args,
    tracking_args,
)
from shardemu.predict.layouts import RECOMPUTE

DESCRIPTION = "Run a large-model training recipe on virtual devices and see what it would cost."


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit status 2), like every
    other error of shardemu, instead of the usage text and the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="shardemu", description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"shardemu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="train a model for real on a mesh of virtual devices", allow_abbrev=False
    )
    model_args(run, required=False)
    run.add_argument("--mesh", default="", help="pipe=P,tensor=T,replica=R (missing axes are 1)")
    run_args(run)
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
    model_args(describe, required=False)  # required, but it may come from --config
    describe.add_argument("--mesh", default="", help="pipe=P,tensor=T,replica=R")
    describe.add_argument("--json", action="store_true", help="emit JSON instead of a table")
    shape_args(describe)
    phased_args(describe)
    config_arg(describe)

    plan_args(
        sub.add_parser(
            "plan",
            help="count a step over shapes alone (resident, pipelined, phased or weight "
            "streaming; any preset, any mesh, no weights) and, with --hardware, time it",
        )
    )

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
    search_args(
        sub.add_parser(
            "search", help="the auto-planner: every layout of a model on N devices, ranked"
        )
    )
    for command in sub.choices.values():
        command.allow_abbrev = False  # a flag is written in full: `given_options` relies on it
    parser.commands = sub.choices
    return parser


def search_args(p: argparse.ArgumentParser) -> None:
    model_args(p, required=False)  # required, but it may come from --config
    p.add_argument("--hardware", required=True, help="profile name or a .toml/.json file")
    p.add_argument("--devices", type=int, required=True, help="devices to lay the model out on")
    shape_args(p)
    p.add_argument(
        "--precision",
        default=None,
        metavar="P[,P...]",
        help="precisions to search (default: every one the profile computes in)",
    )
    p.add_argument(
        "--zero-stages",
        default="0",
        metavar="S[,S...]",
        help="ZeRO stages to search resident layouts of several replicas at (0-3; default 0)",
    )
    p.add_argument(
        "--context-sizes",
        default="1",
        metavar="C[,C...]",
        help="context-parallel sizes to search layouts at (each must divide --seq; default 1)",
    )
    search_space_args(p)
    p.add_argument("--top", type=int, default=5, help="layouts to plan whole and print")
    p.add_argument("--out", default=None, help="output folder (default runs/search-<model>-<time>)")
    p.add_argument("--json", action="store_true", help="print search.json instead of a table")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip training the winner's scaled-down layout against one device",
    )
    config_arg(p)


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the options `argv` writes out for its command (the ones a
    user chose, as opposed to defaults). Abbreviations are off, so an option is given
    exactly when its full name, or `name=value`, is one of the words."""
    command = parser.commands.get(argv[0]) if argv else None
    if command is None:
        return set()
    words = {word.split("=", 1)[0] for word in argv[1:] if word.startswith("-")}
    return {a.dest for a in command._actions if words.intersection(a.option_strings)}


def plan_args(plan: argparse.ArgumentParser) -> None:
    """`shardemu plan`: a model, a layout and its settings, counted without weights."""
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
    sequence_parallel_arg(plan)
    overlap_args(plan)
    phased_args(plan)
    sparsity_args(plan)
    plan.add_argument(
        "--microbatch-size",
        type=int,
        default=None,
        help="sequences per microbatch per replica (default: on pipelines, the fastest "
        "size that fits; on one stage, the whole batch if it fits, else the fastest that "
        "does); phased plans run the batch as pipelined passes of this size",
    )
    pipeline_args(plan)
    plan.add_argument(
        "--allow-overflow",
        action="store_true",
        help="plan a layout that does not fit its hardware's memory anyway, with a warning "
        "(without it: exit status 4 after the plan is written)",
    )
    plan.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="full",
        help="resident plans: activation recomputation (selective: Korthikanti et al.'s, "
        "the attention core; selective-op: TorchTitan's, every other matmul output kept, "
        "with --attention fused)",
    )
    attention_arg(plan)
    tracking_args(plan)
