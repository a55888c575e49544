"""The `shardemu` command: `run`, `demo`, `describe`, `plan`.

Virtual devices must be requested before JAX starts its backend, so `run` sets them up
first thing, before anything touches a device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from shardemu.config import (
    ConfigError,
    ModelConfig,
    Parallelism,
    PhasedConfig,
    TrainConfig,
    custom_model,
    get_preset,
)
from shardemu.devices import use_virtual_devices
from shardemu.errors import ShardemuError
from shardemu.parallel.schedules import SCHEDULES
from shardemu.predict.hardware import get_hardware
from shardemu.report.tables import param_table, print_phase_plan, summary_table

console = Console(stderr=True)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="preset name (gpt-tiny, gpt2-small, bert-base, ...), or gpt / bert with --layers "
        "--hidden --heads [--vocab]",
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


def _model_config(args: argparse.Namespace) -> ModelConfig:
    dims = {"--layers": args.layers, "--hidden": args.hidden, "--heads": args.heads}
    if args.model in ("gpt", "bert"):
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
    return cfg.pad_vocab(args.pad_vocab) if args.pad_vocab else cfg


def _run_args(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
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
        help="microbatches per step, run as a GPipe pipeline over the pipe axis",
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
    p.add_argument("--out", default=None, help="run directory (default runs/<model>-<timestamp>)")
    p.add_argument(
        "--hardware",
        default=None,
        help="add the predicted step on a profile (ipu-pod16, a100-80gb, ...) or a .toml file",
    )
    _phased_args(p)


def _phased_args(p: argparse.ArgumentParser) -> None:
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
        choices=("keep", "offload", "recompute"),
        default=d.activations,
        help="what a phase's backward gets from its forward",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardemu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train a model for real on a mesh of virtual devices")
    _model_args(run)
    run.add_argument("--mesh", default="", help="pipe=P,tensor=T,replica=R (missing axes are 1)")
    _run_args(run, TrainConfig())

    demo = sub.add_parser(
        "demo", help="a short gpt-tiny run on 8 virtual devices (tensor=2, replica=4)"
    )
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--out", default=None, help="run directory (default runs/demo-<timestamp>)")

    describe = sub.add_parser(
        "describe", help="every parameter's shape, logical axes, spec and bytes per device"
    )
    _model_args(describe)
    describe.add_argument("--mesh", default="", help="pipe=P,tensor=T,replica=R")
    describe.add_argument("--json", action="store_true", help="emit JSON instead of a table")
    _shape_args(describe)
    _phased_args(describe)

    plan = sub.add_parser(
        "plan", help="count a phased step in abstract mode: any preset, any mesh, no weights"
    )
    _model_args(plan)
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
    _shape_args(plan)
    _phased_args(plan)
    plan.add_argument(
        "--microbatch-size",
        type=int,
        default=None,
        help="sequences per microbatch per replica (default: the whole batch at once); "
        "phased plans run the batch as pipelined passes of this size",
    )
    plan.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="resident plans")
    plan.add_argument(
        "--virtual", type=int, default=2, help="model chunks per device (interleaved schedule)"
    )
    plan.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default="full",
        help="resident plans: activation recomputation",
    )
    return parser


def _shape_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--batch", type=int, default=d.batch, help="global batch (all replicas)")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length")


def cmd_run(args: argparse.Namespace) -> None:
    par = Parallelism.parse(args.mesh)
    devices = use_virtual_devices(args.devices or par.num_devices)
    from shardemu.training.runner import train  # after the device count is fixed

    train_cfg = TrainConfig(
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        seed=args.seed,
        microbatches=args.microbatches,
        grad_accum=args.grad_accum,
        optimizer=args.optimizer,
        learning_rate=args.lr,
        warmup_steps=args.warmup,
    )
    model_cfg = _model_config(args)
    console.print(f"[bold]shardemu run[/] {model_cfg.name} on mesh {par}: compiling ...")
    with Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("train", total=train_cfg.steps, loss="-")

        def on_step(record: dict[str, Any]) -> None:
            progress.update(task, advance=1, loss=f"{record['loss']:.4f}")

        result = train(
            model_cfg,
            par,
            train_cfg,
            out=args.out,
            devices=devices,
            on_step=on_step,
            phased=_phased(args),
            hardware=get_hardware(args.hardware) if args.hardware else None,
        )
    Console().print(summary_table(f"shardemu run: {model_cfg.name}", result.summary))


def demo_argv(steps: int, out: str | None) -> list[str]:
    """The `shardemu run` command line the demo stands for."""
    from shardemu.report.rundir import default_run_dir

    return [
        "run", "--model", "gpt-tiny", "--mesh", "tensor=2,replica=4", "--devices", "8",
        "--steps", str(steps), "--batch", "16", "--seq", "64", "--seed", "0",
        "--out", str(out or default_run_dir("demo")),
    ]  # fmt: skip


def _phased(args: argparse.Namespace) -> PhasedConfig | None:
    """The phased settings, or None; phased flags without --phased are an error."""
    d = PhasedConfig()
    given = [
        flag
        for flag, value, default in (
            ("--phases", args.phases, None),
            ("--device-memory", args.device_memory, None),
            ("--rts", args.rts, d.rts),
            ("--rts-optimizer", args.rts_optimizer, None),
            ("--activations", args.activations, d.activations),
            ("--optimizer-on", args.optimizer_on, d.optimizer_on),
            ("--no-prefetch", args.prefetch, d.prefetch),
        )
        if value != default
    ]
    if not args.phased:
        if given:
            raise ConfigError(f"{', '.join(given)} need --phased")
        return None
    return PhasedConfig(
        phases=args.phases,
        device_memory=args.device_memory,
        rts=args.rts,
        rts_optimizer=args.rts_optimizer,
        activations=args.activations,
        optimizer_on=args.optimizer_on,
        prefetch=args.prefetch,
    )


def cmd_demo(args: argparse.Namespace) -> None:
    argv = demo_argv(args.steps, args.out)
    console.print(f"[dim]demo = shardemu {' '.join(argv)}[/]", highlight=False, soft_wrap=True)
    cmd_run(build_parser().parse_args(argv))


def cmd_describe(args: argparse.Namespace) -> None:
    from shardemu.report.describe import describe

    par = Parallelism.parse(args.mesh)
    phased = _phased(args)
    if phased:  # the plan runs on one stage's virtual devices: set them up first
        use_virtual_devices(par.tensor * par.replica)
    model_cfg = _model_config(args)
    report = describe(model_cfg, par)
    if phased:
        from shardemu.predict.plan_phased import plan_phased

        train_cfg = TrainConfig(batch=args.batch, seq=args.seq)
        report["phase_plan"] = plan_phased(model_cfg, par, train_cfg, phased)["plan"]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    out = Console()
    out.print(param_table(report))
    for key in ("param_count", "param_bytes", "bytes_per_device"):
        out.print(f"{key}: {report[key]:,}")
    if phased:
        print_phase_plan(out, report["phase_plan"])


def cmd_plan(args: argparse.Namespace) -> None:
    par = Parallelism.parse(args.mesh)
    phased = _phased(args)
    hardware = get_hardware(args.hardware) if args.hardware else None
    if phased is None:
        _plan_resident(args, par, hardware)
        return
    use_virtual_devices(par.tensor * par.replica)  # one pipeline stage's devices
    from shardemu.predict.plan_phased import flatten, plan_phased
    from shardemu.report.rundir import default_run_dir

    model_cfg = _model_config(args)
    out = args.out or (default_run_dir(f"plan-{model_cfg.name}") if hardware else None)
    train_cfg = TrainConfig(batch=args.batch, seq=args.seq)
    report = plan_phased(
        model_cfg, par, train_cfg, phased, hardware=hardware, out=out,
        microbatch_size=args.microbatch_size,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return
    out_console = Console()
    out_console.print(
        summary_table(f"shardemu plan: {report['model']} on mesh {report['mesh']}", flatten(report))
    )
    print_phase_plan(out_console, report["plan"])


def _plan_resident(args: argparse.Namespace, par: Parallelism, hardware: Any) -> None:
    """`shardemu plan` without --phased: a resident pipelined step on `hardware`."""
    if hardware is None:
        raise ConfigError("a resident plan predicts a step: give --hardware NAME (or add --phased)")
    use_virtual_devices(par.tensor)  # one stage's tensor group counts a microbatch
    from shardemu.predict.plan_phased import flatten, write_plan_dir
    from shardemu.predict.plan_resident import plan_resident
    from shardemu.report.rundir import default_run_dir

    model_cfg = _model_config(args)
    micro = args.microbatch_size or args.batch // par.replica
    virtual = args.virtual if args.schedule == "interleaved" else 1
    report, ledger, timeline = plan_resident(
        model_cfg, par, args.batch, args.seq, micro, hardware, args.schedule, virtual,
        args.recompute,
    )  # fmt: skip
    write_plan_dir(
        Path(args.out or default_run_dir(f"plan-{model_cfg.name}")), report, ledger, timeline
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return
    Console().print(
        summary_table(f"shardemu plan: {report['model']} on {report['mesh']}", flatten(report))
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"run": cmd_run, "demo": cmd_demo, "describe": cmd_describe, "plan": cmd_plan}
    try:
        commands[args.command](args)
    except ShardemuError as err:
        console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
