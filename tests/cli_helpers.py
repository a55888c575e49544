"""Calling the `shardemu` command in this process, as tests do (`cli.main(argv)`)."""

import contextlib
import io
from dataclasses import dataclass

from shardemu.cli import main


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def shardemu(*args: str) -> Outcome:
    """`shardemu ARGS` in this process: its exit status and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return Outcome(code, out.getvalue(), err.getvalue())
