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
transposes, slices and broadcasts (the CPU's 16-to-32-bit widening and layout changes; a
GPU's GEMM reads either layout, and a slice by its offset and strides: a packed Q/K/V
projection's three parts are views in Megatron-LM, `split_tensor_along_last_dim`, and in
PaddlePaddle's `fuse_qkv` encoder, never copied), and the matmuls, counted above.
Widened elements count at the compute dtype's width, and an FP8 array the backend
widened (`--precision fp8`) at 1 byte. Checked against XLA on an H100
(`benchmarks/roofline_check.py`, `docs/results.md`): GPT layers of width 768 to 4096 are
timed within 13% by the roofline with these bytes (median 7.0%).

`fused_attention=True` gives the kernels of the same piece with its attention core fused
into one kernel, as FlashAttention computes it (Dao et al. 2022, "FlashAttention",
Algorithms 1 and 4): the [.., s, s] scores, probabilities and mask never reach memory.
The attention core is what a transformer layer computes with batched matmuls (a `dot`
with batch dimensions: heads x batch); of each such dot's two operands and output, the
one whose two non-batch dimensions are equal is the [s, s] tensor (when the head width
equals s, all three are the same size, so which one is dropped does not change the
bytes); `attention_core.py` finds it, and the grouped, context-parallel and unbatched
variants. Those tensors' bytes are left out of the dots and of every other kernel that
reads or writes an array of their shape. FlashAttention reads K and V once per block of
queries, Theta(s^2 d^2 / M) bytes for on-chip memory M (Dao et al., Theorem 2); they
are counted once here, which is optimistic by a few percent of the core's time at
d = 128 and M ~ 200 KB.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from shardemu.accounting.attention_core import AttentionShape, score_layouts, scores_index
from shardemu.accounting.cached_casts import CachedWeights
from shardemu.accounting.fusion import fused_bytes
from shardemu.accounting.hlo import (
    ARRAY,
    CALLED,
    CONTRACTING,
    DTYPE_BYTES,
    Instr,
    dims,
    no_units,
    operands,
    parse,
)
from shardemu.accounting.ledger import Matmul

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
    "slice",
    "bitcast",
    "broadcast",
    "reshape",
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "iota",
}

# what an FP8 GEMM's epilogue does to its product: scale by scalars and cast
_EPILOGUE = _MOVES | {"multiply", "divide"}


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
    arrays whose dimensions (1s dropped) are in `skip`."""
    return sum(
        elements * min(width, itemsize)
        for width, elements, layout in _arrays(shape)
        if layout not in skip
    )


@functools.lru_cache(maxsize=1 << 16)
def _arrays(shape: str) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """(bytes per element, elements, dimensions without 1s) of each array in `shape`:
    parsed once per shape string, which a module repeats in every instruction that
    reads the value (a count reads each module four times)."""
    return tuple(
        (DTYPE_BYTES.get(dtype, 4), math.prod(dims(text)), no_units(dims(text)))
        for dtype, text in ARRAY.findall(shape)
    )


def squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` without its leading 1s (a stacked layer axis of one layer, say)."""
    start = next((i for i, d in enumerate(shape) if d != 1), len(shape))
    return tuple(shape[start:])


class Kernels:
    """One parse of a compiled module's HLO, read as XLA emitted it or with its
    attention core fused (a count wants both)."""

    def __init__(
        self,
        hlo_text: str,
        itemsize: int | None = None,
        attention: AttentionShape | None = None,
        cached: CachedWeights | None = None,
    ) -> None:
        """`itemsize`: bytes per element of the program's compute dtype; elements the
        backend widened beyond it count at it (None: as the HLO says). `attention`: the
        model's, to find its core's dots that keep no batch dimension
        (`attention_core.py`). `cached`: weights whose casts are made once a step
        (`cached_casts.py`), left out of `memory` and counted by `casts`."""
        self.cached = cached
        self.computations = parse(hlo_text)
        self.shapes = {n: shape for body in self.computations.values() for n, shape, _, _ in body}
        self.width = itemsize or max(DTYPE_BYTES.values())
        self.origins = _Origins(self.computations)
        self.dots = _dots(self.computations, self.shapes, self.origins, attention)

    def read(self, fused_attention: bool = False) -> tuple[tuple[Matmul, ...], int]:
        """The matmuls and the bytes the other kernels move as XLA emitted them; with
        `fused_attention`, without the attention core's [s, s] tensors (module
        docstring)."""

        def moved(d: _Dot) -> int:  # its arrays' bytes, less its scores' when fused
            dropped = d.scores if fused_attention else None
            width = lambda i: 1 if d.fp8 and i < 2 else self.width  # noqa: E731
            return sum(_bytes(x, width(i)) for i, x in enumerate(d.arrays) if i != dropped)

        return tuple(
            Matmul(
                d.flops,
                moved(d),
                d.fp8,
                d.scores is not None,
                fused=fused_attention and d.scores is not None,
            )  # fmt: skip
            for d in self.dots
        ), self.memory(fused_attention)

    def memory(self, fused_attention: bool = False, target: bool = False) -> int:
        """The bytes the kernels other than matmuls move (`read`'s second value); with
        `target`, fused as an accelerator fuses them (`fusion.py`)."""
        scores = frozenset(
            layout
            for d in self.dots
            if fused_attention and d.scores is not None
            for layout in score_layouts(dims(ARRAY.search(d.arrays[d.scores]).group(2)))  # type: ignore[union-attr]
        )
        return self._moved(scores, target)

    def casts(self, target: bool = False) -> int:
        """The bytes of the kernels on the cached weights alone (`cached_casts.py`),
        which `memory` leaves out: 0 without them."""
        return self._moved(frozenset(), target, casts=True) if self.cached else 0

    def _moved(self, skip: frozenset[tuple[int, ...]], target: bool, casts: bool = False) -> int:
        """Bytes the module's kernels other than matmuls read and write (see the module
        docstring), elements at most the compute width (1 byte for an FP8 array the
        backend widened: `_Origins.fp8`), arrays of the dims in `skip` left out. A
        kernel that only scales an FP8 matmul's product by scalars and casts it is the
        matmul's epilogue on an accelerator (cuBLASLt applies FP8 scale factors in the
        GEMM: `cublasLtMatmul`'s A, B and D scale pointers), so it moves nothing here.
        A kernel on the cached weights alone (`cached_casts.py`) is left out, or, with
        `casts`, is all that is counted. With `target`, the kernels as the accelerator
        fuses them (`fusion.py`); else as XLA's CPU backend emitted them."""
        computations, shapes, origins = self.computations, self.shapes, self.origins
        fp8_products = frozenset(d.kernel for d in self.dots if d.fp8)
        sizes: dict[str, int] = {}

        def size(name: str) -> int:
            if name not in sizes:
                width = 1 if origins.fp8(name) else self.width
                sizes[name] = _bytes(shapes[name], width, skip)
            return sizes[name]

        def kind(instr: Instr) -> str:
            """boundary (a matmul, a collective, a loop, or the part not counted: no
            kernel here), free (data movement or an FP8 epilogue: folded into a
            neighbour) or kernel."""
            name, shape, op, rest = instr
            if op in _FREE:
                return "boundary"
            if op == "fusion":
                callee = CALLED.search(rest)
                fused = {
                    o for _, _, o, _ in computations.get(callee.group(1) if callee else "", [])
                }
                if "dot" in fused:
                    return "boundary"
                arrays = [o for o in operands(rest) if o in shapes and "[]" not in shapes[o]]
                if fused <= _MOVES or (
                    fused <= _EPILOGUE and arrays and set(arrays) <= fp8_products
                ):
                    return "free"
            elif target and op in _MOVES:
                return "free"
            cast = self.cached is not None and self.cached.holds(
                [a[2] for x in (shape, *(shapes[o] for o in operands(rest) if o in shapes))
                 for a in _arrays(x)]
            )  # fmt: skip
            return "kernel" if cast == casts else "boundary"

        called = {c for body in computations.values() for i in body for c in CALLED.findall(i[3])}
        total = 0
        for comp, body in computations.items():
            if comp in called:  # fused computations and reducers: inside a kernel
                continue
            kinds = {instr[0]: kind(instr) for instr in body}
            if target:
                total += fused_bytes(body, kinds, size)
                continue
            for name, _, _, rest in body:
                if kinds[name] == "kernel":
                    total += size(name) + sum(size(o) for o in operands(rest) if o in shapes)
        return total


def kernels(
    hlo_text: str,
    itemsize: int | None = None,
    fused_attention: bool = False,
    attention: AttentionShape | None = None,
) -> tuple[tuple[Matmul, ...], int]:
    """The module's matmuls and the bytes its other kernels move (`Kernels.read`)."""
    return Kernels(hlo_text, itemsize, attention).read(fused_attention)


@dataclass(frozen=True)
class _Dot:
    flops: float
    arrays: tuple[str, str, str]  # the shapes of its operands and output
    scores: int | None  # an attention core's: which of `arrays` is [.., s, s]
    fp8: bool  # both operands FP8 (`_Origins.fp8`)
    kernel: str  # the top-level instruction that computes it (it, or its fusion)


class _Origins:
    """Where a dot's operands come from. XLA's CPU backend converts FP8 operands to
    FP32 before a dot (`models/fp8.py`), in the dot's computation or in a fusion before
    it; an accelerator multiplies them as FP8. An operand is FP8 when, through data
    movement (`_MOVES`) and fused computations' parameters, it comes from an FP8 array
    or from a fusion that makes one."""

    def __init__(self, computations: dict[str, list[Instr]]) -> None:
        self.defs = {i[0]: i for body in computations.values() for i in body}
        self.computations = computations
        self.caller: dict[str, Instr] = {}  # a fused computation's fusion instruction
        for body in computations.values():
            for instr in body:
                if instr[2] == "fusion" and (callee := CALLED.search(instr[3])):
                    self.caller[callee.group(1)] = instr
        self.owner = {i[0]: comp for comp, body in computations.items() for i in body}

    def fp8(self, name: str, depth: int = 0) -> bool:
        instr = self.defs.get(name)
        if instr is None or depth > 32:
            return False
        _, shape, op, rest = instr
        if "f8e" in shape:
            return True
        if op == "parameter":
            caller = self.caller.get(self.owner[name])
            index = int(rest.split(")")[0])
            args = operands(caller[3]) if caller else []
            return index < len(args) and self.fp8(args[index], depth + 1)
        if op == "fusion":
            callee = CALLED.search(rest)
            inside = self.computations.get(callee.group(1) if callee else "", [])
            return any("f8e" in s for _, s, _, _ in inside)
        args = operands(rest)
        return op in _MOVES and bool(args) and self.fp8(args[0], depth + 1)

    def kernel(self, name: str) -> str:
        """The top-level instruction that computes `name`: it, or the fusion it is in."""
        caller = self.caller.get(self.owner[name])
        return name if caller is None else self.kernel(caller[0])


def _dots(
    computations: dict[str, list[Instr]],
    shapes: dict[str, str],
    origins: _Origins,
    attention: AttentionShape | None,
) -> list[_Dot]:
    """Every dot in the module (loop bodies once, as cost analysis counts them)."""
    out = []
    for body in computations.values():
        for dot, shape, op, rest in body:
            if op != "dot":
                continue
            names = operands(rest)[:2]
            lhs, rhs = (shapes[o] for o in names)
            contracting = CONTRACTING.search(rest)
            lhs_dims = dims(ARRAY.search(lhs).group(2))  # type: ignore[union-attr]
            axes = dims(contracting.group(1)) if contracting else ()
            out_elements = math.prod(dims(ARRAY.search(shape).group(2)))  # type: ignore[union-attr]
            flops = 2.0 * out_elements * math.prod(lhs_dims[a] for a in axes)
            arrays = (lhs, rhs, shape)
            fp8 = all(origins.fp8(o) for o in names)
            scores = scores_index(rest, arrays, attention)
            out.append(_Dot(flops, arrays, scores, fp8, origins.kernel(dot)))
    return out
