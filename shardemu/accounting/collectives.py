"""The collectives XLA actually emitted, read from a compiled executable's HLO.

The SPMD partitioner turns shardings into all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute instructions. Reading them back from
`compiled.as_text()` (rather than predicting them) is what lets the ledger itemise
collective bytes by mesh axis for any rules table: each instruction's replica groups are
mapped to the mesh axes along which their device ids vary.

Bytes each device sends over links follow the ring algorithms (Thakur, Rabenseifner and
Gropp 2005, "Optimization of Collective Communication Operations in MPICH"; NCCL's
performance notes, "bus bandwidth"): for a group of n devices and a buffer of S bytes,
all-reduce sends 2 (n-1)/n S, all-gather and all-to-all (n-1)/n S (S the full, gathered
buffer), reduce-scatter (n-1)/n S (S the full input), and collective-permute S.

XLA's CPU backend has no bfloat16 arithmetic: its float-normalization pass rewrites a
bfloat16 all-reduce or reduce-scatter to run in f32 between converts, and renames the
reduction it applies `..._promoted`. A GPU or TPU reduces the bfloat16 buffer, so such
a collective is counted at 2 bytes per element, as the program wrote it (`_promoted`).
Likewise it moves a narrowing convert past an all-gather: a sequence-parallel layer
norm's output, computed in f32 and cast to bfloat16 by the program, is gathered in f32
and cast after (a BF16 GPT layer at tensor 2: `f32[2,128,256]` gathered, 262,144 bytes,
for the 131,072 the program's array holds), and so are a context-parallel layer's keys
and values, its projections' f32 output (gpt-tiny in BF16 over context 2: 262,144 bytes
a step for 131,072). An all-gather whose every user converts it to a narrower type
first (through data movement, and into fusions) is counted at that width (`_narrowed`),
as the program wrote the array a GPU gathers. So is each element of an all-reduce the
backend did not mark `_promoted`: one that the all-reduce combiner merged into a tuple
with others is reduced in f32 and each element cast back after (a BF16 sequence-parallel
step's layer norms' and position embedding's parameter gradients, partial sums over the
sequence's shards, all-reduced over `tensor` as one tuple: `f32[2048,256]` for the
BF16 gradient of gpt-tiny's 2048 x 256 position table).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from shardemu.accounting.hlo import ARRAY, CALLED, DTYPE_BYTES, Instr, operands, parse

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>" + "|".join(_OPS) + r")(?:-start)?\((?P<rest>.*)$"
)
_INDEX = re.compile(r"index=(\d+)")
_NAME = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_PROMOTED = re.compile(r"to_apply=%[\w.\-]*_promoted\b")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)
_LIST = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")


@dataclass(frozen=True)
class Collective:
    """One collective instruction: its op, the mesh axes it spans, its group size, the
    buffer it works on (bytes per device) and the bytes each device sends."""

    op: str
    axes: tuple[str, ...]
    group: int
    buffer_bytes: int
    sent_bytes: float


def _array_bytes(shape: str) -> list[int]:
    return [
        DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in ARRAY.findall(shape)
        if dtype in DTYPE_BYTES
    ]


def _iota(dims: str, perm: str | None, num_devices: int) -> np.ndarray:
    """XLA's iota device list `[dims]T(perm)`: 0..n-1 shaped as dims, transposed."""
    ids = np.arange(num_devices).reshape([int(x) for x in dims.split(",")])
    return (ids.transpose([int(x) for x in perm.split(",")]) if perm else ids).ravel()


def _groups(rest: str, num_devices: int) -> list[list[int]]:
    """Replica groups in any of XLA's syntaxes: explicit lists, iota `[G,S]<=[dims]T(p)`,
    or mesh axes `mesh['axis_0'=2,'axis_1'=4][, device_ids=(iota)] {'axis_1'}` (devices
    laid out row-major over those axes; a group varies along the named ones)."""
    if m := _IOTA.search(rest):
        out_shape = [int(x) for x in m.group(1).split(",")]
        return _iota(m.group(2), m.group(3), num_devices).reshape(out_shape).tolist()
    if m := _MESH.search(rest):
        axes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        names, sizes = list(axes), [int(v) for v in axes.values()]
        chosen = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        others = [i for i in range(len(names)) if i not in chosen]
        ids = _iota(m.group(2), m.group(3), num_devices) if m.group(2) else np.arange(num_devices)
        ids = ids.reshape(sizes).transpose(others + chosen)
        return ids.reshape(-1, math.prod(sizes[i] for i in chosen)).tolist()
    if m := _LIST.search(rest):
        return [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    if "replica_groups={}" in rest or "replica_groups=" not in rest:
        return [list(range(num_devices))]  # one group of every device
    raise ValueError(f"unrecognised replica groups in HLO: {rest[:200]}")


def _axes(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes along which device ids within a group differ (ids index mesh.devices)."""
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(group, mesh.devices.shape))
        varying |= {i for i in range(coords.shape[0]) if len(set(coords[i])) > 1}
    return tuple(mesh.axis_names[i] for i in sorted(varying))


def _sent(op: str, n: int, buffer: int) -> float:
    if op == "collective-permute":
        return float(buffer)
    factor = 2 if op == "all-reduce" else 1
    return factor * (n - 1) / n * buffer


def _scattered(
    computations: dict[str, list[Instr]], mesh_size: int
) -> dict[str, frozenset[frozenset[int]]]:
    """All-reduces (by name, groups of the indices of their tuple elements) that XLA's
    CPU pipeline emitted for reduce-scatters: a user takes a dynamic slice of 1/n of the
    reduced buffer (n the all-reduce's group; the SPMD partitioner's per-device slice,
    alone or in a fusion), directly, through its tuple element or through a convert
    back from the f32 the CPU reduces 16-bit buffers in, where a GPU or TPU pipeline
    emits the reduce-scatter itself (sequence parallelism's, Korthikanti et al. 2022;
    ZeRO-2's gradients, Rajbhandari et al. 2020), also through elementwise work on the
    reduced buffer before the slice. A group of several elements is summed before the
    slice (a layer's input gradient through Q, K and V, or through SwiGLU's
    two input projections, all-reduced as one tuple): one reduce-scatter of one
    element's buffer, as XLA's GPU pipeline emits it after reassociating the sum of
    all-reduces (`AllReduceReassociate`, then `ReduceScatterCreator`). Other users that
    read the whole reduced buffer (the layer norms' parameter gradients) are the CPU
    partitioner's choice."""
    out: dict[str, set[frozenset[int]]] = defaultdict(set)
    for body in computations.values():
        group: dict[str, int] = {}  # an all-reduce -> its group size
        reduced: dict[str, tuple[str, frozenset[int]]] = {}  # array -> (all-reduce, elements)
        shapes = {name: shape for name, shape, _, _ in body}
        for name, shape, op, rest in body:
            args = operands(rest)
            ins = [a for a in args if a in reduced]  # reduced buffers it reads
            if op == "all-reduce":
                group[name] = len(_groups(rest, mesh_size)[0])
                if not shape.startswith("("):
                    reduced[name] = (name, frozenset({0}))
            elif op == "get-tuple-element" and args and args[0] in group:
                reduced[name] = (args[0], frozenset({int(_INDEX.search(rest)[1])}))  # type: ignore[index]
            elif (
                ins
                and len({reduced[a][0] for a in ins}) == 1
                and all(_elements(shapes[a]) == _elements(shape) for a in ins)
                and _elementwise(op, rest, computations)
            ):  # slicing f(reduced, x) is f(the reduce-scatter, x's slice): the CPU's f32
                # reduction cast back, FP8's descaling, a sum of the elements of one tuple
                reduced[name] = (
                    reduced[ins[0]][0],
                    frozenset().union(*(reduced[a][1] for a in ins)),
                )
        for _, shape, op, rest in body:
            args = operands(rest)
            callee = computations.get(c[1], []) if (c := CALLED.search(rest)) else []
            for position, arg in enumerate(args):
                if arg not in reduced:
                    continue
                n = group[reduced[arg][0]]
                direct = op == "dynamic-slice" and position == 0
                if (direct and _elements(shape) * n == _elements(shapes[arg])) or (
                    op == "fusion" and _slices_param(callee, position, n)
                ):
                    out[reduced[arg][0]].add(reduced[arg][1])
    return {name: frozenset(groups) for name, groups in out.items()}


_MOVES = {"copy", "bitcast", "reshape", "transpose"}


def _narrowed(computations: dict[str, list[Instr]]) -> dict[str, dict[int, tuple[int, int]]]:
    """All-gathers and all-reduces not `_promoted` (by name) some of whose elements (by
    index in their tuple, 0 alone) all their users read narrowed: (the element width,
    in bytes, of the widest narrowing convert those users apply first, the element's
    own width) (module docstring)."""
    out = {}
    for body in computations.values():
        for name, shape, op, rest in body:
            if op not in ("all-gather", "all-reduce") or _PROMOTED.search(rest):
                continue
            if shape.startswith("("):  # its elements are read through get-tuple-element
                elements = {
                    int(_INDEX.search(r)[1]): n  # type: ignore[index]
                    for n, _, o, r in body
                    if o == "get-tuple-element" and operands(r)[:1] == [name]
                }
            else:
                elements = {0: name}
            wide = [DTYPE_BYTES[d] for d, _ in ARRAY.findall(shape) if d in DTYPE_BYTES]
            widths = {
                i: (width, wide[i])
                for i, value in elements.items()
                if (width := _read_width(value, body, computations)) is not None and width < wide[i]
            }
            if widths:
                out[name] = widths
    return out


def _read_width(value: str, body: list[Instr], computations: dict[str, list[Instr]]) -> int | None:
    """The width, in bytes, at which `value`'s users first convert it: the widest over
    them, following data movement (`_MOVES`) and fusions' parameters; None where a
    user computes on it unconverted (or nothing reads it)."""
    widths = []
    for name, shape, op, rest in body:
        args = operands(rest)
        if value not in args:
            continue
        if op in _MOVES:
            width = _read_width(name, body, computations)
        elif op == "convert":
            width = DTYPE_BYTES.get(ARRAY.search(shape)[1])  # type: ignore[index]
        elif op == "fusion" and (callee := CALLED.search(rest)):
            inner = computations.get(callee[1], [])
            params = [_param(inner, i) for i, a in enumerate(args) if a == value]
            reads = [_read_width(p, inner, computations) if p else None for p in params]
            width = None if None in reads else max(reads)  # type: ignore[type-var]
        else:
            return None
        if width is None:
            return None
        widths.append(width)
    return max(widths, default=None)


def _param(callee: list[Instr], index: int) -> str | None:
    """The name of a fused computation's parameter `index`."""
    return next(
        (x for x, _, op, r in callee if op == "parameter" and r.startswith(f"{index})")), None
    )


def _elementwise(op: str, rest: str, computations: dict) -> bool:
    """Whether an instruction (or every instruction of its fusion) is elementwise:
    converts, copies, reshapes, arithmetic, scalars broadcast."""
    allowed = {"convert", "bitcast", "copy", "reshape", "parameter", "add", "subtract",
               "multiply", "divide", "broadcast", "constant"}  # fmt: skip
    if op == "fusion" and (callee := CALLED.search(rest)):
        return {o for _, _, o, _ in computations.get(callee[1], [])} <= allowed
    return op in allowed


def _slices_param(callee: list, index: int, n: int) -> bool:
    """Whether a fused computation takes a dynamic slice of 1/n of its parameter `index`
    (of it, or of an elementwise result of its shape: a scale or a residual add fused
    before the slice)."""
    param = _param(callee, index)
    shapes = {name: shape for name, shape, _, _ in callee}
    if param is None:
        return False
    whole = _elements(shapes[param])
    return any(
        op == "dynamic-slice"
        and _elements(shapes.get(operands(rest)[0], "")) == whole
        and _elements(shape) * n == whole
        for _, shape, op, rest in callee
    )


def _elements(shape: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in ARRAY.findall(shape))


def collectives(
    hlo_text: str, mesh: Mesh, computations: dict[str, list[Instr]] | None = None
) -> list[Collective]:
    """Every collective in an optimized HLO module compiled over `mesh` (the CPU's
    all-reduce-then-slice counted as the reduce-scatter it stands for: `_scattered`);
    `computations`: the module already parsed (`hlo.parse`), when a caller has it."""
    found = []
    computations = computations or parse(hlo_text)
    scattered, narrowed = _scattered(computations, mesh.size), _narrowed(computations)
    for line in hlo_text.splitlines():
        m = _INSTR.search(line)
        if not m:
            continue
        op, rest = m.group("op"), m.group("rest")
        sizes, groups = _array_bytes(m.group("shape")), _groups(rest, mesh.size)
        if _PROMOTED.search(rest):  # bfloat16 in the program, f32 on the CPU backend
            sizes = [size // 2 for size in sizes]
        name = _NAME.match(line)
        if name and name[1] in narrowed:  # gathered or reduced wide, read narrow
            read = narrowed[name[1]]
            sizes = [s * read[i][0] // read[i][1] if i in read else s for i, s in enumerate(sizes)]
        parts = scattered.get(name[1], frozenset()) if name and "-start(" not in line else ()
        if op == "all-reduce" and parts:  # the sliced elements' whole buffers are its input
            n, sliced = len(groups[0]), frozenset().union(*parts)
            # a group summed before its slice is one buffer, its largest element's
            scatter = sum(max(sizes[i] for i in part) for part in parts)
            whole = sum(s for i, s in enumerate(sizes) if i not in sliced)
            for op_, buffer in (("reduce-scatter", scatter), ("all-reduce", whole)):
                if buffer:
                    found.append(
                        Collective(op_, _axes(groups, mesh), n, buffer, _sent(op_, n, buffer))
                    )
            continue
        if op == "reduce-scatter":  # the result is 1/n of the buffer it reduced
            buffer = sum(sizes) * len(groups[0])
        else:  # an async start's shape pairs operand and result: take the larger
            buffer = max(sizes) if "-start(" in line else sum(sizes)
        n = 2 if op == "collective-permute" else len(groups[0])
        found.append(Collective(op, _axes(groups, mesh), n, buffer, _sent(op, n, buffer)))
    return found
