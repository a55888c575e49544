"""Reading XLA's HLO text: its computations, instructions, operands and dtypes.

`matmuls.py` and `collectives.py` both walk a compiled module's instructions: this is
the one parse they share.
"""

from __future__ import annotations

import re

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\w+\[[\d,]*\]\S*)\s+([\w\-]+)\((.*)$"
)
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
OPERAND = re.compile(r"%([\w.\-]+)")
ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")

Instr = tuple[str, str, str, str]  # name, shape, opcode, the rest of the line


def parse(hlo_text: str) -> dict[str, list[Instr]]:
    """The module's computations by name, each its instructions."""
    computations: dict[str, list[Instr]] = {}
    current: list[Instr] | None = None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if (m := COMPUTATION.match(stripped)) and "=" not in stripped.split("(")[0]:
            current = computations.setdefault(m.group(1), [])
        elif stripped == "}":
            current = None
        elif current is not None and (m := INSTR.match(line)):
            current.append(m.groups())  # type: ignore[arg-type]
    return computations


def dims(text: str) -> tuple[int, ...]:
    """The dimensions in an array's or an attribute's comma-separated list."""
    return tuple(int(d) for d in text.split(",") if d)


def no_units(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` without its 1s: XLA leaves a unit dimension (one sequence, one key/value
    group a device) anywhere in a transposed copy of an array."""
    return tuple(d for d in shape if d != 1)


def operands(rest: str) -> list[str]:
    """The instruction names an instruction's operand list (`rest`) refers to."""
    return OPERAND.findall(rest.split(")")[0])
