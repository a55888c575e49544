"""A training run end to end: mesh, engine, the loop and its hooks (run directory,
progress), summary, and the prediction on named hardware."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh

from shardemu.accounting import flops
from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.data import make_corpus
from shardemu.errors import CheckpointError, NonFiniteError, RunInterrupted
from shardemu.models import Model, param_bytes, param_count
from shardemu.numerics.optim import learning_rate_at
from shardemu.numerics.precision import arithmetic
from shardemu.parallel.mesh import mesh_from, parallelism_of
from shardemu.parallel.rules import Rules, rules_or_default
from shardemu.parallel.schedules import make_schedule
from shardemu.phased.trainer import PhasedTrainer
from shardemu.pipelined.layout import pipeline_layout, stage_plan
from shardemu.pipelined.trainer import PipelinedTrainer
from shardemu.predict.costmodel import Timeline, predict
from shardemu.predict.hardware import Hardware
from shardemu.predict.sparse import sparse_compute, sparse_report
from shardemu.report.rundir import RunDir, config_record, default_run_dir, read_metrics
from shardemu.report.trackers import Trackers, TrackingConfig, open_trackers
from shardemu.report.views import write_views
from shardemu.resident.trainer import Trainer
from shardemu.run.checkpoint import Checkpoints
from shardemu.run.engine import Engine, PhasedEngine, PipelinedEngine, ResidentEngine
from shardemu.run.faults import StopSignals, check_finite
from shardemu.run.loop import StepInfo, TrainLoop

EVAL_BATCHES = 4  # held-out batches of the run's batch size, the same at every evaluation

# the files a run hands its trackers as artifacts, when it wrote them
RUN_FILES = ("config.json", "ledger.json", "summary.md", "trace.json", "timeline.png")


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
    checkpoint_every: int | None = None,
    resume: str | Path | None = None,
    tracking: TrackingConfig | None = None,
    eval_every: int | None = None,
) -> RunResult:
    """Train `model_cfg` on a `par` mesh for `train_cfg.steps` steps and record the run:
    resident (one compiled step), pipelined (pipe > 1 or microbatches > 1: the schedule
    executed stage by stage), or with `phased` weights in the host tier streamed in
    phase by phase. Every engine writes `ledger.json`; with `hardware`, every step is
    predicted on that hardware from its own ledger, and the last one drawn (trace.json,
    timeline.png).

    The run directory logs the config, every step and the summary; `tracking` adds
    W&B and TensorBoard beside it (`shardemu.report.trackers`). `checkpoint_every` K saves the
    state every K steps and at the end (`checkpoint.py`). `resume` continues the run
    directory `resume` from its last checkpoint (from step 0 when it has none), in place
    unless `out` names another directory; its settings must be the run's own
    (`resume_settings`), the mesh may differ. SIGINT or SIGTERM stop the run after the
    current step (`RunInterrupted`); a non-finite loss or gradient norm stops it with
    `NonFiniteError`."""
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ConfigError(
            f"--checkpoint-every must be a positive number of steps, got {checkpoint_every}"
        )
    if tracking is not None:
        tracking.check_installed()
    if eval_every is not None and eval_every < 1:
        raise ConfigError(f"--eval-every must be a positive number of steps, got {eval_every}")
    _check_host_memory(model_cfg, train_cfg)
    if hardware is not None:  # predicted at the run's precision's peak
        hardware = hardware.at_precision(arithmetic(model_cfg, train_cfg.precision))
    mesh = mesh_from(par, devices)
    model = Model(model_cfg)
    engine = _engine(model, mesh, train_cfg, phased, rules)
    phase_plan = engine.trainer.plan() if phased else None  # one abstract step
    sizes = {"param_count": param_count(model.abstract_params()[0]), **engine.sizes()}
    config = _config(model, engine, mesh, train_cfg, phased, phase_plan, sizes, rules)
    layout = {"engine": engine.name, "stage_plan": [s["layers"] for s in config["stage_plan"]]}
    if phased:
        layout["phases"] = [list(s) for s in engine.trainer.slices]
    start, previous, ledger_before, source = 0, [], [], None
    if resume is not None:
        source = Checkpoints(resume)
        start = source.latest() or 0
        if start >= train_cfg.steps:
            raise ConfigError(
                f"{resume} has a checkpoint after {start} steps; give --steps more than {start}"
            )
        if start > 0:
            source.check_layout(start, layout)
        previous = [r for r in read_metrics(resume) if r["step"] < start]
        ledger_before = [e for e in _read_ledger(resume) if e["step"] < start]
        out = out or resume
    out = Path(out or default_run_dir(model_cfg.name))
    run = RunDir(out, reopen=resume is not None and out.resolve() == Path(resume).resolve())
    trackers: Trackers | None = None
    saved: Checkpoints | None = None
    try:
        for record in previous:
            run.log(record)
        trackers = open_trackers(tracking, run)
        resumed = {"resumed_from": {"run_dir": str(resume), "steps_done": start}} if resume else {}
        trackers.log_config(
            config_record(
                {
                    **config,
                    "checkpoint_every": checkpoint_every,
                    "eval_every": eval_every,
                    "hardware": hardware.name if hardware is not None else None,
                    "tracking": dataclasses.asdict(tracking or TrackingConfig()),
                    **resumed,
                }
            )
        )
        with StopSignals() as signals:
            t0 = time.perf_counter()
            state = engine.init(train_cfg.seed)  # pipelined and phased pieces compile on first use
            compile_s = time.perf_counter() - t0
            if source is not None and start > 0:
                state = source.restore(start, state)
                engine.start_at(start)
            saved = Checkpoints(run.path) if checkpoint_every else None
            predictor = None
            if hardware is not None:
                predictor = functools.partial(
                    _predict, engine, phase_plan, hardware, par, tokens=train_cfg.tokens
                )
            loop = _loop(model, engine, par, train_cfg, predictor, eval_every)
            loop.add_hook(lambda info: trackers.log(info.record, info.step))
            loop.add_hook(lambda info: check_finite(info.record, train_cfg.learning_rate))
            if on_step is not None:
                loop.add_hook(lambda info: on_step(info.record))
            if saved is not None:
                loop.add_hook(
                    lambda info: saved.save(info.step + 1, info.result.state, layout),
                    every=checkpoint_every,
                )
            state, records = loop.run(state, train_cfg.steps, start, signals.requested)
        done = start + len(records)
        stopped = signals.received
        if stopped is not None and run.logged == 0:
            raise RunInterrupted(
                f"{signal.Signals(stopped).name} before the first step finished: nothing "
                f"was written", stopped
            )  # fmt: skip
        if stopped is not None and saved is not None and saved.latest() != done:
            saved.save(done, state, layout)
        summary = _summary(
            model_cfg, par, train_cfg, mesh.size, previous + records, compile_s, run.path, sizes
        )
        summary["status"] = "completed" if stopped is None else f"interrupted at step {done}"
        engine.ledger.write(run.path / "ledger.json", ledger_before)
        if predictor is not None and records:
            timeline, report = predictor(done - 1)
            summary.update(_prediction_files(timeline, report, run.path, model_cfg.name, par))
        trackers.log_summary(summary)
        trackers.log_artifacts([run.path / name for name in RUN_FILES])
        if stopped is not None:
            raise RunInterrupted(_resume_hint(stopped, run.path, done, saved is not None), stopped)
    except NonFiniteError as err:
        run.write_summary(f"# shardemu run: {model_cfg.name}\n\nstopped: {err}\n")
        raise
    except BaseException:
        run.discard_if_empty()
        raise
    finally:
        if trackers is not None:
            trackers.finish()
        run.finish()
        for checkpoints in (source, saved):
            if checkpoints is not None:
                checkpoints.close()
    return RunResult(run.path, [r["loss"] for r in previous + records], summary)


def _check_host_memory(model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
    """Refuse a run whose batch cannot fit this machine: one layer's input activations
    (batch x seq x width float32 values, all virtual devices together) is a floor on
    what a step holds."""
    floor = train_cfg.batch * train_cfg.seq * model_cfg.embed_dim * 4
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if floor > memory:
        raise ConfigError(
            f"--batch {train_cfg.batch} x --seq {train_cfg.seq} of {model_cfg.name} needs at "
            f"least {floor:,} bytes for one layer's activations, more than this machine's "
            f"{memory:,}; run a smaller batch, or count it with `shardemu plan`"
        )


def _read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """A run directory's ledger.json events (none if the run never finished one)."""
    path = Path(run_dir) / "ledger.json"
    return json.loads(path.read_text()) if path.exists() else []


def _loop(
    model: Model, engine: Engine, par: Parallelism, train_cfg: TrainConfig,
    predictor: Callable[[int], tuple[Timeline, dict[str, Any]]] | None,
    eval_every: int | None = None,
) -> TrainLoop:  # fmt: skip
    """The training loop over the run's corpus (`--data`; step k trains on batch k). A
    step's record carries, besides the engine's counts: the learning rate it applied,
    tokens and sequences per second, the device tier's high-water mark, with a
    `predictor` the step's predicted time on the hardware, and every `eval_every` steps
    and after the last, the loss of `EVAL_BATCHES` held-out batches (`val_loss`)."""
    corpus = make_corpus(train_cfg.data, model.cfg.vocab_size, train_cfg.seed)
    schedule = make_schedule(
        train_cfg.schedule, par.pipe, train_cfg.microbatches, train_cfg.virtual
    )
    static = {
        "tokens": train_cfg.tokens,
        "sequences": train_cfg.batch,
        "bubble_fraction": schedule.bubble_fraction if engine.name == "pipelined" else 0.0,
        "model_flops_analytic": flops.training_step(model.cfg, train_cfg.batch, train_cfg.seq),
    }

    def rates(info: StepInfo) -> dict[str, Any]:
        record = info.record
        seconds = record["step_time_s"]
        return {
            "learning_rate": learning_rate_at(train_cfg, record["step"]),
            "tokens_per_s": record["tokens"] / seconds,
            "sequences_per_s": record["sequences"] / seconds,
            "device_high_water_bytes": engine.device_bytes(),
        }

    def predicted(info: StepInfo) -> dict[str, Any]:
        return {"predicted_step_s": predictor(info.step)[1]["step_time_s"]}

    held_out: list[dict[str, Any]] = []

    def validation(info: StepInfo) -> dict[str, Any]:
        if (info.step + 1) % eval_every and info.step != train_cfg.steps - 1:
            return {}
        if not held_out:
            val = make_corpus(train_cfg.data, model.cfg.vocab_size, train_cfg.seed, "validation")
            held_out.extend(
                model.batch(val, i, train_cfg.batch, train_cfg.seq) for i in range(EVAL_BATCHES)
            )
        return engine.evaluate(info.result.state, held_out)

    derive = [rates]
    if predictor is not None:
        derive.append(predicted)
    if eval_every is not None:
        derive.append(validation)
    return TrainLoop(
        engine, lambda step: model.batch(corpus, step, train_cfg.batch, train_cfg.seq), static,
        derive,
    )  # fmt: skip


def _resume_hint(signum: int, run_path: Path, done: int, checkpointed: bool) -> str:
    """The one line an interrupted run ends with: where it stopped, how to go on."""
    how = (
        f"resume with: shardemu run --resume {run_path}"
        if checkpointed
        else f"it had no --checkpoint-every, so shardemu run --resume {run_path} starts over"
    )
    return f"{signal.Signals(signum).name}: stopped after {done} steps; {how}"


class RunSettings(NamedTuple):
    """Everything a run directory's config.json says the run was made with."""

    model: ModelConfig
    parallelism: Parallelism
    train: TrainConfig
    phased: PhasedConfig | None
    rules: Rules
    checkpoint_every: int | None
    tracking: TrackingConfig | None
    eval_every: int | None


def resume_settings(run_dir: str | Path) -> RunSettings:
    """The settings a run directory was made with (its config.json)."""
    path = Path(run_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"--resume {run_dir}: cannot read {path} ({err}); give a run directory that "
            f"shardemu run wrote"
        ) from None
    rules = tuple(
        (name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in cfg["rules"]
    )
    tracking = cfg.get("tracking")
    return RunSettings(
        ModelConfig(**cfg["model"]),
        Parallelism(**cfg["parallelism"]),
        TrainConfig(**cfg["train"]),
        PhasedConfig(**cfg["phased"]) if cfg["phased"] else None,
        rules,
        cfg.get("checkpoint_every"),
        TrackingConfig(**tracking) if tracking and any(tracking.values()) else None,
        cfg.get("eval_every"),
    )


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
    rules: Rules | None,
) -> dict[str, Any]:  # fmt: skip
    """config.json: every setting, the rules (over the mesh, as given: the engines
    derive their stage rules from them), sizes per device, devices, stage plan."""
    par = parallelism_of(mesh)
    shapes, _ = model.abstract_params()
    lay = pipeline_layout(model.cfg.num_layers, par.pipe, train_cfg.virtual, train_cfg.stage_layers)
    return {
        "model": dataclasses.asdict(model.cfg),
        "parallelism": dataclasses.asdict(par),
        "train": dataclasses.asdict(train_cfg),
        "engine": engine.name,
        "rules": [
            [name, axes] for name, axes in rules_or_default(rules, train_cfg.sequence_parallel)
        ],
        "param_count": sizes["param_count"],
        "param_bytes": param_bytes(shapes),
        "param_bytes_per_device": sizes["param_bytes_per_device"],
        "opt_state_bytes_per_device": sizes["opt_state_bytes_per_device"],
        "device_count": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "devices": [str(d) for d in mesh.devices.flat],
        "tokens_per_step": train_cfg.tokens,
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
    evaluated = [r["val_loss"] for r in records if "val_loss" in r]
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
        "precision": train_cfg.precision,
        "bubble_fraction": records[0]["bubble_fraction"],
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        **({"final_val_loss": evaluated[-1]} if evaluated else {}),
        "compile_s": compile_s,
        "median_step_s": median_s,
        "tokens_per_s": train_cfg.tokens / median_s,
        "run_dir": str(run_path),
    }


def _predict(
    engine: Engine, plan: dict[str, Any] | None, hw: Hardware, par: Parallelism,
    step: int, tokens: int,
) -> tuple[Timeline, dict[str, Any]]:  # fmt: skip
    """The run's own step `step` (its ledger) on `hw`. Memory per device: a phased run's
    from its phase plan; a pipelined run's from its fullest stage (weights, optimizer
    state, kept activations); a resident run's from XLA's memory analysis of its step."""
    events = engine.ledger.step(step)
    totals = engine.ledger.step_totals(step)
    if plan is not None:
        memory = {
            "device": plan["device_high_water"],
            "host": sum(plan["host_bytes_per_device"].values()),
        }
    else:
        memory = {"device": engine.device_bytes()}
    train = engine.trainer.train
    if train.sparsity is not None:
        events = sparse_compute(events, hw, engine.trainer.model.cfg, train.seq, train.sparsity)
    timeline, report = predict(events, hw, par, totals["model_flops"], tokens, memory)
    return timeline, report | sparse_report(hw, train.sparsity)


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
        **({"predicted_sparse_matmul_time": report["sparse_matmul_time"]}
           if "sparse_matmul_time" in report else {}),
    }  # fmt: skip
