"""The matrix products XLA actually emitted, read from a compiled executable's HLO.

The roofline (`predict/roofline.py`) times matmuls apart from the rest of a piece: their
efficiency depends on their shape, and the rest of a transformer layer (softmax, layer
norm, GELU, the optimizer) is bound by memory. Each `dot` instruction of the SPMD-
partitioned module (per device, fused or not) gives one `Matmul`: FLOPs = 2 x (output
elements) x (contracted elements), as XLA's own cost analysis counts a dot, and the bytes
its operands and output take.

XLA's CPU backend has no 16-bit arithmetic: it converts bfloat16 and float16 operands
to f32 before a dot. An accelerator multiplies them as the program wrote them, so a
piece that computes in 16 bits (`itemsize` 2) counts its matmuls' bytes at 2 per
element, as `collectives.py` does for promoted reductions.

`kernels` also gives what the piece's other kernels move: each top-level instruction
(a fusion is one kernel) reads its operands and writes its output once, as XLA's cost
analysis counts "bytes accessed", but without the data movement that XLA's CPU backend
adds and an accelerator's kernels fold in: fusions of only dtype converts, copies,
transposes and broadcasts (the CPU's 16-to-32-bit widening and layout changes; a GPU's
GEMM reads either layout), and the matmuls, counted above. Widened elements count at the
compute dtype's width. Checked against XLA on an H100 (`benchmarks/gpu_calibration.py`,
`docs/results.md`): GPT layers of width 768 to 8192 are timed within 19% by the roofline
with these bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from shardemu.accounting.collectives import _DTYPE_BYTES

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\w+\[[\d,]*\]\S*)\s+([\w\-]+)\((.*)$"
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
# instructions that move no bytes of their own (or whose bytes are counted elsewhere:
# loop and call bodies are walked as computations, collectives by collectives.py)
_FREE = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "dot", "all-reduce",
    "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "all-reduce-start",
    "all-reduce-done", "all-gather-start", "all-gather-done", "collective-permute-start",
    "collective-permute-done", "copy-start", "copy-done",
}  # fmt: skip
# a fusion of only these is data movement an accelerator folds into its kernels
_MOVES = {
    "convert", "copy", "transpose", "bitcast", "broadcast", "reshape", "parameter",
    "constant", "tuple", "get-tuple-element", "iota",
}  # fmt: skip

Instr = tuple[str, str, str, str]  # name, shape, opcode, the rest of the line


def _parse(hlo_text: str) -> dict[str, list[Instr]]:
    """The module's computations by name, each its instructions."""
    computations: dict[str, list[Instr]] = {}
    current: list[Instr] | None = None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if (m := _COMPUTATION.match(stripped)) and "=" not in stripped.split("(")[0]:
            current = computations.setdefault(m.group(1), [])
        elif stripped == "}":
            current = None
        elif current is not None and (m := _INSTR.match(line)):
            current.append(m.groups())  # type: ignore[arg-type]
    return computations


def _operands(rest: str) -> list[str]:
    return _OPERAND.findall(rest.split(")")[0])


@dataclass(frozen=True)
class Matmul:
    """One dot per device: its FLOPs and the bytes of its two operands and output."""

    flops: float
    bytes: int


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def compute_itemsize(args: Any) -> int:
    """Bytes per element of the narrowest floating-point array among a piece's
    arguments: the dtype it computes in (its weights' or activations')."""
    sizes = [
        jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(args)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return min(sizes, default=4)


def _bytes(shape: str, itemsize: int) -> int:
    return sum(
        math.prod(_dims(dims)) * min(_DTYPE_BYTES.get(dtype, 4), itemsize)
        for dtype, dims in _ARRAY.findall(shape)
    )


def kernels(hlo_text: str, itemsize: int | None = None) -> tuple[tuple[Matmul, ...], int]:
    """The module's matmuls and the bytes its other kernels move, from one parse of
    `hlo_text`. `itemsize`: bytes per element of the program's compute dtype; elements
    the backend widened beyond it count at it (None: as the HLO says)."""
    computations = _parse(hlo_text)
    shapes = {name: shape for body in computations.values() for name, shape, _, _ in body}
    width = itemsize or max(_DTYPE_BYTES.values())
    return _matmuls(computations, shapes, width), _memory_bytes(computations, shapes, width)


def _matmuls(
    computations: dict[str, list[Instr]], shapes: dict[str, str], itemsize: int
) -> tuple[Matmul, ...]:
    """Every dot in the module (loop bodies once, as cost analysis counts them)."""
    out = []
    for body in computations.values():
        for _, shape, op, rest in body:
            if op != "dot":
                continue
            lhs, rhs = (shapes[o] for o in _operands(rest)[:2])
            contracting = _CONTRACTING.search(rest)
            lhs_dims = _dims(_ARRAY.search(lhs).group(2))  # type: ignore[union-attr]
            axes = _dims(contracting.group(1)) if contracting else ()
            out_elements = math.prod(_dims(_ARRAY.search(shape).group(2)))  # type: ignore[union-attr]
            flops = 2.0 * out_elements * math.prod(lhs_dims[a] for a in axes)
            out.append(Matmul(flops, sum(_bytes(x, itemsize) for x in (lhs, rhs, shape))))
    return tuple(out)


def _memory_bytes(
    computations: dict[str, list[Instr]], shapes: dict[str, str], itemsize: int
) -> int:
    """Bytes the module's kernels other than matmuls read and write (see the module
    docstring), elements at most `itemsize` wide."""
    called = {c for body in computations.values() for i in body for c in _CALLED.findall(i[3])}
    total = 0
    for comp, body in computations.items():
        if comp in called:  # fused computations and reducers: inside a kernel
            continue
        for _, shape, op, rest in body:
            if op in _FREE:
                continue
            if op == "fusion":
                callee = _CALLED.search(rest)
                inside = computations.get(callee.group(1) if callee else "", [])
                fused = {o for _, _, o, _ in inside}
                if "dot" in fused or fused <= _MOVES:
                    continue
            total += _bytes(shape, itemsize) + sum(
                _bytes(shapes[o], itemsize) for o in _operands(rest) if o in shapes
            )
    return total
