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
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from shardemu.cli.args import (
    build_parser,
    given_options,
    model_config,
    overlap_config,
    parallelism,
    phased_config,
    pipeline_config,
    search_space,
    sparsity_config,
    tracking_config,
)
from shardemu.cli.config_file import apply_settings, read_settings
from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.devices import MAX_VIRTUAL_DEVICES, use_virtual_devices
from shardemu.errors import ShardemuError
from shardemu.launch import join, launch, process_index
from shardemu.models import Model
from shardemu.numerics.precision import arithmetic
from shardemu.predict.profiles import get_hardware
from shardemu.report.tables import param_table, print_phase_plan, summary_table

console = Console(stderr=True)


# the options a resumed run may set; its other settings are the run's own (config.json)
RESUME_MAY_CHANGE = (
    "steps", "mesh", "devices", "out", "hardware", "checkpoint_every", "wandb", "tensorboard",
)  # fmt: skip


def cmd_run(args: argparse.Namespace) -> None:
    if args.resume is not None:
        _run_resumed(args)
        return
    par = parallelism(args)
    devices = _devices(args, par)
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
        sparsity=sparsity_config(args),
        data=args.data,
        precision=args.precision,
        sequence_parallel=args.sequence_parallel,
        **pipeline_config(args),
    )
    model_cfg = model_config(args)
    _train_with_progress(
        model_cfg, par, train_cfg, devices, out=args.out, phased=phased_config(args),
        hardware=get_hardware(args.hardware) if args.hardware else None,
        checkpoint_every=args.checkpoint_every, tracking=tracking_config(args),
        eval_every=args.eval_every,
    )  # fmt: skip


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


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
        args.out = tempfile.mkdtemp(prefix=f"shardemu-process-{process_index()}-")
        args.wandb, args.tensorboard = None, False
    return jax.devices()


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """`run --processes N`: check what the processes could not do, then launch them."""
    n, par = args.processes, parallelism(args)
    count = _device_count(args, par)
    if n < 1 or count % n:
        raise ConfigError(
            f"--processes {n} must be positive and divide the {count} devices (each "
            f"process brings the same number)"
        )
    unsupported = [
        flag
        for flag, used in (
            ("--mesh pipe > 1", par.pipe > 1), ("--microbatches > 1", args.microbatches > 1),
            ("--phased", args.phased or args.weight_streaming),
            ("--checkpoint-every", args.checkpoint_every is not None),
            ("--resume", args.resume is not None),
        )
        if used
    ]  # fmt: skip
    if unsupported:
        raise ConfigError(
            f"--processes runs resident steps only for now; {', '.join(unsupported)} "
            f"is not supported across processes yet (drop --processes)"
        )
    return launch(n, argv)


def _run_resumed(args: argparse.Namespace) -> None:
    """`run --resume RUN_DIR`: the run's own settings, with the few that may change."""
    fixed = sorted(args.given - {"resume", *RESUME_MAY_CHANGE})
    if fixed:
        may = [_flag(dest) for dest in RESUME_MAY_CHANGE]
        raise ConfigError(
            f"{', '.join(_flag(dest) for dest in fixed)} cannot change when resuming: the "
            f"run's settings come from {args.resume}/config.json; only {', '.join(may[:-1])} "
            f"and {may[-1]} may be given with --resume"
        )
    from shardemu.run.record import resume_settings

    was = resume_settings(args.resume)
    par = parallelism(args) if "mesh" in args.given else was.parallelism
    train_cfg = was.train
    if "steps" in args.given:
        train_cfg = dataclasses.replace(train_cfg, steps=args.steps)
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
    if phased:
        from shardemu.predict.plan_phased import plan_phased

        train_cfg = TrainConfig(batch=args.batch, seq=args.seq)
        report["phase_plan"] = plan_phased(model_cfg, par, train_cfg, phased).report["plan"]
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
    """Every setting is checked before anything is counted or written."""
    from shardemu.pipelined.layout import pipeline_layout
    from shardemu.predict.plan_phased import plan_devices
    from shardemu.report.plandir import flatten
    from shardemu.report.rundir import default_run_dir, require_new

    par = parallelism(args)
    phased = phased_config(args)
    overlap = overlap_config(args)  # refused now, not after counting
    if phased is not None and args.attention != "materialized":
        raise ConfigError(
            f"--attention {args.attention} is for resident plans: the phased planner times "
            f"the attention XLA emits; leave out --attention or --phased"
        )
    if phased is not None and args.recompute != "full":
        raise ConfigError(
            f"--recompute {args.recompute} is for resident plans: a phased plan keeps, "
            f"offloads or recomputes activations as --activations says"
        )
    if phased is not None and args.stage_layers is not None:
        raise ConfigError(
            f"--stage-layers {args.stage_layers} is for resident plans: phased stages run "
            f"equal phases of layers; leave out --stage-layers or --phased"
        )
    hardware = get_hardware(args.hardware) if args.hardware else None
    tracking = tracking_config(args)
    if tracking is not None:
        tracking.check_installed()
        if args.out is None and hardware is None:
            raise ConfigError(
                "--wandb and --tensorboard log a plan's run directory: give --out DIR "
                "(or --hardware, which writes one)"
            )
    if phased is None and hardware is None:
        raise ConfigError("a resident plan predicts a step: give --hardware NAME (or add --phased)")
    model_cfg = model_config(args)
    sparse = sparsity_config(args)
    train_cfg = TrainConfig(
        batch=args.batch, seq=args.seq, sparsity=sparse, precision=args.precision,
        **pipeline_config(args),
        # a plan counts one step; a dynamic pattern's update schedule is not timed
        **({"steps": sparse.updates} if sparse else {}),
    )  # fmt: skip
    Model(model_cfg).check_fits(train_cfg, par)
    if train_cfg.stage_layers is not None:  # refused now, not after counting
        pipeline_layout(model_cfg.num_layers, par.pipe, train_cfg.virtual, train_cfg.stage_layers)
    if hardware is not None:
        hardware.at_precision(arithmetic(model_cfg, train_cfg.precision))  # refused now
    micro = args.microbatch_size
    if micro is not None and (micro < 1 or args.batch % (par.replica * micro)):
        raise ConfigError(
            f"--microbatch-size {micro} must be positive and divide the batch per replica "
            f"(--batch {args.batch} / replica={par.replica})"
        )
    if phased is not None and plan_devices(par) > MAX_VIRTUAL_DEVICES:
        raise ConfigError(
            f"a phased plan counts one stage on tensor x replica = {plan_devices(par)} "
            f"virtual devices, more than the {MAX_VIRTUAL_DEVICES} XLA's CPU backend compiles "
            f"for in one process; plan a smaller replica, or plan without --phased (it "
            f"counts one tensor group)"
        )
    out = args.out or (default_run_dir(f"plan-{model_cfg.name}") if hardware else None)
    if out is not None:
        require_new(Path(out))
    use_virtual_devices(plan_devices(par) if phased else par.tensor)  # one stage's devices
    from shardemu.predict.planning import plan

    planned = plan(
        model_cfg, par, train_cfg, hardware, phased=phased, microbatch_size=micro,
        recompute=args.recompute, attention=args.attention, overlap=overlap,
    )  # fmt: skip
    report = planned.report
    if "microbatch_choice" in report:
        _say_microbatch(report["microbatch_choice"])
    if out is not None:
        from shardemu.report.plandir import write_plan_dir

        write_plan_dir(Path(out), planned, tracking)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    table = Console()
    table.print(
        summary_table(f"shardemu plan: {report['model']} on {report['mesh']}", flatten(report))
    )
    if phased is not None:
        print_phase_plan(table, report["plan"])


def _say_microbatch(choice: dict[str, Any]) -> None:
    """On stderr: the microbatch size a pipelined plan chose, since none was given."""
    tried = ", ".join(choice["step_time_s"])
    console.print(
        f"--microbatch-size {choice['chosen']} (not given: of {tried} sequences per "
        f"microbatch, {choice['rule']}; pass --microbatch-size to choose)",
        highlight=False, markup=False,
    )  # fmt: skip


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
    from shardemu.predict.plan_phased import plan_devices

    return plan_devices(par) if args.phased or args.weight_streaming else par.tensor


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
        with contextlib.redirect_stdout(io.StringIO()):  # one line per trial, not its table
            COMMANDS[sweep.command](trial_args(params, run_dir))

    table = run_sweep(
        sweep,
        out,
        run_trial,
        args.count,
        log=lambda line: console.print(line, highlight=False, markup=False),
    )
    finished = sum(r["status"] == "finished" for r in table)
    Console().print((out / "summary.md").read_text(), highlight=False, markup=False)
    console.print(
        f"{finished} of {len(table)} trials finished; {out}/sweep.json",
        highlight=False,
        markup=False,
    )


def cmd_search(args: argparse.Namespace) -> None:
    """Search, write search.json and pareto.png, verify the winner, print the top."""
    from shardemu.predict.search import search
    from shardemu.report.rundir import default_run_dir, require_new
    from shardemu.report.tables import search_table
    from shardemu.report.views import plot_pareto
    from shardemu.run.verify import search_devices, verify

    hardware = get_hardware(args.hardware)
    model_cfg = model_config(args)
    space = search_space(args, hardware.precisions)
    out = Path(args.out or default_run_dir(f"search-{model_cfg.name}"))
    require_new(out)
    use_virtual_devices(search_devices(model_cfg, args.devices, args.batch, space))
    result = search(
        model_cfg, hardware, args.devices, args.batch, args.seq, space, args.top,
        log=lambda line: console.print(line, highlight=False, markup=False),
    )  # fmt: skip
    out.mkdir(parents=True)
    if not args.no_verify:
        console.print(f"verifying {result['best']['label']} scaled down against one device")
        result["verification"] = verify(model_cfg, result["best_candidate"], out / "verify")
    result["best_candidate"] = dataclasses.asdict(result["best_candidate"])
    (out / "search.json").write_text(json.dumps(result, indent=2))
    plot_pareto(result, out / "pareto.png")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    wide = Console()
    wide.width = max(wide.width, 140)  # a layout's label is one readable line
    wide.print(search_table(result))
    console.print(f"wrote {out}/search.json and {out}/pareto.png", highlight=False)


def parse(argv: list[str]) -> argparse.Namespace:
    """The parsed command line, with `given`: the options it writes out."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.given = given_options(parser, argv)
    if getattr(args, "config", None) is not None:
        command = parser.commands[args.command]
        apply_settings(command, args, read_settings(args.config), args.config)
    return args


COMMANDS = {
    "run": cmd_run, "demo": cmd_demo, "describe": cmd_describe, "plan": cmd_plan,
    "compare": cmd_compare, "sweep": cmd_sweep, "search": cmd_search,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
        if args.command == "run" and args.processes is not None and process_index() is None:
            return _launch(args, argv)
        COMMANDS[args.command](args)
    except SystemExit as done:  # --help, --version, or a usage error argparse has printed
        return int(done.code or 0)
    except ShardemuError as err:
        console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
