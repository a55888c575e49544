"""Kernels as an accelerator fuses them: what the non-matmul work of a module moves.

XLA's CPU backend splits a layer's elementwise work (layer norm, softmax, activation,
residual adds, RoPE, the optimizer) into more kernels than a GPU or TPU stack runs, and
each kernel reads its operands from memory and writes its output back. An accelerator
stack fuses the elementwise and reduction work between two matmuls into one kernel
(XLA's GPU and TPU fusion; on GPUs, Transformer Engine's and Apex's fused LayerNorm,
bias + GELU, RoPE, SwiGLU and masked softmax kernels), so only the tensors that enter
from a matmul, a collective or the piece's inputs are read, and only those a matmul, a
collective or the piece's outputs use are written.

`fused_bytes` forms those kernels from the compiled module's own graph: two kernels
join when one consumes the other's output and no matmul or collective lies on a path
between them (XLA's fusion legality: a fusion must not make a cycle). Each instruction's
*level* is the number of matmuls and collectives on the longest path reaching it; a
producer and a consumer of equal level have none between them, so groups of one level
are legal fusions. This is the most a stack can fuse into kernels apart from its
matmuls: a floor for them, where the CPU's own kernels are a ceiling. (A GEMM that takes
a bias or an activation into its epilogue, as cuBLASLt's can, moves less still; that is
not modelled. A GPT layer's forward at d 1024, s 512 in FP32 moves 51 sbh bytes so
counted against the CPU kernels' 56, 35 against 40 with its attention core fused.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shardemu.accounting.hlo import Instr, operands

# ops that only name another instruction's value (a tuple's element, a reinterpretation)
_ALIASES = {"get-tuple-element", "bitcast"}
# values that are there before any work: no matmul or collective lies behind them
_SOURCES = {"parameter", "constant", "iota", "tuple"}


def fused_bytes(body: list[Instr], kinds: Mapping[str, str], size: Callable[[str], int]) -> int:
    """Bytes the kernels of one computation (`body`, in HLO order, which is
    topological) read and write when fused as the module docstring says. `kinds`:
    each instruction's, by name: "kernel" (elementwise or reduction work a fused
    kernel may hold), "free" (a member that moves nothing by itself: data movement an
    accelerator folds into its neighbours, a GEMM's epilogue; a group of only such
    members moves nothing) or "boundary" (matmuls, collectives, loops, parameters).
    `size(name)`: the bytes of the value `name`."""
    defs = {i[0]: i for i in body}

    def source(name: str) -> str:
        while name in defs and defs[name][2] in _ALIASES:
            args = operands(defs[name][3])
            if not args:
                break
            name = args[0]
        return name

    level: dict[str, int] = {}
    parent: dict[str, str] = {}  # union-find over the kernels

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for name, _, op, rest in body:
        sources = [source(a) for a in operands(rest) if a in defs]
        before = 0
        for s in sources:
            behind = 0 if s in parent or s not in defs or defs[s][2] in _SOURCES else 1
            before = max(before, level.get(s, 0) + behind)
        level[name] = before
        if op in _ALIASES or kinds[name] == "boundary":
            continue
        parent[name] = name
        for s in sources:
            if s in parent and level[s] == before:
                parent[find(s)] = find(name)
    group = {name: find(name) for name in parent}  # a kernel's group, named by its root

    reads: set[tuple[str, str]] = set()
    writes: set[str] = set()
    root = body[-1][0] if body else ""
    for name, _, op, rest in body:
        if op in _ALIASES:
            continue
        mine = group.get(name)
        for a in (a for a in operands(rest) if a in defs):
            s = source(a)
            if mine is not None and group.get(s) != mine and defs[s][2] != "constant":
                reads.add((mine, a))  # read once by its group (a constant is in its code)
            if s in group and group[s] != mine:
                writes.add(s)
    if source(root) in group:  # the computation's result leaves it
        writes.add(source(root))

    moving = {group[n] for n in group if kinds[n] != "free"}
    return sum(size(a) for g, a in reads if g in moving) + sum(
        size(n) for n in writes if group[n] in moving
    )
