"""A training run end to end: mesh, engine, the loop and its hooks (run directory,
progress), summary, and the prediction on named hardware."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from shardemu.accounting import flops
from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.data import SyntheticCorpus
from shardemu.models import Model, param_bytes, param_count
from shardemu.parallel.mesh import mesh_from, parallelism_of
from shardemu.parallel.rules import Rules
from shardemu.parallel.schedules import make_schedule
from shardemu.phased.trainer import PhasedTrainer
from shardemu.pipelined.layout import pipeline_layout, stage_plan
from shardemu.pipelined.trainer import PipelinedTrainer
from shardemu.predict.costmodel import Timeline, predict
from shardemu.predict.hardware import Hardware
from shardemu.report.rundir import RunDir, default_run_dir, summary_markdown
from shardemu.report.views import write_views
from shardemu.training.engine import Engine, PhasedEngine, PipelinedEngine, ResidentEngine
from shardemu.training.loop import TrainLoop
from shardemu.training.resident import Trainer


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float]
    summary: dict[str, Any]


def train(
    model_cfg: ModelConfig,
    par: Parallelism,
    train_cfg: TrainConfig,
    out: str | Path | None = None,
    devices: Sequence[jax.Device] | None = None,
    rules: Rules | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    phased: PhasedConfig | None = None,
    hardware: Hardware | None = None,
) -> RunResult:
    """Train `model_cfg` on a `par` mesh for `train_cfg.steps` steps and record the run:
    resident (one compiled step), pipelined (pipe > 1 or microbatches > 1: the schedule
    executed stage by stage), or with `phased` weights in the host tier streamed in
    phase by phase. Every engine writes `ledger.json`; with `hardware`, the last step's
    ledger is predicted on that hardware, with trace.json and timeline.png."""
    mesh = mesh_from(par, devices)
    model = Model(model_cfg)
    engine = _engine(model, mesh, train_cfg, phased, rules)
    run = RunDir(out or default_run_dir(model_cfg.name))
    try:
        phase_plan = engine.trainer.plan() if phased else None  # one abstract step
        sizes = {"param_count": param_count(model.abstract_params()[0]), **engine.sizes()}
        run.write_config(_config(model, engine, mesh, train_cfg, phased, phase_plan, sizes))
        t0 = time.perf_counter()
        state = engine.init(train_cfg.seed)  # pipelined and phased pieces compile on first use
        compile_s = time.perf_counter() - t0
        corpus = SyntheticCorpus(model_cfg.vocab_size, seed=train_cfg.seed)
        schedule = make_schedule(
            train_cfg.schedule, par.pipe, train_cfg.microbatches, train_cfg.virtual
        )
        static = {
            "tokens": train_cfg.batch * train_cfg.seq,
            "bubble_fraction": schedule.bubble_fraction if engine.name == "pipelined" else 0.0,
            "model_flops_analytic": flops.training_step(model_cfg, train_cfg.batch, train_cfg.seq),
        }
        loop = TrainLoop(
            engine, lambda step: model.batch(corpus, step, train_cfg.batch, train_cfg.seq), static
        )
        loop.add_hook(lambda info: run.log_step(info.record))
        if on_step is not None:
            loop.add_hook(lambda info: on_step(info.record))
        _, records = loop.run(state, train_cfg.steps)
        summary = _summary(
            model_cfg, par, train_cfg, mesh.size, records, compile_s, run.path, sizes
        )
        engine.ledger.write(run.path / "ledger.json")
        if hardware is not None:
            timeline, report = _predict(engine, phase_plan, hardware, par, train_cfg)
            summary.update(_prediction_files(timeline, report, run.path, model_cfg.name, par))
        run.write_summary(summary_markdown("run", summary))
    finally:
        run.close()
    return RunResult(run.path, [r["loss"] for r in records], summary)


def _engine(
    model: Model, mesh: Mesh, train_cfg: TrainConfig, phased: PhasedConfig | None,
    rules: Rules | None,
) -> Engine:  # fmt: skip
    """The engine for these settings: phased when asked, pipelined when the mesh has
    stages or the step has microbatches, else resident."""
    if phased:
        if train_cfg.stage_layers is not None:
            raise ConfigError(
                "--stage-layers sets the layers of pipelined stages; a phased run spreads "
                "its phases evenly over the stages (drop --stage-layers or --phased)"
            )
        return PhasedEngine(PhasedTrainer(model, mesh, train_cfg, phased, rules))
    par = parallelism_of(mesh)
    if par.pipe > 1 or train_cfg.microbatches > 1:
        return PipelinedEngine(PipelinedTrainer(model, mesh, train_cfg, rules))
    return ResidentEngine(Trainer(model, mesh, train_cfg, rules))


def _config(
    model: Model, engine: Engine, mesh: Mesh, train_cfg: TrainConfig,
    phased: PhasedConfig | None, phase_plan: dict[str, Any] | None, sizes: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    """config.json: every setting, the rules, sizes per device, devices, stage plan."""
    par = parallelism_of(mesh)
    shapes, _ = model.abstract_params()
    lay = pipeline_layout(model.cfg.num_layers, par.pipe, train_cfg.virtual, train_cfg.stage_layers)
    return {
        "model": dataclasses.asdict(model.cfg),
        "parallelism": dataclasses.asdict(par),
        "train": dataclasses.asdict(train_cfg),
        "engine": engine.name,
        "rules": [[name, axes] for name, axes in engine.trainer.rules],
        "param_count": sizes["param_count"],
        "param_bytes": param_bytes(shapes),
        "param_bytes_per_device": sizes["param_bytes_per_device"],
        "opt_state_bytes_per_device": sizes["opt_state_bytes_per_device"],
        "device_count": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "devices": [str(d) for d in mesh.devices.flat],
        "tokens_per_step": train_cfg.batch * train_cfg.seq,
        "microbatch_size": train_cfg.microbatch_size(par),
        "schedule": train_cfg.schedule,
        "stage_plan": stage_plan(model, lay),
        "phased": dataclasses.asdict(phased) if phased else None,
        "phase_plan": phase_plan,
    }


def _summary(
    model_cfg: ModelConfig, par: Parallelism, train_cfg: TrainConfig, devices: int,
    records: list[dict[str, Any]], compile_s: float, run_path: Path, sizes: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    """The table printed at the end (and summary.md)."""
    median_s = statistics.median(r["step_time_s"] for r in records)
    return {
        "model": model_cfg.name,
        "mesh": str(par),
        "devices": devices,
        **sizes,
        "steps": train_cfg.steps,
        "global_batch": train_cfg.batch,
        "seq": train_cfg.seq,
        "microbatches": train_cfg.microbatches,
        "schedule": train_cfg.schedule if par.pipe > 1 else None,
        "grad_accum": train_cfg.grad_accum,
        "bubble_fraction": records[0]["bubble_fraction"],
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "compile_s": compile_s,
        "median_step_s": median_s,
        "tokens_per_s": train_cfg.batch * train_cfg.seq / median_s,
        "run_dir": str(run_path),
    }


def _predict(
    engine: Engine, plan: dict[str, Any] | None, hw: Hardware, par: Parallelism,
    train_cfg: TrainConfig,
) -> tuple[Timeline, dict[str, Any]]:  # fmt: skip
    """The run's own last step (its ledger) on `hw`. Memory per device: a phased run's
    from its phase plan; a pipelined run's from its fullest stage (weights, optimizer
    state, kept activations); a resident run's from XLA's memory analysis of its step."""
    last = train_cfg.steps - 1
    events = engine.ledger.step(last)
    totals = engine.ledger.step_totals(last)
    if plan is not None:
        memory = {
            "device": plan["device_high_water"],
            "host": sum(plan["host_bytes_per_device"].values()),
        }
    else:
        memory = {"device": engine.device_bytes()}
    tokens = train_cfg.batch * train_cfg.seq
    return predict(events, hw, par, totals["model_flops"], tokens, memory)


def _prediction_files(
    timeline: Timeline, report: dict[str, Any], out: Path, name: str, par: Parallelism
) -> dict[str, Any]:
    """trace.json and timeline.png in the run directory; the summary's prediction rows."""
    write_views(timeline, out, f"{name} on {par}, {report['hardware']}")
    return {
        "hardware": report["hardware"],
        "predicted_step_s": report["step_time_s"],
        "predicted_utilisation": report["utilisation"],
        "predicted_tokens_per_s": report["tokens_per_s"],
        **{f"predicted_{k}": v for k, v in report["breakdown"].items()},
        "predicted_device_memory_fits": report["memory_per_device"]["device"]["fits"],
    }
