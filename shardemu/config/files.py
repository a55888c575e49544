"""Reading a file a user named (settings, a sweep, a hardware profile, a run's
config.json): a regular file of UTF-8 text no larger than a settings file can be, or an
error of the caller's kind that names it, never a hang on a FIFO, a MemoryError on
`/dev/zero` or a UnicodeDecodeError traceback."""

from __future__ import annotations

import stat
from pathlib import Path

from shardemu.errors import ShardemuError

MAX_BYTES = 16 * 2**20  # far beyond any settings file, far below a device or a dump


def read_text(path: str | Path, what: str, error: type[ShardemuError]) -> str:
    """The text of `path`, `what` it is saying what it was given as (`--config FILE`)."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as err:
        raise error(f"{what}: cannot read {path} ({err.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what}: {path} is not a regular file; give a file of text")
    if info.st_size > MAX_BYTES:
        raise error(
            f"{what}: {path} is {info.st_size:,} bytes, more than a settings file can be "
            f"({MAX_BYTES:,}); give the right file"
        )
    try:
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{what}: cannot read {path} ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(
            f"{what}: {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
            f"{err.start}); give a text file"
        ) from None
