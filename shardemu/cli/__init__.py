"""The `shardemu` command: `run`, `demo`, `describe`, `plan`, `search`, `compare`, `sweep`.

Virtual devices must be requested before JAX starts its backend, so `run` sets them up
first thing, before anything touches a device.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from shardemu.allocation import fewer_collections
from shardemu.cli.compile_cache import command_cache
from shardemu.cli.config_file import apply_settings, read_settings
from shardemu.cli.fields import flag_message
from shardemu.cli.parser import build_parser, given_options
from shardemu.cli.planning import cmd_plan, cmd_search
from shardemu.cli.settings import (
    model_config,
    parallelism,
    phased_config,
    refuse_idle_settings,
    tracking_config,
    train_config,
)
from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.devices import use_virtual_devices
from shardemu.errors import RunInterrupted, ShardemuError, TrialsFailed
from shardemu.launch import join, launch, process_index, scratch_folder
from shardemu.predict.profiles import get_hardware
from shardemu.report.tables import param_table, print_phase_plan, summary_table

console = Console(stderr=True)


class _Warnings(logging.Handler):
    """The library's notices (the `shardemu` logger: a damaged checkpoint passed over)
    as one `warning:` line each, flags named as the command line spells them."""

    def emit(self, record: logging.LogRecord) -> None:
        message = escape(flag_message(record.getMessage()))
        console.print(f"[bold yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


_WARNINGS = _Warnings(logging.WARNING)


# the options a resumed run may set; its other settings are the run's own (config.json)
RESUME_MAY_CHANGE = (
    "steps", "mesh", "devices", "out", "hardware", "checkpoint_every", "wandb", "tensorboard",
)  # fmt: skip


def cmd_run(args: argparse.Namespace) -> None:
    if args.resume is not None:
        _run_resumed(args)
        return
    par = parallelism(args)
    refuse_idle_settings(args, par)
    devices = _devices(args, par)
    train_cfg = train_config(args)
    model_cfg = model_config(args)
    _train_with_progress(
        model_cfg, par, train_cfg, devices, out=args.out, phased=phased_config(args),
        hardware=get_hardware(args.hardware) if args.hardware else None,
        checkpoint_every=args.checkpoint_every, tracking=tracking_config(args),
        eval_every=args.eval_every,
    )  # fmt: skip


def _device_count(args: argparse.Namespace, par: Parallelism) -> int:
    """--devices, or the mesh's size."""
    return args.devices if args.devices is not None else par.num_devices


def _devices(args: argparse.Namespace, par: Parallelism) -> list[Any]:
    """The run's devices: virtual ones in this process, or, in a process the launcher
    started (`--processes`), the global devices of all of them."""
    count = _device_count(args, par)
    if process_index() is None:
        return use_virtual_devices(count, reuse_memory=True)  # a run steps: see devices.py
    import jax

    join(count)
    if process_index() != 0:  # the run directory and the trackers are process 0's
        args.out = scratch_folder()
        args.wandb, args.tensorboard = None, False
    return jax.devices()


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """`run --processes N`: check what the processes could not do, then launch them."""
    n = args.processes
    if args.resume is not None:  # the run's own settings (`_run_resumed`)
        was, par, train_cfg = _resumed(args)
        model, phased, rules = was.model, was.phased, was.rules
    else:
        par, train_cfg, rules = parallelism(args), train_config(args), None
        model, phased = model_config(args), phased_config(args)
    count = _device_count(args, par)
    if n < 1 or count % n:
        raise ConfigError(
            f"--processes {n} must be positive and divide the {count} devices (each "
            f"process brings the same number)"
        )
    # every setting checked once, here, before a process starts: a refusal is one line
    # (each process would print it, and the launcher a line more)
    from shardemu.models import as_model
    from shardemu.parallel.mesh import mesh_from
    from shardemu.run.engine import make_engine

    devices = use_virtual_devices(count)
    make_engine(as_model(model), mesh_from(par, devices), train_cfg, phased, rules)
    return launch(n, argv)


def _run_resumed(args: argparse.Namespace) -> None:
    """`run --resume RUN_DIR`: the run's own settings, with the few that may change."""
    was, par, train_cfg = _resumed(args)
    tracking = was.tracking
    if args.given & {"wandb", "tensorboard"}:
        tracking = tracking_config(args)
    devices = _devices(args, par)
    _train_with_progress(
        was.model, par, train_cfg, devices, out=args.out, phased=was.phased,
        hardware=get_hardware(args.hardware) if args.hardware else None, rules=was.rules,
        checkpoint_every=(
            args.checkpoint_every if "checkpoint_every" in args.given else was.checkpoint_every
        ),
        resume=args.resume, tracking=tracking, eval_every=was.eval_every,
    )  # fmt: skip


def _resumed(args: argparse.Namespace) -> tuple[Any, Parallelism, TrainConfig]:
    """The settings of the run `--resume` names (`resume_settings`), and its mesh and
    training settings with what the command line may change (`--mesh`, `--steps`); a
    flag that may not change is refused."""
    fixed = sorted(args.given - {"resume", "processes", *RESUME_MAY_CHANGE})
    if fixed:
        run = build_parser().commands["run"]
        flag = {a.dest: a.option_strings[0] for a in run._actions if a.option_strings}
        may = [flag[dest] for dest in (*RESUME_MAY_CHANGE, "processes")]
        raise ConfigError(
            f"{', '.join(flag[dest] for dest in fixed)} cannot change when resuming: the "
            f"run's settings come from {args.resume}/config.json; only {', '.join(may[:-1])} "
            f"and {may[-1]} may be given with --resume"
        )
    from shardemu.run.record import resume_settings

    was = resume_settings(args.resume)
    par = parallelism(args) if "mesh" in args.given else was.parallelism
    train_cfg = was.train
    if "steps" in args.given:
        train_cfg = dataclasses.replace(train_cfg, steps=args.steps)
    return was, par, train_cfg


def _train_with_progress(
    model_cfg: Any, par: Parallelism, train_cfg: TrainConfig, devices: Any,
    **kwargs: Any,
) -> None:  # fmt: skip
    """`train` with a progress bar on stderr, then the summary table on stdout. The
    caller has fixed the device count, so the runner may be imported now."""
    from shardemu.run.runner import train

    with Progress(
        TextColumn(f"[bold]shardemu run[/] {model_cfg.name} on {par}: {{task.description}}"),
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("compiling", total=train_cfg.steps, loss="-")

        def on_step(record: dict[str, Any]) -> None:
            progress.update(
                task,
                description="training",
                completed=record["step"] + 1,
                loss=f"{record['loss']:.4f}",
            )

        result = train(model_cfg, par, train_cfg, devices=devices, on_step=on_step, **kwargs)
    Console().print(summary_table(f"shardemu run: {model_cfg.name}", result.summary))


def cmd_demo(args: argparse.Namespace) -> None:
    """Three runs of gpt-tiny (`demo.py`), then what they show."""
    from shardemu.cli.demo import demo_runs, story

    if args.steps < 1:
        raise ConfigError(f"demo --steps must be a positive integer, got {args.steps}")
    runs = demo_runs(args.steps, args.out)
    for name, argv in runs.items():
        console.print(
            f"[dim]{name}: shardemu {escape(' '.join(argv))}[/]", highlight=False, soft_wrap=True
        )
        if name == "sharded":  # its table is the one to read
            cmd_run(parse(argv))
        else:
            with contextlib.redirect_stdout(io.StringIO()):
                cmd_run(parse(argv))
    Console().print(story({name: Path(argv[-1]) for name, argv in runs.items()}))


def cmd_describe(args: argparse.Namespace) -> None:
    from shardemu.report.describe import describe

    par = parallelism(args)
    phased = phased_config(args)
    if phased:  # the plan runs on one stage's virtual devices: set them up first
        use_virtual_devices(par.tensor * par.replica)
    model_cfg = model_config(args)
    report = describe(model_cfg, par)
    phase_plan = None
    if phased:
        from shardemu.predict.plan_phased import plan_phased

        phase_plan = plan_phased(model_cfg, par, train_config(args), phased).phase_plan
        report["phase_plan"] = phase_plan.to_json()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    out = Console()
    out.print(param_table(report))
    for key in ("param_count", "param_bytes", "bytes_per_device"):
        out.print(f"{key}: {report[key]:,}")
    if phase_plan is not None:
        print_phase_plan(out, phase_plan)


def cmd_compare(args: argparse.Namespace) -> None:
    from shardemu.report.compare import compare, find_runs, plot_compare
    from shardemu.report.tables import compare_table

    runs = find_runs(args.runs)
    report = {**compare(runs), "plot": str(plot_compare(runs, Path(args.plot)))}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    Console().print(compare_table(report, [r.name for r in runs]))
    console.print(f"plot: {report['plot']}", highlight=False, markup=False)


def _devices_needed(args: argparse.Namespace) -> int:
    """The virtual devices a run or plan command line needs in this process."""
    par = parallelism(args)
    if args.command == "run":
        return _device_count(args, par)
    from shardemu.predict.planning import plan_devices_needed

    return plan_devices_needed(par, bool(args.phased or args.weight_streaming))


def cmd_sweep(args: argparse.Namespace) -> None:
    """Every trial's settings are checked, and the devices the widest needs set up,
    before the first trial; trials then run in this process, one after another."""
    from shardemu.report.sweep import load_sweep, run_sweep

    sweep = load_sweep(args.sweep_file)
    if args.count is not None and args.count < 1:
        raise ConfigError(f"--count {args.count} must be a positive number of trials")
    out = Path(args.out or f"runs/sweep-{Path(args.sweep_file).stem}")
    parser = build_parser()

    def trial_args(params: dict[str, Any], run_dir: Path) -> argparse.Namespace:
        trial = parser.parse_args([sweep.command, "--out", str(run_dir)])
        trial.given = {"out"}
        where = f"{sweep.source} ({run_dir.name})"
        apply_settings(parser.commands[sweep.command], trial, params, where)
        return trial

    use_virtual_devices(max(_devices_needed(trial_args(p, out)) for p in sweep.trials()))

    def run_trial(params: dict[str, Any], run_dir: Path) -> None:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # one line per trial, not its table
                COMMANDS[sweep.command](trial_args(params, run_dir))
        except ShardemuError as err:  # recorded in sweep.json as the command line says it
            err.args = (flag_message(str(err)),)
            raise

    table = run_sweep(
        sweep,
        out,
        run_trial,
        args.count,
        log=lambda line: console.print(line, highlight=False, markup=False),
    )
    finished = sum(r["status"] == "finished" for r in table)
    failed = sum(r["status"] == "failed" for r in table)
    Console().print((out / "summary.md").read_text(), highlight=False, markup=False)
    console.print(
        f"{finished} of {len(table)} trials finished; {out}/sweep.json",
        highlight=False,
        markup=False,
    )
    if failed and not finished:
        raise TrialsFailed(f"every trial that ran failed ({failed}); why is in {out}/sweep.json")


def parse(argv: list[str]) -> argparse.Namespace:
    """The parsed command line, with `given`: the options it writes out."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.given = given_options(parser, argv)
    if getattr(args, "config", None) is not None:
        command = parser.commands[args.command]
        apply_settings(command, args, read_settings(args.config, command), args.config)
    return args


COMMANDS = {
    "run": cmd_run, "demo": cmd_demo, "describe": cmd_describe, "plan": cmd_plan,
    "compare": cmd_compare, "sweep": cmd_sweep, "search": cmd_search,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.getLogger("shardemu").addHandler(_WARNINGS)  # once: added only if not there
    try:
        args = parse(argv)
        command_cache()
        if args.command == "run" and args.processes is not None and process_index() is None:
            return _launch(args, argv)
        with fewer_collections():
            COMMANDS[args.command](args)
    except SystemExit as done:  # --help, --version, or a usage error argparse has printed
        return int(done.code or 0)
    except ShardemuError as err:
        if isinstance(err, RunInterrupted) and process_index() not in (None, 0):
            return err.exit_code  # process 0 says how to resume; this one's folder is scratch
        message = escape(flag_message(str(err)))  # TrainConfig.seed -> --seed
        console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
