"""TensorBoard as a tracker (tensorboardX event files in `RUN_DIR/tensorboard/`):
every numeric field of a step is a scalar (`bytes_collective/tensor`, ...), the config
and the summary are text. `tensorboard --logdir runs/` shows every run together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardemu.report.scalars import step_scalars

TENSORBOARD_DIR = "tensorboard"


class TensorboardTracker:
    name = "tensorboard"

    def __init__(self, run_path: Path) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(run_path / TENSORBOARD_DIR))

    def log_config(self, config: dict[str, Any]) -> None:
        self.writer.add_text("config", _code(json.dumps(config, indent=2, default=str)), 0)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tag, value in step_scalars(metrics).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        rows = "\n".join(f"| {key} | {value} |" for key, value in summary.items())
        self.writer.add_text("summary", f"| field | value |\n|---|---|\n{rows}", 0)

    def log_artifact(self, path: Path) -> None:
        """TensorBoard has no artifacts: the file stays in the run directory."""

    def finish(self) -> None:
        self.writer.close()


def _code(text: str) -> str:
    """Markdown that TensorBoard's text plugin shows as preformatted."""
    return "\n".join("    " + line for line in text.splitlines())
