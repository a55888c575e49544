"""Run directories: every setting and every step's metrics, written as the run goes.

Layout (DESIGN.md, "A run directory"): `config.json` (written before the first step),
`metrics.jsonl` (one line per step, flushed each step, so a crashed run keeps what it
did), `summary.md` (written at the end). A plan writes the same layout, with one
record: the step it counted. `RunDir` is the tracker that is always on
(`shardemu.report.trackers`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from shardemu.errors import RunDirError

LOCK = ".lock"  # the run directory's writer (`RunDir._claim`)

_VERSIONED = ("shardemu", "jax", "jaxlib", "flax", "optax", "numpy", "chex")


def versions() -> dict[str, str]:
    """Versions of Python and of the packages a result depends on."""
    out = {"python": platform.python_version()}
    for pkg in _VERSIONED:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_measurement(path: str | Path, record: dict[str, Any]) -> Path:
    """A benchmark's JSON at `path`: `record` with the machine and the versions it was
    measured with, so that numbers from two machines are never compared unawares."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({**record, "machine": platform.node(), "versions": versions()}, indent=2)
    )
    return out


def config_record(settings: dict[str, Any]) -> dict[str, Any]:
    """What config.json and every tracker's config hold: the settings, with when, how
    (argv) and with which versions the run was made."""
    return {
        "created": dt.datetime.now(dt.UTC).isoformat(),
        "argv": sys.argv,
        "versions": versions(),
        **settings,
    }


def default_run_dir(name: str, root: str | Path = "runs") -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(root) / f"{name}-{stamp}"


def require_new(path: Path) -> None:
    """Refuse a run directory that would overwrite anything: a file, or a directory
    that is not empty."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"`out` {path} is a file, not a directory; choose another `out`")
    if path.exists() and any(path.iterdir()):
        raise RunDirError(
            f"run directory {path} already exists and is not empty; "
            f"choose another `out` or remove it"
        )


class RunDir:
    name = "run_dir"

    def __init__(self, path: str | Path, reopen: bool = False, command: str = "run") -> None:
        """A new run directory, which must not exist or be empty (created, and checked
        writable, now); or, with `reopen`, an existing one whose metrics.jsonl starts
        again empty at the first record logged (a resumed run writes the steps it keeps
        back first, once its state is restored), not before. `command` titles summary.md."""
        self.path, self.command = Path(path), command
        self.created = not self.path.exists()
        self._metrics: TextIO | None = None
        self._locked = False
        self.logged = 0
        if not reopen:
            require_new(self.path)
            self._open_metrics()
        self._claim()

    def _claim(self) -> None:
        """One writer per run directory: `.lock` holds the writer's process id until it
        finishes. A live holder is refused; a dead one's (a `kill -9`) is reported, for
        the user to remove once they know nothing else writes there."""
        lock = self.path / LOCK
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = lock.read_text().strip() if lock.is_file() else "?"
            if holder.isdigit() and _running(int(holder)):
                raise RunDirError(
                    f"{self.path} is being written by process {holder} (its {LOCK}); wait "
                    f"for it to finish, or stop it"
                ) from None
            raise RunDirError(
                f"{self.path} holds the {LOCK} of process {holder}, which is no longer "
                f"running (killed?); remove {lock} to go on"
            ) from None
        except OSError as err:
            raise RunDirError(
                f"cannot write the run directory {self.path}: {err.strerror}"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        self._locked = True

    def _release(self) -> None:
        if self._locked:
            (self.path / LOCK).unlink(missing_ok=True)
            self._locked = False

    def _open_metrics(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._metrics = (self.path / "metrics.jsonl").open("w", encoding="utf-8")
        except OSError as err:
            raise RunDirError(
                f"cannot write the run directory {self.path}: {err.strerror}"
            ) from None

    def log_config(self, config: dict[str, Any]) -> None:
        """config.json: the settings (`config_record`)."""
        (self.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """One step's line (the record carries its step); NaN and infinities become
        null (JSON has neither)."""
        if self._metrics is None:
            self._open_metrics()
        self._metrics.write(json.dumps(json_safe(metrics), allow_nan=False) + "\n")
        self._metrics.flush()
        self.logged += 1

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.write_summary(summary_markdown(self.command, summary))

    def write_summary(self, markdown: str) -> None:
        (self.path / "summary.md").write_text(markdown)

    def log_artifact(self, path: Path) -> None:
        """The run's files are written into the run directory already."""

    def finish(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        self._release()

    def discard_if_empty(self) -> None:
        """Remove the directory this run created when no step got into it, so a run
        that failed before its first step leaves nothing that blocks its --out."""
        self.finish()
        if self.created and self.logged == 0:
            shutil.rmtree(self.path, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    return True


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run directory. Every record ends with a newline, so a
    last line without one that is not JSON was cut short (the process died writing it):
    it is no record and is left out (a resumed run runs that step again). Any other line
    that is not a JSON record is an error naming the file and the line."""
    file = Path(path) / "metrics.jsonl"
    *lines, last = file.read_text().split("\n")  # `last` is "" after a whole last line
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise RunDirError(
                    f"{file} line {number} is not a JSON record ({err.msg}); the run's "
                    f"other files are intact, but its metrics cannot be read"
                ) from None
    if last.strip():  # a whole record whose newline was not written yet, or a torn one
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(last))
    return records


def summary_markdown(command: str, summary: dict[str, Any]) -> str:
    """The table a person reads first: one row per field."""
    rows = "\n".join(f"| {key} | {fmt_value(value)} |" for key, value in summary.items())
    return f"# shardemu {command}: {summary['model']}\n\n| field | value |\n|---|---|\n{rows}\n"


def fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return ", ".join(f"{v:.4g}" for v in value)  # a band's ends
    return str(value)
