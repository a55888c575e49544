"""Counting one compiled piece: XLA's cost analysis and the collectives in its HLO.

A piece (a phase's layers, the embedding, the head, an optimizer update) is compiled
once per abstract signature: shapes, dtypes, partition specs, memory kinds and the mesh's
axis sizes, but not its devices, so identical pipeline stages share one count. Its FLOPs
per device come from `compiled.cost_analysis()`, its collectives from
`compiled.as_text()` (`collectives.py`). `piece_events` turns a count into ledger events.
XLA counts a loop body once whatever its trip count, so a phase of k identical layers is
counted as one layer and recorded `repeat`ed k times.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding

from shardemu.accounting.attention_core import AttentionShape
from shardemu.accounting.cached_casts import CachedWeights
from shardemu.accounting.collectives import Collective, collectives
from shardemu.accounting.ledger import Carries, Event, Matmul, Phase, Where
from shardemu.accounting.matmuls import Kernels, compute_itemsize
from shardemu.accounting.optimized import optimized


@functools.lru_cache(maxsize=65536)
def shaped(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """An abstract array, made once per (shape, dtype, sharding): JAX checks a sharding
    against the shape each time it makes one, and a phased search's dry runs made 1.3
    million (15 of its 83 s under a profiler), a few hundred of them distinct."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def abstract(tree: Any) -> Any:
    """Shapes, dtypes and shardings (where they have one: a NumPy array has none) of a
    tree of arrays or abstract values."""
    return jax.tree.map(lambda x: shaped(x.shape, x.dtype, getattr(x, "sharding", None)), tree)


def with_shardings(shapes: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s of the shapes in `shapes`, each with its sharding from the
    matching tree `shardings`: arrays to compile over, none allocated."""
    return jax.tree.map(lambda s, sh: shaped(s.shape, s.dtype, sh), shapes, shardings)


def signature(tree: Any) -> tuple:
    """What a compilation depends on: structure, shapes, dtypes, specs, memory kinds, of
    a tree of arrays or abstract values. Read off the leaves as they are (no
    `ShapeDtypeStruct` built, no dtype turned into a string): a search's dry runs ask
    for a million of them."""

    def leaf(x: Any) -> tuple:
        s = x.sharding
        where = (s.spec, s.memory_kind) if isinstance(s, NamedSharding) else repr(s)
        return (x.shape, x.dtype, where)

    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple(leaf(x) for x in leaves))


# A counted piece is never run, so it is compiled only to the end of XLA's HLO passes
# (`optimized.py`): no machine code, none of the LLVM settings that shape it. Counts take
# XLA's default options, as a user's process compiles (the tests turn XLA's newer kernel
# fusion off for the whole suite, conftest.py, and back on here where they hold kernel
# bytes to a hand count, test_roofline.py).
COUNT_OPTIONS: dict[str, Any] = {}


class Listed(NamedTuple):
    """A piece a step will count (`Executor.will_count`), for `Counter.count_ahead`."""

    name: str
    fn: Any
    mesh: Mesh
    args: tuple
    context: tuple = ()


@dataclass(frozen=True)
class Counted:
    """What one compiled piece costs on its mesh, and the shardings of its outputs."""

    flops_per_device: float
    devices: int
    collectives: tuple[Collective, ...]
    out_shardings: Any
    matmuls: tuple[Matmul, ...] = ()  # per device (`matmuls.py`)
    memory_bytes: int = 0  # per device, moved by kernels other than matmuls
    # the same two with the attention core fused (FlashAttention: `matmuls.py`)
    fused: tuple[tuple[Matmul, ...], int] = ((), 0)
    # the other kernels' bytes fused as an accelerator fuses them (`fusion.py`), with
    # the attention core materialized and fused
    target_bytes: tuple[int, int] = (0, 0)
    # the kernels on weights whose casts are made once a step (`cached_casts.py`), left
    # out of the bytes above: as emitted, and fused
    cast_bytes: tuple[int, int] = (0, 0)


class Counter:
    """Compiles each piece once per signature and keeps its counts. Share one counter
    between the trainers and plans that count the same pieces (a phase-count search, a
    test suite) to compile each piece once. Pieces can also be compiled in the
    background (`count_ahead`), `workers` at a time: XLA compiles without holding
    Python's global interpreter lock, so on two cores two pieces compile side by side,
    or one beside the caller's own work."""

    def __init__(self, workers: int = 2) -> None:
        self._counted: dict[tuple, Counted] = {}
        self._shapes: dict[tuple, tuple] = {}
        self._placed: dict[tuple, tuple] = {}
        # by key: compiling, or compiled, in the pool or in a thread's `count`
        self._ahead: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None  # started by the first `count_ahead`

    def count(self, name: str, fn: Any, mesh: Mesh, args: tuple, context: tuple = ()) -> Counted:
        """Compile the jitted `fn` over the abstract `args` (once per signature: a piece
        another thread is compiling is waited for, not compiled twice). `context`: the settings `fn`
        itself depends on (its optimizer, its rules), so that pieces of one name built
        with other settings are counted apart; an `AttentionShape` among them finds the
        attention core's dots that keep no batch dimension (`attention_core.py`), and
        `CachedWeights` counts their casts apart (`cached_casts.py`)."""
        key = _key(name, mesh, args, context)
        return self._once(key, self._counted, lambda: self._compile(key, fn, mesh, args))

    def _once(self, key: tuple, done: dict, make: Callable[[], None]) -> Any:
        """`done[key]`, made by `make()` unless it is there: a piece another thread is
        compiling is waited for, not compiled twice."""
        if key not in done:
            with self._lock:  # another thread compiling it (`count_ahead`, or `count`)?
                future = self._ahead.get(key)
                mine = future is None
                if mine:
                    future = self._ahead[key] = Future()
            if mine:
                try:
                    make()
                except BaseException as err:
                    future.set_exception(err)
                    raise
                future.set_result(None)
            else:
                future.result()  # raises what the other thread's compile raised
        return done[key]

    def count_compiled(
        self, name: str, compiled: Any, mesh: Mesh, args: tuple, context: tuple = ()
    ) -> Counted:
        """`count` from a piece already compiled over `args` to run (its optimized HLO
        is the one a count stops at: tests/test_count.py)."""
        key = _key(name, mesh, args, context)
        if key not in self._counted:
            with self._lock:
                self._read(key, compiled, mesh, args)
        return self._counted[key]

    def _compile(self, key: tuple, fn: Any, mesh: Mesh, args: tuple) -> None:
        self._read(key, optimized(fn, abstract(args), mesh, COUNT_OPTIONS), mesh, args)

    def _read(self, key: tuple, compiled: Any, mesh: Mesh, args: tuple) -> None:
        """Keep the counts of `compiled` under `key`."""
        text = compiled.as_text()
        attention = next((c for c in key[1] if isinstance(c, AttentionShape)), None)
        cached = next(
            (c for c in key[1] if isinstance(c, CachedWeights) and key[0] in c.pieces), None
        )
        module = Kernels(text, compute_itemsize(args), attention, cached)
        self._counted[key] = Counted(
            float(compiled.cost_analysis().get("flops", 0.0)),
            mesh.size,
            tuple(collectives(text, mesh, module.computations)),
            compiled.output_shardings,
            *module.read(),
            module.read(fused_attention=True),
            (module.memory(target=True), module.memory(fused_attention=True, target=True)),
            (module.casts(), module.casts(target=True)),
        )

    def __len__(self) -> int:
        """How many pieces it has counted."""
        return len(self._counted)

    def count_ahead(self, pieces: Iterable[Listed]) -> list[Future]:
        """Start compiling, in the background, each listed piece not counted or
        compiling yet, and return the futures of all of them. (A dry run for memory
        alone lists the pieces its counted run will count: `Executor.pieces`.) `count`
        waits for a piece compiling here."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="count")
        futures = {}
        for p in pieces:
            key = _key(p.name, p.mesh, p.args, p.context)
            if key in self._counted or key in futures:
                continue
            with self._lock:
                if key not in self._ahead:
                    self._ahead[key] = self._pool.submit(self._compile, key, p.fn, p.mesh, p.args)
                futures[key] = self._ahead[key]
        return list(futures.values())

    def count_all(self, pieces: Iterable[Listed]) -> None:
        """Count each listed piece, those not done yet compiled `workers`
        at a time (`count_ahead`), and wait for all of them."""
        for future in self.count_ahead(pieces):
            future.result()

    def traced(
        self, name: str, fn: Any, mesh: Mesh, args: tuple, context: tuple = ()
    ) -> tuple[list, Any]:
        """(output leaves, tree structure) of the jitted `fn` traced over the abstract
        `args`, once per signature: each leaf with the sharding `fn` declares, or none
        (nothing compiled)."""
        key = _key(name, mesh, args, context)
        if key not in self._shapes:
            self._shapes[key] = jax.tree.flatten(fn.trace(*abstract(args)).out_info)
        return self._shapes[key]

    def outputs(
        self,
        name: str,
        fn: Any,
        mesh: Mesh,
        args: tuple,
        context: tuple,
        count_args: tuple,
    ) -> tuple[list, Any]:
        """(output leaves, tree structure) of the jitted `fn` over the abstract `args`
        on `mesh`: each leaf a `ShapeDtypeStruct` with the sharding `fn` declares for
        it (`out_shardings`) or, where it declares none, that of the piece counted over
        `count_args` (`count`), moved onto `mesh`. Traced once per
        signature (an identical stage on other devices reuses the trace) and placed once
        per mesh. Kept here, not per trainer, so that every plan in a process gets the
        same objects: a vjp's tree structure holds its forward's jaxpr, which compares
        by identity, and a piece counted over it (`bwd-keep`) would compile again for
        each plan that traced the forward anew."""
        key = _key(name, mesh, args, context)
        placed = (key, mesh)
        if placed not in self._placed:
            shapes, treedef = self.traced(name, fn, mesh, args, context)
            shardings = [x.sharding for x in shapes]
            if not all(isinstance(s, NamedSharding) for s in shardings):
                out = self.count(name, fn, mesh, count_args, context).out_shardings
                shardings = [
                    s if isinstance(s, NamedSharding) else c
                    for s, c in zip(shardings, jax.tree.leaves(out), strict=True)
                ]
            leaves = [
                shaped(x.shape, x.dtype, on_mesh(s, mesh))
                for x, s in zip(shapes, shardings, strict=True)
            ]
            self._placed[placed] = (leaves, treedef)
        return self._placed[placed]


def _key(name: str, mesh: Mesh, args: tuple, context: tuple) -> tuple:
    """What a piece's count depends on. The mesh's axis sizes, not its
    devices: identical stages share counts, but the same specs on a mesh of other sizes
    are other shards."""
    return (name, context, tuple(mesh.shape.items()), signature(args))


def on_mesh(sharding: Any, mesh: Mesh) -> Any:
    """The same layout over `mesh`'s devices (meshes of one shape, one device order)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    if sharding.device_set == set(mesh.devices.flat):
        return sharding
    raise NotImplementedError(f"cannot move {type(sharding).__name__} to another stage's mesh")


# The process's counter: every engine counts into it unless given its own, so a second
# run of the same settings in one process (a resumed run, a sweep, a test suite) counts
# nothing again.
PROCESS_COUNTER = Counter()


def piece_events(
    counted: Counted,
    step: int,
    phase: Phase,
    stage: int,
    carries: Carries = "",
    on: Where = "device",
    repeat: int = 1,
    recompute: float = 0.0,
    axis_labels: dict[str, str] | None = None,
    fused_attention: bool = False,
) -> list[Event]:
    """The ledger events of one counted piece run `repeat` times: its computation and
    its collectives, grouped by (op, mesh axes, group size). `recompute`: FLOPs per
    device and repeat that recompute a forward pass. `axis_labels` renames mesh axes to
    the ones users know (a stage's `rts` sub-axis is part of `replica`).
    `fused_attention`: its kernels with the attention core fused (`matmuls.py`)."""
    labels = axis_labels or {}
    n = counted.devices * repeat
    matmuls, memory = counted.fused if fused_attention else (counted.matmuls, counted.memory_bytes)
    events = [
        Event(
            step,
            phase,
            "compute",
            carries,
            flops=counted.flops_per_device * n,
            devices=counted.devices,
            on=on,
            recompute_flops=recompute * n,
            stage=stage,
            run_flops=counted.flops_per_device,
            matmuls=matmuls,
            memory_bytes=memory,
            fused_memory_bytes=counted.target_bytes[fused_attention],
        )
    ]
    grouped: dict[tuple, float] = defaultdict(float)
    for c in counted.collectives:
        label = "+".join(dict.fromkeys(labels.get(a, a) for a in c.axes))
        grouped[(c.op, label, c.group)] += c.sent_bytes * n
    events += [
        Event(
            step,
            phase,
            "collective",
            carries,
            round(sent),
            axis=label,
            devices=counted.devices,
            op=op,
            group=group,
            stage=stage,
        )
        for (op, label, group), sent in grouped.items()
    ]
    return events
