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

from shardemu.accounting import flops
from shardemu.config import ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.data import SyntheticCorpus
from shardemu.models import Model, param_bytes, param_count
from shardemu.parallel.mesh import mesh_from
from shardemu.parallel.pipeline import stage_plan, transfer_bytes
from shardemu.parallel.rules import Rules
from shardemu.parallel.schedules import make_schedule
from shardemu.stages.tiers import bytes_per_device
from shardemu.phased.trainer import PhasedTrainer
from shardemu.predict.costmodel import Timeline, predict
from shardemu.predict.hardware import Hardware
from shardemu.report.rundir import RunDir, default_run_dir, summary_markdown
from shardemu.report.views import write_views
from shardemu.training.engine import Engine, PhasedEngine, ResidentEngine
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
    """Train `model_cfg` on a `par` mesh for `train_cfg.steps` steps and record the run;
    with `phased`, weights live in the host tier and stream in phase by phase; with
    `hardware`, add the predicted step on that hardware (phased: from the last step's
    ledger; resident: the resident plan of the same settings, GPipe, no recomputation),
    with trace.json and timeline.png."""
    mesh = mesh_from(par, devices)
    model = Model(model_cfg)
    trainer = Trainer(model, mesh, train_cfg, rules)
    engine: Engine = (
        PhasedEngine(PhasedTrainer(model, mesh, train_cfg, phased, rules), trainer.param_shardings)
        if phased
        else ResidentEngine(trainer)
    )
    run = RunDir(out or default_run_dir(model_cfg.name))
    try:
        phase_plan = engine.trainer.plan() if phased else None  # one abstract step
        sizes = _sizes(trainer)
        run.write_config(_config(model, trainer, train_cfg, phased, phase_plan, sizes))
        t0 = time.perf_counter()
        state = engine.init(train_cfg.seed)  # phased pieces compile on first use
        compile_s = time.perf_counter() - t0
        corpus = SyntheticCorpus(model_cfg.vocab_size, seed=train_cfg.seed)
        static = {
            "tokens": train_cfg.batch * train_cfg.seq,
            "bubble_fraction": make_schedule(
                "gpipe", par.pipe, train_cfg.microbatches
            ).bubble_fraction,
            "pipe_bytes": transfer_bytes(model, train_cfg, par),
            "model_flops": flops.training_step(model_cfg, train_cfg.batch, train_cfg.seq),
        }
        loop = TrainLoop(
            engine, lambda step: model.batch(corpus, step, train_cfg.batch, train_cfg.seq), static
        )
        loop.add_hook(lambda info: run.log_step(info.record))
        if on_step is not None:
            loop.add_hook(lambda info: on_step(info.record))
        _, records = loop.run(state, train_cfg.steps)
        summary = _summary(model_cfg, par, train_cfg, trainer, records, compile_s, run.path, sizes)
        if phased:
            engine.trainer.ledger.write(run.path / "ledger.json")
        if hardware is not None:
            timeline, report = (
                _predict_phased(engine.trainer, phase_plan, hardware, par, train_cfg)
                if phased
                else _predict_resident(model_cfg, hardware, par, train_cfg)
            )
            summary.update(_prediction_files(timeline, report, run.path, model_cfg.name, par))
        run.write_summary(summary_markdown("run", summary))
    finally:
        run.close()
    return RunResult(run.path, [r["loss"] for r in records], summary)


def _sizes(trainer: Trainer) -> dict[str, int]:
    """Parameters, and bytes per device of the parameters and the optimizer state:
    what both config.json and the summary report."""
    params_abs, opt_abs, _ = trainer.abstract_inputs()
    return {
        "param_count": param_count(trainer.param_shapes),
        "param_bytes_per_device": bytes_per_device(params_abs),
        "opt_state_bytes_per_device": bytes_per_device(opt_abs),
    }


def _config(
    model: Model, trainer: Trainer, train_cfg: TrainConfig, phased: PhasedConfig | None,
    phase_plan: dict[str, Any] | None, sizes: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    """config.json: every setting, the rules, sizes per device, devices, stage plan."""
    par, mesh = trainer.par, trainer.mesh
    return {
        "model": dataclasses.asdict(model.cfg),
        "parallelism": dataclasses.asdict(par),
        "train": dataclasses.asdict(train_cfg),
        "rules": [[name, axes] for name, axes in trainer.rules],
        "param_count": sizes["param_count"],
        "param_bytes": param_bytes(trainer.param_shapes),
        "param_bytes_per_device": sizes["param_bytes_per_device"],
        "opt_state_bytes_per_device": sizes["opt_state_bytes_per_device"],
        "device_count": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "devices": [str(d) for d in mesh.devices.flat],
        "tokens_per_step": train_cfg.batch * train_cfg.seq,
        "microbatch_size": train_cfg.microbatch_size(par),
        "schedule": train_cfg.schedule,
        "stage_plan": stage_plan(model, trainer.param_shapes, par.pipe),
        "phased": dataclasses.asdict(phased) if phased else None,
        "phase_plan": phase_plan,
    }


def _summary(
    model_cfg: ModelConfig, par: Parallelism, train_cfg: TrainConfig, trainer: Trainer,
    records: list[dict[str, Any]], compile_s: float, run_path: Path, sizes: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    """The table printed at the end (and summary.md)."""
    median_s = statistics.median(r["step_time_s"] for r in records)
    return {
        "model": model_cfg.name,
        "mesh": str(par),
        "devices": trainer.mesh.size,
        **sizes,
        "steps": train_cfg.steps,
        "global_batch": train_cfg.batch,
        "seq": train_cfg.seq,
        "microbatches": train_cfg.microbatches,
        "grad_accum": train_cfg.grad_accum,
        "bubble_fraction": records[0]["bubble_fraction"],
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "compile_s": compile_s,
        "median_step_s": median_s,
        "tokens_per_s": train_cfg.batch * train_cfg.seq / median_s,
        "run_dir": str(run_path),
    }


def _predict_phased(
    trainer: PhasedTrainer,
    plan: dict[str, Any],
    hw: Hardware,
    par: Parallelism,
    train_cfg: TrainConfig,
) -> tuple[Timeline, dict[str, Any]]:
    """The last step's ledger on `hw`; memory from the run's phase plan."""
    last = train_cfg.steps - 1
    events = [e for e in trainer.ledger.events if e.step == last]
    totals = trainer.ledger.step_totals(last)
    memory = {
        "device": plan["device_high_water"],
        "host": sum(plan["host_bytes_per_device"].values()),
    }
    tokens = train_cfg.batch * train_cfg.seq
    return predict(events, hw, par, totals["model_flops"], tokens, memory)


def _predict_resident(
    model_cfg: ModelConfig, hw: Hardware, par: Parallelism, train_cfg: TrainConfig
) -> tuple[Timeline, dict[str, Any]]:
    """The resident plan of this run's settings: the engine runs GPipe over its
    microbatches (gradient-accumulation chunks count as more microbatches) and keeps
    every activation for the backward pass."""
    from shardemu.predict.plan_resident import plan_resident

    micro = train_cfg.microbatch_size(par)
    report, _, timeline = plan_resident(
        model_cfg, par, train_cfg.batch, train_cfg.seq, micro, hw, "gpipe", 1, "none"
    )
    return timeline, report


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
