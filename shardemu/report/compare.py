"""Runs side by side, as W&B's run comparer shows them: the settings that differ, the
final metrics, and one figure (loss curves; bytes and predicted step time per run).

Runs and plans alike: both write config.json and metrics.jsonl (`rundir.py`,
`plandir.py`). A path may be a run directory, a glob, or a directory of run
directories (a sweep, or `runs/`).
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardemu.config.files import read_text
from shardemu.errors import RunDirError
from shardemu.report.rundir import read_metrics
from shardemu.report.scalars import scalars

# config.json fields that are not settings: when and how a run was started, which
# devices it got, files and results (a plan's config.json is its report)
_NOT_SETTINGS = (
    "created",
    "argv",
    "devices",
    "trace",
    "timeline",
    "elapsed_s",
    "plan",
    "phase_plan",
    "stage_plan",
    "stream_busy_s",
    "breakdown",
    "memory_per_device",
    "step_time_s",
    "utilisation",
    "tokens_per_s",
    "critical_stage",
    "model_flops_rel_err",
    "executed_flops",
    "tflops_per_device",
    "resumed_from",
)
# the final metrics shown first, in this order (others follow: bytes by axis)
FINAL = (
    "loss",
    "grad_norm",
    "learning_rate",
    "step_time_s",
    "tokens_per_s",
    "flops",
    "model_flops",
    "bytes_h2d",
    "bytes_d2h",
    "device_high_water_bytes",
    "predicted_step_s",
)


@dataclass
class RunView:
    """One run directory as compare reads it."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def final(self) -> dict[str, float]:
        return scalars(self.records[-1]) if self.records else {}


def find_runs(paths: list[str]) -> list[RunView]:
    """The run directories `paths` name: each a run directory, a glob, or a directory
    whose children are run directories."""
    found: list[Path] = []
    for text in paths:
        matches = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
        if not matches:
            raise RunDirError(f"{text} matches no run directory")
        for match in map(Path, matches):
            if (match / "config.json").is_file():
                found.append(match)
            elif match.is_dir() and (
                inner := sorted(p.parent for p in match.glob("*/config.json"))
            ):
                found.extend(inner)
            elif glob.has_magic(text):
                continue  # a glob may match other files too
            else:
                raise RunDirError(
                    f"{match} is not a run directory (no config.json in it or in its "
                    f"subdirectories); give directories that shardemu run or plan wrote"
                )
    if not found:
        raise RunDirError(f"no run directory among {' '.join(paths)}")
    return [_load(path) for path in dict.fromkeys(found)]


def _load(path: Path) -> RunView:
    text = read_text(path / "config.json", "compare", RunDirError)
    try:
        config = json.loads(text)
        records = read_metrics(path) if (path / "metrics.jsonl").exists() else []
    except (OSError, json.JSONDecodeError) as err:
        raise RunDirError(f"cannot read the run directory {path}: {err}") from None
    return RunView(path, config, records)


def settings(
    config: dict[str, Any], results: set[str] = frozenset(), prefix: str = ""
) -> dict[str, Any]:
    """config.json's settings as dotted keys (`train.learning_rate`), leaving out the
    top-level `results` (a plan's report holds its counts too)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if not prefix and (key in _NOT_SETTINGS or key in results):
            continue
        if isinstance(value, dict):
            flat.update(settings(value, prefix=f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return flat


def compare(runs: list[RunView]) -> dict[str, Any]:
    """The settings whose values are not all equal (a setting one run lacks differs),
    and the final metrics, each as one value per run (None where a run has none)."""
    flat = [settings(r.config, set(r.records[-1]) if r.records else set()) for r in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    differ = {
        k: [f.get(k) for f in flat] for k in keys if len({json.dumps(f.get(k)) for f in flat}) > 1
    }
    finals = [r.final for r in runs]
    names = [k for k in FINAL if any(k in f for f in finals)]
    names += sorted(k for k in set().union(*finals) if k.startswith("bytes_collective/"))
    return {
        "runs": [str(r.path) for r in runs],
        "settings_differ": differ,
        "final": {k: [f.get(k) for f in finals] for k in names},
    }


# the PNG text `Software` of a compare plot: the one kind of file a compare replaces
COMPARE_PLOT = "shardemu compare"


def plot_compare(runs: list[RunView], out: Path) -> Path:
    """`out` (a PNG): loss against step per run; bytes per step by tier and mesh axis;
    predicted step time per run. An existing `out` is replaced only if an earlier
    compare wrote it (re-running a comparison), never a plan's timeline or any other file."""
    _require_replaceable(out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, bytes_ax, time_ax) = plt.subplots(1, 3, figsize=(15, 4.5))
    for run in runs:
        steps = [r["step"] for r in run.records if r.get("loss") is not None]
        if steps:
            losses = [r["loss"] for r in run.records if r.get("loss") is not None]
            loss_ax.plot(steps, losses, marker="." if len(steps) < 30 else None, label=run.name)
    loss_ax.set(title="loss", xlabel="step")
    if loss_ax.lines:
        loss_ax.legend(fontsize="small")
    kinds = sorted(
        {
            k
            for r in runs
            for k in r.final
            if k in ("bytes_h2d", "bytes_d2h") or k.startswith("bytes_collective/")
        }
    )
    width = 0.8 / max(len(kinds), 1)
    for i, kind in enumerate(kinds):
        values = [r.final.get(kind, 0) for r in runs]
        bytes_ax.barh([j + i * width for j in range(len(runs))], values, height=width, label=kind)
    bytes_ax.set(
        title="bytes per step", yticks=range(len(runs)), yticklabels=[r.name for r in runs]
    )
    bytes_ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    if kinds:
        bytes_ax.legend(fontsize="small")
    predicted = [r.final.get("predicted_step_s") for r in runs]
    time_ax.barh(range(len(runs)), [p or 0 for p in predicted])
    time_ax.set(
        title="predicted step time (s)", yticks=range(len(runs)), yticklabels=[r.name for r in runs]
    )
    if all(p is None for p in predicted):
        time_ax.set_xticks([])
    for j, p in enumerate(predicted):
        time_ax.text(0, j, " no --hardware" if p is None else f" {p:.3g}", va="center")
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, format="png", metadata={"Software": COMPARE_PLOT})
    except OSError as err:
        raise RunDirError(f"`plot` {out}: cannot write it ({err.strerror})") from None
    finally:
        plt.close(fig)
    return out


def _require_replaceable(out: Path) -> None:
    """`out` is a .png path, new or a plot that `plot_compare` wrote (its PNG says so)."""
    if out.suffix.lower() != ".png":
        raise RunDirError(f"`plot` {out}: the plot is a PNG; give a path ending in .png")
    if not out.exists():
        return
    if out.is_file():
        from PIL import Image

        try:
            with Image.open(out) as image:
                if image.info.get("Software") == COMPARE_PLOT:
                    return
        except OSError:  # not an image at all (PIL's UnidentifiedImageError is one)
            pass
    raise RunDirError(
        f"`plot` {out} exists and is not a plot `shardemu compare` wrote; give another "
        f"`plot` path, or remove it"
    )
