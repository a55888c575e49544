"""Experiment tracking: the run directory always, Weights & Biases and TensorBoard
when asked (`--wandb [PROJECT]`, `--tensorboard`), all behind one `Tracker` interface.

wandb and tensorboardX are optional extras (`pip install shardemu[wandb]`,
`shardemu[tensorboard]`); asking for a tracker whose package is missing is refused
before anything runs, with the extra to install.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from shardemu.errors import ConfigError
from shardemu.report.rundir import RunDir
from shardemu.tracking.base import Tracker, Trackers, scalars

__all__ = ["Tracker", "Trackers", "TrackingConfig", "open_trackers", "scalars"]

DEFAULT_WANDB_PROJECT = "shardemu"


@dataclass(frozen=True)
class TrackingConfig:
    """Which trackers log beside the run directory: `wandb` is a W&B project name
    (None: off), `tensorboard` turns on TensorBoard event files."""

    wandb: str | None = None
    tensorboard: bool = False

    def check_installed(self) -> None:
        """Refuse a tracker whose package is not installed, naming the extra."""
        for wanted, module, extra, flag in (
            (self.wandb is not None, "wandb", "wandb", "--wandb"),
            (self.tensorboard, "tensorboardX", "tensorboard", "--tensorboard"),
        ):
            if wanted and importlib.util.find_spec(module) is None:
                raise ConfigError(
                    f"{flag} needs the {module} package, which is not installed; "
                    f"pip install 'shardemu[{extra}]' (or drop {flag})"
                )


def open_trackers(cfg: TrackingConfig | None, run_dir: RunDir) -> Trackers:
    """The run directory first, then the trackers `cfg` asks for, writing under the
    run directory's path."""
    trackers: list[Tracker] = [run_dir]
    path = run_dir.path
    if cfg is not None and cfg.wandb is not None:
        from shardemu.tracking.wandb_tracker import WandbTracker

        trackers.append(WandbTracker(path, cfg.wandb))
    if cfg is not None and cfg.tensorboard:
        from shardemu.tracking.tensorboard_tracker import TensorboardTracker

        trackers.append(TensorboardTracker(path))
    return Trackers(trackers)
