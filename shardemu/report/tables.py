"""The tables a person reads in the terminal: a run's or a plan's summary, the
parameter table of `describe`, and the phase plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from shardemu.report.rundir import fmt_value

if TYPE_CHECKING:
    from shardemu.phased.planner import PhasePlan
    from shardemu.predict.rows import SearchResult

_PHASE_COLUMNS = (
    "phase",
    "stage",
    "layers",
    "weight_bytes_per_device",
    "gathered_bytes_per_device",
    "activation_bytes_per_device",
    "fetches",
    "writes",
)


def summary_table(title: str, fields: dict[str, Any]) -> Table:
    """One row per field, values formatted as in summary.md."""
    table = Table(title=title, show_header=False)
    for key, value in fields.items():
        table.add_row(key, fmt_value(value))
    return table


def param_table(report: dict[str, Any]) -> Table:
    """`describe`'s parameter rows: path, shape, logical axes, spec, bytes per device."""
    table = Table(title=f"{report['model']} on mesh {report['mesh']}  (- = replicated)")
    table.add_column("path", no_wrap=True)
    for col in ("shape", "logical axes", "spec"):
        table.add_column(col)
    table.add_column("bytes/device", justify="right")
    for row in report["params"]:
        spec = (
            "-" if a is None else "+".join(a) if isinstance(a, list) else a for a in row["spec"]
        )
        logical = ("-" if a is None else a for a in row["logical_axes"])  # an unnamed axis
        table.add_row(
            row["path"],
            "x".join(map(str, row["shape"])),
            " ".join(logical),
            " ".join(spec),
            f"{row['bytes_per_device']:,}",
        )
    return table


def _cell(column: str, value: Any) -> str:
    if column == "layers":
        return "-".join(map(str, value))
    if isinstance(value, list):
        return ", ".join(value)
    return f"{value:,}" if isinstance(value, int) else str(value)


def print_phase_plan(out: Console, plan: PhasePlan) -> None:
    """The phase plan's rows and the device tier's peak."""
    settings = ", ".join(
        f"{k}={getattr(plan, k)}" for k in ("rts", "rts_optimizer", "activations", "optimizer_on")
    )
    table = Table(title=f"phase plan: {plan.phases} phases ({settings})")
    for col in _PHASE_COLUMNS:
        table.add_column(col.replace("_per_device", "/device").replace("_", " "), justify="right")
    for row in plan.per_phase:
        cells = row.to_json()
        table.add_row(*(_cell(c, cells[c]) for c in _PHASE_COLUMNS))
    out.print(table)
    out.print(
        f"device tier peak: {plan.device_high_water:,} bytes/device"
        + (f" of {plan.device_memory:,}" if plan.device_memory else "")
    )


def compare_table(report: dict[str, Any], names: list[str]) -> Table:
    """`compare`'s table: a column per run; the settings that differ, then the final
    metrics."""
    table = Table(title=f"shardemu compare: {len(names)} runs")
    table.add_column("", no_wrap=True)
    for name in names:
        table.add_column(name, justify="right")
    for section, rows in (
        ("settings that differ", report["settings_differ"]),
        ("final metrics", report["final"]),
    ):
        table.add_row(f"[bold]{section}[/]", *[""] * len(names))
        if not rows:
            table.add_row("  (none)", *[""] * len(names))
        for key, values in rows.items():
            table.add_row(f"  {key}", *("-" if v is None else _short(fmt_value(v)) for v in values))
    return table


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def search_table(result: SearchResult, check: dict[str, Any] | None = None) -> Table:
    """`shardemu search`'s best layouts, fastest first, and the check of the winner
    (`run.verify.verify`'s report)."""
    counts = result.counts
    title = (
        f"shardemu search: {result.model} on {result.devices} x {result.hardware}, "
        f"batch {result.batch} x {result.seq}: {counts['candidates']} layouts, "
        f"{counts['fit']} fit, {result.elapsed_s:.0f} s"
    )
    table = Table(title=title)
    for col in (
        "#",
        "layout",
        "step s",
        "tokens/s",
        "MFU",
        "device GB",
        "bubble s",
        "exposed comm s",
    ):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for i, r in enumerate(result.top, 1):
        m = r.measures
        assert m is not None  # the top rows are planned whole
        table.add_row(
            str(i),
            r.label,
            f"{m.step_time_s:.4g}",
            f"{m.tokens_per_s:,.0f}",
            f"{m.utilisation:.1%}",
            f"{m.device_bytes / 1e9:.3g}",
            f"{m.breakdown['pipeline_bubble_s']:.3g}",
            f"{m.breakdown['exposed_communication_s']:.3g}",
        )
    if check is not None:
        verdict = "equal" if check["equal"] else "NOT EQUAL"
        table.caption = (
            f"winner scaled down on {check['mesh']} ({check['steps']} steps): {verdict} to one "
            f"device, max relative loss difference {check['max_rel_diff']:.1e} "
            f"(tolerance {check['tolerance']:.0e})"
        )
    return table
