"""One interface for every experiment tracker, and a fan-out over several.

levanter's `Tracker` (`log_hyperparameters`, `log`, `log_summary`, `log_artifact`,
`finish`) is the model: the run directory, Weights & Biases and TensorBoard each
implement `Tracker`, and a run talks to all of them at once through `Trackers`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


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


def scalars(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a record, nested dicts flattened with `/`
    (`bytes_collective/tensor`): what a scalar chart can draw."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            out[name] = value
    return out


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
