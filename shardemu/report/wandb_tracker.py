"""Weights & Biases as a tracker: the run's config, every step's metrics, the summary
and the run's files as an artifact.

Offline unless `WANDB_MODE` says otherwise (`wandb.init(mode=...)`; W&B's own
variable, so `WANDB_MODE=online` after `wandb login` uploads as the run goes): a
laptop run must not need a network or an account. The W&B run lives in
`RUN_DIR/wandb/`; `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from shardemu.errors import ConfigError
from shardemu.report.scalars import scalars, step_scalars


class WandbTracker:
    name = "wandb"

    def __init__(self, run_path: Path, project: str) -> None:
        import wandb

        self._wandb = wandb
        mode = os.environ.get("WANDB_MODE", "offline")
        try:
            self.run = wandb.init(
                project=project,
                name=run_path.name,
                dir=run_path,
                mode=mode,
                settings=wandb.Settings(silent=True, console="off"),
            )
        except wandb.errors.Error as err:  # no login for online mode, a bad project name
            raise ConfigError(
                f"TrackingConfig.wandb could not start a W&B run (WANDB_MODE={mode}): {err} "
                f"(unset WANDB_MODE to log offline)"
            ) from None
        self._files: list[Path] = []

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(step_scalars(metrics), step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Numbers as numbers; every other field (names, paths) as text."""
        numbers = scalars(summary)
        self.run.summary.update(
            {k: numbers.get(k, str(v)) for k, v in summary.items() if v is not None}
        )

    def log_artifact(self, path: Path) -> None:
        self._files.append(path)

    def finish(self) -> None:
        """One artifact (type `run-files`) with every file logged, then the run ends."""
        if self._files:
            name = re.sub(r"[^\w.-]", "-", f"{self.run.name}-files")
            artifact = self._wandb.Artifact(name, type="run-files")
            for path in self._files:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        self.run.finish()
