"""Errors a user can fix. Every one derives from `ShardemuError`, which the CLI catches
and prints as one line with exit status `exit_code` (2 unless a subclass says otherwise);
anything else is a bug and keeps its traceback.

Each subclass also derives from the built-in exception it refines, so code that catches
`ValueError` or `RuntimeError` keeps working.
"""

from __future__ import annotations


class ShardemuError(Exception):
    """A request shardemu cannot serve; the message names the value and the fix."""

    exit_code = 2


class ConfigError(ShardemuError, ValueError):
    """A setting is invalid; the message names the setting and how to fix it."""


class ShardingError(ShardemuError, ValueError):
    """A rules table or a tensor's dimensions do not fit the mesh."""


class DeviceError(ShardemuError, RuntimeError):
    """The devices JAX has cannot serve the request; the message says what to change."""


class CapacityError(ShardemuError, RuntimeError):
    """A memory tier cannot hold what a phase needs; the message names both and the fix.
    `needed`: the bytes per device a layout needs on its device tier, where known;
    `at_least`: whether that is only a lower bound (found without compiling). Exit
    status 4: the settings are valid, the layout does not fit."""

    exit_code = 4

    def __init__(self, message: str, needed: int | None = None, at_least: bool = False) -> None:
        super().__init__(message)
        self.needed = needed
        self.at_least = at_least


class HardwareError(ShardemuError, ValueError):
    """An unknown profile name, or a profile file with a bad or missing value."""


class RunDirError(ShardemuError, FileExistsError):
    """A run directory cannot be created where asked (it exists and is not empty)."""


class CheckpointError(ShardemuError, RuntimeError):
    """A checkpoint is missing, or cannot be restored onto the requested run."""


class NonFiniteError(ShardemuError, FloatingPointError):
    """Training diverged: a step's loss or gradient norm is NaN or infinite."""

    exit_code = 3


class RunInterrupted(ShardemuError):
    """SIGINT or SIGTERM stopped a run between two steps; its exit status is 128 + the
    signal's number, as a shell reports a process killed by it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class TrialsFailed(ShardemuError):
    """Every trial a sweep ran failed: the sweep did not do its job, whatever it wrote."""

    exit_code = 1
