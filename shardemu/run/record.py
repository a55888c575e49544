"""What a run directory records of a run: config.json (`run_config`) and the settings
read back from it for a resume (`resume_settings`), the ledger a resumed run continues
(`read_ledger`), the summary table (`run_summary`), and a step predicted on hardware
from the run's own ledger with its views (`predict_step`, `prediction_files`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, NamedTuple

from jax.sharding import Mesh

from shardemu.accounting.ledger import Event
from shardemu.accounting.ledger_file import read_events
from shardemu.config import ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.config.files import read_text
from shardemu.errors import CheckpointError
from shardemu.models import Model, param_bytes
from shardemu.parallel.mesh import parallelism_of
from shardemu.parallel.rules import Rules, rules_or_default
from shardemu.phased.planner import PhasePlan
from shardemu.pipelined.layout import Split, pipeline_layout, stage_plan
from shardemu.predict.costmodel import Timeline
from shardemu.predict.hardware import Hardware
from shardemu.predict.prediction import predict
from shardemu.predict.sparse import sparse_compute, sparse_report
from shardemu.report.trackers import TrackingConfig
from shardemu.report.views import write_views
from shardemu.run.engine import Engine


def read_ledger(run_dir: str | Path) -> list[Event]:
    """A run directory's ledger.json events (none if the run never finished one)."""
    return read_events(Path(run_dir) / "ledger.json")


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
        cfg = json.loads(read_text(path, f"`resume` {run_dir}", CheckpointError))
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"`resume` {run_dir}: cannot read {path} ({err}); give a run directory that "
            f"shardemu run wrote"
        ) from None
    if not isinstance(cfg, dict) or not {"model", "train", "rules"} <= set(cfg):
        made_by = "a plan's" if isinstance(cfg, dict) and "mesh" in cfg else "not a run's"
        raise CheckpointError(
            f"`resume` {run_dir}: {path} is {made_by} config.json (no model, train and "
            f"rules settings); give a run directory that shardemu run wrote"
        )
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


def run_config(
    model: Model,
    engine: Engine,
    mesh: Mesh,
    train_cfg: TrainConfig,
    phased: PhasedConfig | None,
    phase_plan: PhasePlan | None,
    sizes: dict[str, int],
    rules: Rules | None,
) -> dict[str, Any]:
    """config.json: every setting, the rules (over the mesh, as given: the engines
    derive their stage rules from them), sizes per device, devices, stage plan."""
    par = parallelism_of(mesh)
    shapes, _ = model.abstract_params()
    lay = pipeline_layout(model.cfg.num_layers, par.pipe, train_cfg.virtual, Split.of(train_cfg))
    return {
        "model": dataclasses.asdict(model.cfg),
        "parallelism": dataclasses.asdict(par),
        "train": dataclasses.asdict(train_cfg),
        "engine": engine.name,
        "rules": [
            [name, axes]
            for name, axes in rules_or_default(
                rules,
                train_cfg.sequence_parallel,
                par.expert,
                par.context,
                tensor=par.tensor,
                kv_heads=model.cfg.kv_heads,
            )
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
        "phase_plan": phase_plan.to_json() if phase_plan else None,
    }


def run_summary(
    model_cfg: ModelConfig,
    par: Parallelism,
    train_cfg: TrainConfig,
    devices: int,
    records: list[dict[str, Any]],
    compile_s: float,
    run_path: Path,
    sizes: dict[str, int],
) -> dict[str, Any]:
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


def predict_step(
    engine: Engine,
    plan: PhasePlan | None,
    hw: Hardware,
    par: Parallelism,
    step: int,
    tokens: int,
) -> tuple[Timeline, dict[str, Any]]:
    """The run's own step `step` (its ledger) on `hw`. Memory per device: a phased run's
    from its phase plan; a pipelined run's from its fullest stage (weights, optimizer
    state, kept activations); a resident run's from XLA's memory analysis of its step."""
    events = engine.ledger.step(step)
    totals = engine.ledger.step_totals(step)
    if plan is not None:
        memory = {"device": plan.device_high_water, "host": plan.host_bytes}
    else:
        memory = {"device": engine.device_bytes()}
    train = engine.trainer.train
    if train.sparsity is not None:
        events = sparse_compute(events, hw, engine.trainer.model, train.seq, train.sparsity)
    timeline, prediction = predict(events, hw, par, totals["model_flops"], tokens, memory)
    return timeline, prediction.to_json() | sparse_report(hw, train.sparsity)


def prediction_files(
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
        **(
            {"predicted_sparse_matmul_time": report["sparse_matmul_time"]}
            if "sparse_matmul_time" in report
            else {}
        ),
    }
