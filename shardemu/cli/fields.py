"""The command line's flags from the config fields that declare them (`config/flags.py`):
argparse flags, parsed flags -> a config, a config -> the flags that make it again, and
a library error's field names (`TrainConfig.seed`) -> the flags a user types (`--seed`).

A flag's destination is its field's name, so `args.learning_rate` is what `--lr` set.
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Iterable
from typing import Any

from shardemu.config import PhasedConfig, Setting, SparsityConfig, TrainConfig, settings_of
from shardemu.predict.layouts import Space
from shardemu.predict.overlap import Overlap
from shardemu.report.trackers import TrackingConfig

# every config class with flagged fields, for `flag_message`
FLAGGED = (TrainConfig, SparsityConfig, PhasedConfig, Overlap, Space, TrackingConfig)
# names of settings the command line sets with a flag of its own, not a field's
OTHER_FLAGS = {
    "SparsityConfig.sparsity": "--sparsity",
    "ModelConfig.pad_vocab": "--pad-vocab",
    "ModelConfig.max_predictions": "--max-predictions",
    "ModelConfig.vocab_size": "--vocab",
}


def int_list(text: str) -> tuple[int, ...]:
    """`3,7,7,7` -> (3, 7, 7, 7): a tuple field's flag."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"needs comma-separated whole numbers, e.g. 3,7,7,7; got {text!r}"
        ) from None


def add_flags(p: argparse.ArgumentParser, cls: type, only: Iterable[str] | None = None) -> None:
    """The flags of `cls`'s fields (those named in `only`, if given)."""
    wanted = None if only is None else set(only)
    taken = {action.dest for action in p._actions}
    for s in settings_of(cls):
        if wanted is None or s.field in wanted:
            if s.field in taken:  # two fields of one name would share one value
                raise TypeError(f"{s.ref}: `{p.prog}` already has a flag for {s.field!r}")
            p.add_argument(s.flag.name, dest=s.field, help=s.flag.help, **_kind(s))


def _kind(s: Setting) -> dict[str, Any]:
    if s.kind is bool:
        return {"action": "store_false" if s.flag.negated else "store_true"}
    metavar = s.flag.metavar or (None if s.choices else s.flag.name[2:].upper().replace("-", "_"))
    out: dict[str, Any] = {"default": s.default, "metavar": metavar}
    if s.flag.const is not None:
        return out | {"nargs": "?", "const": s.flag.const}
    parse = int_list if s.kind is tuple else s.kind
    return out | {"type": parse, "choices": s.choices}


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """A `cls` from the parsed flags of its fields, and `given` for the rest."""
    values = {s.field: getattr(args, s.field) for s in settings_of(cls) if hasattr(args, s.field)}
    return cls(**values | given)


def changed(cls: type, args: argparse.Namespace) -> list[str]:
    """The flags of `cls` the command line set to something other than the default."""
    return [
        s.flag.name
        for s in settings_of(cls)
        if hasattr(args, s.field) and getattr(args, s.field) != s.default
    ]


def to_flags(config: Any) -> dict[str, Any]:
    """The settings (keyed by field) of `config`'s flagged fields that are not None."""
    values = {s.field: getattr(config, s.field) for s in settings_of(type(config))}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None}


@functools.cache
def _flag_of() -> dict[str, str]:
    return {s.ref: s.flag.name for cls in FLAGGED for s in settings_of(cls)} | OTHER_FLAGS


# keyword arguments of the library's functions (`shardemu.train`, `plan`, `search`,
# `custom_model`, `compare`) that library errors name in backticks (`microbatch_size`),
# and the flag that sets each
KEYWORDS = {
    name: "--" + name.replace("_", "-")
    for name in (
        "devices", "top", "recompute", "microbatch_size", "checkpoint_every", "eval_every",
        "out", "plot", "resume", "hardware", "batch", "seq", "hidden", "heads", "kv_heads",
        "attention",
    )
} | {"family": "--model"}  # fmt: skip
_REF = re.compile(r"\b[A-Z][A-Za-z]+\.[a-z_]+\b|`[a-z_]+`")


def flag_message(text: str) -> str:
    """A library error as the command line says it: each field it names (`TrainConfig.
    seed`) or keyword (`` `devices` ``) written as its flag (`--seed`, `--devices`);
    other names stay as they are."""

    def flag(match: re.Match[str]) -> str:
        name = match.group(0)
        return KEYWORDS.get(name.strip("`")) or _flag_of().get(name, name)

    return _REF.sub(flag, text)
