"""Experiment trackers behind one interface, looked up by name.

levanter's `Tracker` (`log_hyperparameters`, `log`, `log_summary`, `log_artifact`,
`finish`) is the model. The run directory (`rundir.py`) is the tracker that is always on;
Weights & Biases (`--wandb [PROJECT]`, `wandb_tracker.py`) and TensorBoard
(`--tensorboard`, `tensorboard_tracker.py`) log beside it when asked, and a run talks
to all of them at once through `Trackers`.

wandb and tensorboardX are optional extras (`pip install shardemu[wandb]`,
`shardemu[tensorboard]`); asking for a tracker whose package is missing is refused
before anything runs, with the extra to install.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shardemu.config.flags import setting
from shardemu.errors import ConfigError
from shardemu.report.rundir import RunDir


class Tracker(Protocol):
    name: str

    def log_config(self, config: dict[str, Any]) -> None:
        """Every setting of the run (config.json's contents), once, before step 0."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One step's record (metrics.jsonl's line)."""

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The end-of-run table (summary.md's rows)."""

    def log_artifact(self, path: Path) -> None:
        """A file the run produced (ledger.json, trace.json, timeline.png)."""

    def finish(self) -> None:
        """Flush and close; the tracker is not used again."""


class Trackers:
    """Several trackers as one: each call goes to every tracker in order. `finish`
    reaches every tracker even when one of them fails, then raises the first error."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    def log_config(self, config: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_config(config)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_summary(summary)

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        """The files of `paths` that exist (a run without --hardware has no trace)."""
        for path in paths:
            if path.exists():
                for tracker in self.trackers:
                    tracker.log_artifact(path)

    def finish(self) -> None:
        first: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.finish()
            except Exception as err:  # finish the others; report the first failure
                first = first or err
        if first is not None:
            raise first


DEFAULT_WANDB_PROJECT = "shardemu"


@dataclass(frozen=True)
class TrackingConfig:
    """Which trackers log beside the run directory: `wandb` is a W&B project name
    (None: off), `tensorboard` turns on TensorBoard event files. Each field is named
    for its entry in `TRACKERS`."""

    wandb: str | None = setting(
        None,
        "--wandb",
        f"log to Weights & Biases, offline unless WANDB_MODE says otherwise (project "
        f"default {DEFAULT_WANDB_PROJECT!r}; needs shardemu[wandb])",
        metavar="PROJECT",
        const=DEFAULT_WANDB_PROJECT,
    )
    tensorboard: bool = setting(
        False,
        "--tensorboard",
        "write TensorBoard event files to RUN_DIR/tensorboard (needs shardemu[tensorboard])",
    )

    def wanted(self) -> list[str]:
        return [name for name in TRACKERS if getattr(self, name) not in (None, False)]

    def check_installed(self) -> None:
        """Refuse a tracker whose package is not installed, naming the extra."""
        for name in self.wanted():
            kind = TRACKERS[name]
            if importlib.util.find_spec(kind.package) is None:
                raise ConfigError(
                    f"TrackingConfig.{name} needs the {kind.package} package, which is not "
                    f"installed; pip install 'shardemu[{kind.extra}]' (or leave "
                    f"TrackingConfig.{name} off)"
                )


@dataclass(frozen=True)
class TrackerKind:
    """A tracker by name: the package it needs, the extra that installs it, and how to
    open one on a run directory with its `TrackingConfig` field's value."""

    package: str
    extra: str
    open: Callable[[Path, Any], Tracker]


def _open_wandb(path: Path, project: str) -> Tracker:
    from shardemu.report.wandb_tracker import WandbTracker

    return WandbTracker(path, project)


def _open_tensorboard(path: Path, _: bool) -> Tracker:
    from shardemu.report.tensorboard_tracker import TensorboardTracker

    return TensorboardTracker(path)


TRACKERS: dict[str, TrackerKind] = {
    "wandb": TrackerKind("wandb", "wandb", _open_wandb),
    "tensorboard": TrackerKind("tensorboardX", "tensorboard", _open_tensorboard),
}


def open_trackers(cfg: TrackingConfig | None, run_dir: RunDir) -> Trackers:
    """The run directory first, then the trackers `cfg` asks for, writing under the
    run directory's path. A tracker that fails to open closes those already open."""
    trackers = Trackers([run_dir])
    try:
        for name in cfg.wanted() if cfg is not None else []:
            trackers.trackers.append(TRACKERS[name].open(run_dir.path, getattr(cfg, name)))
    except BaseException:
        trackers.trackers.pop(0)  # the caller closes the run directory itself
        trackers.finish()
        raise
    return trackers
