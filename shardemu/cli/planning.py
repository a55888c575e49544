"""`shardemu plan` and `shardemu search`: every setting checked before anything is
counted or written; the plan's or the search's files written from what they return."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from shardemu.cli.fields import changed, from_args
from shardemu.cli.settings import (
    model_config,
    overlap_config,
    parallelism,
    phased_config,
    refuse_idle_settings,
    search_space,
    sparsity_config,
    tracking_config,
)
from shardemu.config import ConfigError, Parallelism, PhasedConfig, TrainConfig
from shardemu.devices import MAX_VIRTUAL_DEVICES, use_virtual_devices
from shardemu.errors import CapacityError
from shardemu.models import Model
from shardemu.numerics.precision import arithmetic
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import Overlap
from shardemu.predict.plan import Plan
from shardemu.predict.profiles import get_hardware
from shardemu.report.tables import print_phase_plan, summary_table
from shardemu.report.trackers import TrackingConfig

console = Console(stderr=True)


def cmd_plan(args: argparse.Namespace) -> None:
    """Every setting is checked before anything is counted or written."""
    from shardemu.pipelined.layout import EVEN, Split, pipeline_layout
    from shardemu.report.plandir import flatten
    from shardemu.report.rundir import default_run_dir, require_new

    par = parallelism(args)
    refuse_idle_settings(args, par)
    phased = phased_config(args)
    overlap = overlap_config(args)  # refused now, not after counting
    _refuse_resident_only(args, phased)
    hardware = get_hardware(args.hardware) if args.hardware else None
    tracking = _plan_tracking(args, hardware)
    if phased is None and hardware is None:
        raise ConfigError("a resident plan predicts a step: give --hardware NAME (or add --phased)")
    model_cfg = model_config(args)
    sparse = sparsity_config(args)
    # a plan counts one step; a dynamic pattern's update schedule is not timed
    steps = {"steps": sparse.updates} if sparse else {}
    train_cfg = from_args(TrainConfig, args, sparsity=sparse, **steps)
    Model(model_cfg).check_fits(train_cfg, par)
    split = Split.of(train_cfg)
    if split != EVEN:  # refused now, not after counting
        pipeline_layout(model_cfg.num_layers, par.pipe, train_cfg.virtual, split)
    if hardware is not None:
        hardware.at_precision(arithmetic(model_cfg, train_cfg.precision))  # refused now
    micro = args.microbatch_size
    if micro is not None and (micro < 1 or args.batch % (par.replica * micro)):
        raise ConfigError(
            f"--microbatch-size {micro} must be positive and divide the batch per replica "
            f"(--batch {args.batch} / replica={par.replica})"
        )
    from shardemu.predict.planning import plan, plan_devices_needed

    needed = plan_devices_needed(par, phased is not None)
    if needed > MAX_VIRTUAL_DEVICES:
        counted, fix = (
            ("tensor x replica", "replica, or plan without --phased (it counts less)")
            if phased is not None
            else ("context x tensor", "context or tensor size")
        )
        raise ConfigError(
            f"this plan counts one stage on {counted} = {needed} virtual devices, more "
            f"than the {MAX_VIRTUAL_DEVICES} XLA's CPU backend compiles for in one "
            f"process; plan a smaller {fix}"
        )
    out = args.out or (default_run_dir(f"plan-{model_cfg.name}") if hardware else None)
    if out is not None:
        require_new(Path(out))
    use_virtual_devices(needed)

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
    else:
        table = Console()
        title = f"shardemu plan: {report['model']} on {report['mesh']}"
        table.print(summary_table(title, flatten(report)))
        if planned.phase_plan is not None:
            print_phase_plan(table, planned.phase_plan)
    _say_if_it_does_not_fit(args, planned, phased)


def _say_if_it_does_not_fit(args: argparse.Namespace, planned: Plan, phased: Any) -> None:
    """A plan over a memory tier of its hardware: which tier, by how much, and what to
    change (never a setting already given); exit status 4 unless --allow-overflow."""
    prediction = planned.prediction
    memory = prediction.memory_per_device if prediction is not None else None
    over = {tier: use for tier, use in (memory or {}).items() if not use.fits}
    if prediction is None or not over:
        return
    told = "; ".join(
        f"its {tier} tier holds {use.bytes / 1e9:,.4g} GB per device, "
        f"{(use.bytes - use.capacity) / 1e9:,.4g} GB over the {use.capacity / 1e9:,.4g} GB it has"
        + (
            f" (less the {use.fragmentation:.0%} its allocator fragments)"
            if use.fragmentation
            else ""
        )
        for tier, use in over.items()
    )
    report = planned.report
    what = f"{report['model']} on {report['mesh']} does not fit {prediction.hardware}: {told}"
    if args.allow_overflow:
        console.print(
            f"[bold yellow]warning:[/] {what} (planned anyway: --allow-overflow)", highlight=False
        )
        return
    raise CapacityError(
        f"{what}; {_changes(args, phased, report)}, or give --allow-overflow to plan it anyway"
    )


def _changes(args: argparse.Namespace, phased: Any, report: dict[str, Any]) -> str:
    """The layout changes that shrink a plan's memory, less those already made."""
    replicas = Parallelism.parse(report["mesh"]).replica
    if phased is not None:
        plan = report["plan"]
        options = [
            _more_phases(args, plan["layers_per_phase"]),
            "--activations offload" if phased.activations != "offload" else None,
            "a larger --rts" if plan["rts"] < replicas else None,
            "more devices in --mesh (tensor, or replicas to share weights with --rts)",
        ]
    else:
        micro = report.get("microbatch_size", args.microbatch_size)  # given or chosen
        options = [
            "--recompute full" if args.recompute != "full" else None,
            "a smaller --microbatch-size" if micro is None or micro > 1 else None,
            f"--zero {' or '.join(map(str, range(args.zero + 1, 4)))} (ZeRO: the optimizer "
            f"state, then the gradients, then the weights split over the replicas)"
            if args.zero < 3 and replicas > 1
            else None,
            "more tensor or pipe devices in --mesh",
            "--phased (weights in the host tier)",
        ]
    return "try " + ", ".join(o for o in options if o)


def _more_phases(args: argparse.Namespace, layers_per_phase: int) -> str | None:
    """More, smaller phases, where a phase holds more than one layer."""
    if layers_per_phase == 1:
        return None
    return "more --phases" if args.phases else "--phases (more, smaller phases)"


def _refuse_resident_only(args: argparse.Namespace, phased: PhasedConfig | None) -> None:
    """The flags only a resident plan reads, refused with --phased."""
    if phased is None:
        return
    if args.attention != "materialized":
        raise ConfigError(
            f"--attention {args.attention} is for resident plans: the phased planner times "
            f"the attention XLA emits; leave out --attention or --phased"
        )
    if args.recompute != "full":
        raise ConfigError(
            f"--recompute {args.recompute} is for resident plans: a phased plan keeps, "
            f"offloads or recomputes activations as --activations says"
        )
    resident = ("--grad-reduce", "--bucket-mb", "--grad-reduce-in-fp32")
    reduce = [f for f in changed(Overlap, args) if f in resident]
    if reduce:
        raise ConfigError(
            f"{' and '.join(reduce)} {'is' if len(reduce) == 1 else 'are'} for resident plans: "
            f"a phased plan reduces each phase's gradients after that phase (the phases are "
            f"the buckets); leave {'it' if len(reduce) == 1 else 'them'} out or --phased"
        )
    if args.stage_layers is not None:
        raise ConfigError(
            f"--stage-layers {','.join(map(str, args.stage_layers))} is for resident plans: "
            f"phased stages run "
            f"equal phases of layers; leave out --stage-layers or --phased"
        )
    for part in ("embedding", "loss"):
        if getattr(args, f"account_for_{part}_in_pipeline_split"):
            raise ConfigError(
                f"--account-for-{part}-in-pipeline-split is for resident plans: phased stages "
                f"run equal phases of layers; leave it out or --phased"
            )


def _plan_tracking(args: argparse.Namespace, hardware: Hardware | None) -> TrackingConfig | None:
    """The trackers a plan logs its run directory to, which it must have."""
    tracking = tracking_config(args)
    if tracking is not None:
        tracking.check_installed()
        if args.out is None and hardware is None:
            raise ConfigError(
                "--wandb and --tensorboard log a plan's run directory: give --out DIR "
                "(or --hardware, which writes one)"
            )
    return tracking


def _say_microbatch(choice: dict[str, Any]) -> None:
    """On stderr: the microbatch size a pipelined plan chose, since none was given."""
    sizes = ", ".join(choice["device_bytes"])
    planned = len(choice["step_time_s"])
    console.print(
        f"--microbatch-size {choice['chosen']} (not given: of {sizes} sequences per "
        f"microbatch, {choice['rule']}, {planned} planned whole; pass --microbatch-size "
        f"to choose)",
        highlight=False, markup=False,
    )  # fmt: skip


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
    use_virtual_devices(search_devices(model_cfg, args.devices, args.batch, space, args.seq))
    result = search(
        model_cfg, hardware, args.devices, args.batch, args.seq, space, args.top,
        log=lambda line: console.print(line, highlight=False, markup=False),
    )  # fmt: skip
    out.mkdir(parents=True)
    check = None
    if not args.no_verify:
        console.print(f"verifying {result.best.label} scaled down against one device")
        check = verify(model_cfg, result.best_candidate, out / "verify", space.sequence_parallel)
    data = result.to_json() | ({"verification": check} if check is not None else {})
    (out / "search.json").write_text(json.dumps(data, indent=2))
    plot_pareto(result, out / "pareto.png")
    if args.json:
        print(json.dumps(data, indent=2))
        return
    wide = Console()
    wide.width = max(wide.width, 140)  # a layout's label is one readable line
    wide.print(search_table(result, check))
    console.print(f"wrote {out}/search.json and {out}/pareto.png", highlight=False)
