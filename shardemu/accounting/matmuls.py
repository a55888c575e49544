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

`fused_attention=True` gives the kernels of the same piece with its attention core fused
into one kernel, as FlashAttention computes it (Dao et al. 2022, "FlashAttention",
Algorithms 1 and 4): the [.., s, s] scores, probabilities and mask never reach memory.
The attention core is what a transformer layer computes with batched matmuls (a `dot`
with batch dimensions: heads x batch); of each such dot's two operands and output, the
one whose two non-batch dimensions are equal is the [s, s] tensor (when the head width
equals s, all three are the same size, so which one is dropped does not change the
bytes). Those tensors' bytes are left out of the dots and of every other kernel that
reads or writes an array of their shape. FlashAttention reads K and V once per block of
queries, Theta(s^2 d^2 / M) bytes for on-chip memory M (Dao et al., Theorem 2); they
are counted once here, which is optimistic by a few percent of the core's time at
d = 128 and M ~ 200 KB.
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
_BATCH = re.compile(r"lhs_batch_dims=\{([\d,]*)\}")
_RHS_BATCH = re.compile(r"rhs_batch_dims=\{([\d,]*)\}")
# instructions that move no bytes of their own (or whose bytes are counted elsewhere:
# loop and call bodies are walked as computations, collectives by collectives.py)
_FREE = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "dot",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "all-reduce-start",
    "all-reduce-done",
    "all-gather-start",
    "all-gather-done",
    "collective-permute-start",
    "collective-permute-done",
    "copy-start",
    "copy-done",
}
# a fusion of only these is data movement an accelerator folds into its kernels
_MOVES = {
    "convert",
    "copy",
    "transpose",
    "bitcast",
    "broadcast",
    "reshape",
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "iota",
}

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


def _bytes(shape: str, itemsize: int, skip: frozenset[tuple[int, ...]] = frozenset()) -> int:
    """Bytes of the arrays in `shape`, elements at most `itemsize` wide, leaving out
    arrays whose dimensions (leading 1s dropped) are in `skip`."""
    return sum(
        math.prod(_dims(dims)) * min(_DTYPE_BYTES.get(dtype, 4), itemsize)
        for dtype, dims in _ARRAY.findall(shape)
        if squeezed(_dims(dims)) not in skip
    )


def squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` without its leading 1s (a stacked layer axis of one layer, say)."""
    start = next((i for i, d in enumerate(shape) if d != 1), len(shape))
    return tuple(shape[start:])


class Kernels:
    """One parse of a compiled module's HLO, read as XLA emitted it or with its
    attention core fused (a count wants both)."""

    def __init__(self, hlo_text: str, itemsize: int | None = None) -> None:
        """`itemsize`: bytes per element of the program's compute dtype; elements the
        backend widened beyond it count at it (None: as the HLO says)."""
        self.computations = _parse(hlo_text)
        self.shapes = {n: shape for body in self.computations.values() for n, shape, _, _ in body}
        self.width = itemsize or max(_DTYPE_BYTES.values())
        self.dots = _dots(self.computations, self.shapes)

    def read(self, fused_attention: bool = False) -> tuple[tuple[Matmul, ...], int]:
        """The matmuls and the bytes the other kernels move; with `fused_attention`,
        without the attention core's [s, s] tensors (module docstring)."""

        def moved(d: _Dot) -> int:  # its arrays' bytes, less its scores' when fused
            dropped = d.scores if fused_attention else None
            return sum(_bytes(x, self.width) for i, x in enumerate(d.arrays) if i != dropped)

        scores = frozenset(
            squeezed(_dims(_ARRAY.search(d.arrays[d.scores]).group(2)))  # type: ignore[union-attr]
            for d in self.dots
            if fused_attention and d.scores is not None
        )
        memory = _memory_bytes(self.computations, self.shapes, self.width, scores)
        return tuple(Matmul(d.flops, moved(d)) for d in self.dots), memory


def kernels(
    hlo_text: str, itemsize: int | None = None, fused_attention: bool = False
) -> tuple[tuple[Matmul, ...], int]:
    """The module's matmuls and the bytes its other kernels move (`Kernels.read`)."""
    return Kernels(hlo_text, itemsize).read(fused_attention)


@dataclass(frozen=True)
class _Dot:
    flops: float
    arrays: tuple[str, str, str]  # the shapes of its operands and output
    scores: int | None  # an attention core's: which of `arrays` is [.., s, s]


def _dots(computations: dict[str, list[Instr]], shapes: dict[str, str]) -> list[_Dot]:
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
            out.append(_Dot(flops, (lhs, rhs, shape), _scores(rest, (lhs, rhs, shape))))
    return out


def _scores(rest: str, arrays: tuple[str, str, str]) -> int | None:
    """Which of a batched dot's arrays is [.., s, s] (its two non-batch dimensions
    equal); None for a dot without batch dimensions."""
    lhs_batch, rhs_batch = _BATCH.search(rest), _RHS_BATCH.search(rest)
    if not lhs_batch or not rhs_batch or not _dims(lhs_batch.group(1)):
        return None
    batches = (_dims(lhs_batch.group(1)), _dims(rhs_batch.group(1)), None)
    for index, (shape, batch) in enumerate(zip(arrays, batches, strict=True)):
        dims = _dims(_ARRAY.search(shape).group(2))  # type: ignore[union-attr]
        rank = len(dims)
        free = [dims[i] for i in range(rank) if i not in (batch or range(rank - 2))]
        if len(free) == 2 and free[0] == free[1]:
            return index
    return None


def _memory_bytes(
    computations: dict[str, list[Instr]],
    shapes: dict[str, str],
    itemsize: int,
    skip: frozenset[tuple[int, ...]],
) -> int:
    """Bytes the module's kernels other than matmuls read and write (see the module
    docstring), elements at most `itemsize` wide, arrays of the dims in `skip` left out."""
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
            total += _bytes(shape, itemsize, skip) + sum(
                _bytes(shapes[o], itemsize, skip) for o in _operands(rest) if o in shapes
            )
    return total
