"""Each setting's command-line flag, written once beside its config field.

A field declared as `setting(3e-3, "--lr", "peak learning rate")` carries a `Flag` in its
metadata. The flag's type and choices come from the field's annotation (`int`, `float`,
`str`, `bool`, a `Literal` of choices, `tuple[int, ...]`, any of them `| None`) and its
default is the field's, so the command line cannot drift from the library. The CLI
builds its flags, turns parsed flags into configs and configs back into flags from
`settings_of` (`cli/fields.py`). Library errors name a field as `TrainConfig.seed`; the
CLI prints the flag in its place.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Flag:
    """A field's flag: its name (`--lr`), help, metavar, `negated` for a switch that
    turns a True default off (`--no-prefetch`), and `const`, the value of an optional
    argument given bare (`--wandb` alone: the default project)."""

    name: str
    help: str = ""
    metavar: str | None = None
    negated: bool = False
    const: Any = None


def setting(
    default: Any,
    flag: str,
    help: str = "",
    *,
    metavar: str | None = None,
    negated: bool = False,
    const: Any = None,
) -> Any:
    """A dataclass field with `default` that the command line sets with `flag`."""
    return dataclasses.field(
        default=default, metadata={"flag": Flag(flag, help, metavar, negated, const)}
    )


@dataclass(frozen=True)
class Setting:
    """One flagged field of a config class, with what its annotation says."""

    owner: type
    field: str
    flag: Flag
    default: Any
    kind: type  # int, float, str, bool or tuple (of ints)
    choices: tuple[Any, ...] | None

    @property
    def ref(self) -> str:
        """How library errors name it: `TrainConfig.seed`."""
        return f"{self.owner.__name__}.{self.field}"


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The fields of dataclass `cls` that have a flag, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        flag = f.metadata.get("flag")
        if flag is not None:
            kind, choices = _read_hint(hints[f.name], f"{cls.__name__}.{f.name}")
            out.append(Setting(cls, f.name, flag, f.default, kind, choices))
    return tuple(out)


def choices_of(hint: Any) -> tuple[Any, ...]:
    """The values of a `Literal` type: the one list a field's check and flag share."""
    return typing.get_args(hint)


def _read_hint(hint: Any, ref: str) -> tuple[type, tuple[Any, ...] | None]:
    """(kind, choices) of a field's annotation, `X | None` read as `X`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        return type(values[0]), values
    if typing.get_origin(hint) is tuple:
        return tuple, None
    if hint in (int, float, str, bool):
        return hint, None
    raise TypeError(f"{ref}: a flag cannot hold a {hint!r}")
