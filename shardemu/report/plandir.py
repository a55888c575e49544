"""The run directory of a plan: the layout a run writes, so that `compare`, `sweep`
and the trackers read plans and runs alike.

`config.json` is the plan's report (its settings and counts), `metrics.jsonl` holds one
record (the step that was counted, in the fields a run's steps have), `summary.md` the
report's table, `ledger.json` the counted events and, with a prediction, `trace.json`
and `timeline.png`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger_file import write_ledger
from shardemu.predict.plan import Plan
from shardemu.report.rundir import RunDir
from shardemu.report.trackers import TrackingConfig, open_trackers
from shardemu.report.views import write_views

# a plan's counts under the names a run's step record gives them
_COUNTS = (
    "flops",
    "model_flops",
    "model_flops_analytic",
    "bytes_h2d",
    "bytes_d2h",
    "bytes_h2d_weights",
    "bytes_d2h_gradients",
    "bytes_collective",
    "bubble_fraction",
)
PLAN_FILES = ("config.json", "ledger.json", "summary.md", "trace.json", "timeline.png")


def plan_record(plan: Plan) -> dict[str, Any]:
    """The counted step as metrics.jsonl's record: counts, tokens, the device tier's
    peak and, with a prediction, the predicted step time and throughput."""
    report = plan.report
    record: dict[str, Any] = {"step": 0, **{k: report[k] for k in _COUNTS if k in report}}
    record["pipe_bytes"] = record.get("bytes_collective", {}).get("pipe", 0)
    record["tokens"], record["sequences"] = report["batch"] * report["seq"], report["batch"]
    device = report.get("memory_per_device", {}).get("device")
    if device is not None:  # bytes, or {bytes, capacity, fits} once predicted
        record["device_high_water_bytes"] = device["bytes"] if isinstance(device, dict) else device
    if plan.prediction is not None:
        record["predicted_step_s"] = plan.prediction.step_time_s
        record["predicted_tokens_per_s"] = plan.prediction.tokens_per_s
    return record


def write_plan_dir(out: Path, plan: Plan, tracking: TrackingConfig | None = None) -> None:
    """Write the plan's run directory and log it to the `tracking` trackers; the views'
    file names join the plan's report."""
    report, ledger, timeline = plan.report, plan.ledger, plan.timeline
    if tracking is not None:
        tracking.check_installed()
    run = RunDir(out, command="plan")
    trackers = open_trackers(tracking, run)
    try:
        # a plan's step, written from its slots without placing every event
        compact = ledger.compact() if isinstance(ledger, AssembledLedger) else None
        write_ledger(out / "ledger.json", ledger.events if compact is None else compact)
        if timeline is not None:
            title = f"{report['model']} on {report['mesh']}, {report['hardware']}"
            report.update(write_views(timeline, out, title))
        trackers.log_config(report)
        trackers.log(plan_record(plan), 0)
        trackers.log_summary(flatten(report))
        trackers.log_artifacts([out / name for name in PLAN_FILES])
    finally:
        trackers.finish()


def flatten(report: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The report as one level of dotted keys, without the per-phase plan."""
    flat: dict[str, Any] = {}
    for key, value in report.items():
        if key in ("plan", "stream_busy_s"):
            continue
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
