"""Runs that stop early, and stop cleanly: a signal between two steps, a step that
diverged.

SIGINT (Ctrl-C) and SIGTERM (a scheduler's kill) are caught and remembered, from before
the step compiles to the last write; the loop finishes the step it is in (or the
compile) and stops before the next, so the run directory, the checkpoint and the
summary are written whole. A second signal of either kind gives up waiting: the run's
`on_abort` tidies what it can (the directory of a run that logged no step is removed,
its lock released), one line says so, and the process exits at once with 128 + the
signal's number (130, 143): no exception unwinds through a compile or a write half
done, which is where it used to crash. What was written before stays: a torn last
metrics line and a half-saved checkpoint are what resume already survives.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from shardemu.errors import NonFiniteError
from shardemu.report.rundir import RunDir

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """A context in which SIGINT and SIGTERM request a stop instead of killing.

    Outside the main thread Python cannot install handlers; there the context does
    nothing and `received` stays None."""

    def __init__(self, on_abort: Callable[[], str] | None = None) -> None:
        """`on_abort` tidies up after a second signal and says what was kept."""
        self.received: int | None = None
        self.on_abort = on_abort
        self._previous: dict[int, Any] = {}

    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            return
        kept = ""
        if self.on_abort is not None:
            try:
                kept = self.on_abort()
            except Exception as err:  # noqa: BLE001  (exiting anyway: say it, do not raise)
                kept = f"tidying up failed ({err})"
        name = signal.Signals(signum).name
        sys.stderr.write(f"error: second {name}: stopped at once{'; ' + kept if kept else ''}\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def check_finite(record: dict[str, Any], learning_rate: float) -> None:
    """Raise `NonFiniteError` when a step's loss or gradient norm is NaN or infinite;
    a loss-scaled step (`loss_scale` recorded) whose gradients overflowed was skipped
    and its scale halved (`numerics/precision.py`): only its loss must be finite."""
    checked = ("loss",) if "loss_scale" in record else ("loss", "grad_norm")
    bad = {k: record[k] for k in checked if not math.isfinite(record[k])}
    if bad:
        values = ", ".join(f"{k} = {v}" for k, v in bad.items())
        raise NonFiniteError(
            f"training diverged at step {record['step']}: {values}. The usual cause is a "
            f"learning rate too high for this model (TrainConfig.learning_rate "
            f"{learning_rate:g}): lower it or add TrainConfig.warmup_steps; the metrics and "
            f"checkpoints before step {record['step']} are kept"
        )


def resume_hint(signum: int, run_path: Path, done: int, checkpointed: bool) -> str:
    """The one line an interrupted run ends with: where it stopped, how to go on."""
    how = (
        f"resume with: shardemu run --resume {run_path}"
        if checkpointed
        else f"it had no --checkpoint-every, so shardemu run --resume {run_path} starts over"
    )
    return f"{signal.Signals(signum).name}: stopped after {done} steps; {how}"


def abort_run(run: RunDir) -> str:
    """After a second signal (`StopSignals`): the directory of a run that logged no step
    removed, the lock released; what is kept, in words."""
    run.discard_if_empty()
    if not run.path.exists():
        return f"{run.path} held no step and is removed"
    return f"{run.path} keeps what was written before it (shardemu run --resume {run.path})"
