"""One code path for real and abstract execution of stage programs.

The phased and pipelined programs hand every transfer and every computation to an
`Executor`. In real
mode transfers are `jax.device_put`s between memory kinds and computations run; in
abstract mode both return `ShapeDtypeStruct`s with the same shapes and shardings, so a
GPT-3-sized step can be planned on a laptop: nothing is allocated, and only the pieces
that must be counted are compiled. Either way each piece is counted once per abstract
signature (`accounting/count.py`) and its FLOPs and collectives are written to the
ledger. An executor serves one step: its events carry that step's number.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from shardemu.accounting.count import (
    Counted,
    Counter,
    Listed,
    piece_events,
    shaped,
    signature,
)
from shardemu.accounting.ledger import Carries, Event, Ledger, Phase, Where
from shardemu.accounting.sizes import bytes_all_devices, bytes_per_device, copies
from shardemu.devices import settled
from shardemu.stages.crossing import put
from shardemu.stages.pieces import Piece
from shardemu.stages.tiers import Tier, with_memory_kind


class StageLike(Protocol):
    """Where a piece runs: a pipeline stage's index, its mesh and its compiled pieces
    (`stages/stage.py`)."""

    index: int
    mesh: Mesh

    def fn(self, piece: Piece) -> Any: ...

    def executable(self, piece: Piece, args: tuple) -> Any | None: ...


class Executor:
    """Runs (real) or shapes (abstract) transfers and computations, and records them."""

    def __init__(
        self,
        ledger: Ledger,
        tiers: list[Tier],
        axis_labels: dict[str, str],
        real: bool,
        counter: Counter,
        step: int = 0,
        context: tuple = (),
        fused_attention: bool = False,
        counting: bool = True,
        compiles_to_run: bool = False,
    ) -> None:
        self.ledger, self.tiers, self.real, self.step = ledger, tiers, real, step
        # False: an abstract step for its memory alone (whether a layout fits), which
        # records no computation and compiles only the pieces that do not declare
        # their outputs' shardings; it lists the pieces a counted step would count
        # for `Counter.count_all`
        self.counting = counting or real
        # a dry run of a trainer that will run: its counted pieces compile as the real
        # steps will (`Stage.executable`), so that those steps reuse them
        self.compiles_to_run = compiles_to_run
        self.pieces: list[Listed] = []
        self.fused_attention = fused_attention  # record kernels as FlashAttention's
        self.axis_labels = axis_labels  # mesh axis -> the name users know it by
        self.counter = counter
        self.context = context  # settings a piece's compilation depends on beyond its inputs

    # ---- transfers -----------------------------------------------------------------------

    def to_device(
        self,
        stage: int,
        key: str,
        tree: Any,
        shardings: Any,
        phase: Phase,
        carries: Carries,
        nbytes: int | None = None,
    ) -> Any:
        """Host tier -> device tier of `stage`, which admits `key` (or refuses).
        `nbytes`: what the transfer moves over all devices when the host tier stores
        `tree` in a layout of its own (sparse weights, `sparsity/storage.py`); by
        default the arrays' bytes."""
        out = self.place(tree, with_memory_kind(shardings, "device"))
        self.tiers[stage].admit(key, bytes_per_device(out), phase)
        self._record_transfer(phase, "h2d", carries, out, stage, nbytes)
        return out

    def to_host(
        self,
        stage: int,
        tree: Any,
        shardings: Any,
        phase: Phase,
        carries: Carries,
        nbytes: int | None = None,
    ) -> Any:
        """Device tier of `stage` -> host tier (`nbytes` as in `to_device`)."""
        out = self.place(tree, with_memory_kind(shardings, "pinned_host"))
        self._record_transfer(phase, "d2h", carries, out, stage, nbytes)
        return out

    def broadcast(
        self,
        stage: int,
        key: str,
        tree: Any,
        shardings: Any,
        phase: Phase,
        carries: Carries,
        nbytes: int | None = None,
    ) -> Any:
        """Host tier (MemoryX) -> every system over SwarmX (weight streaming): each
        system's device tier admits `key`, whole weights on each (`shardings` replicate
        over the systems). One `broadcast` event over the `swarmx` link whose bytes are
        what each link of the tree carries: one copy (of `nbytes`' layout, as in
        `to_device`)."""
        out = self.place(tree, with_memory_kind(shardings, "device"))
        self.tiers[stage].admit(key, bytes_per_device(out), phase)
        systems = _devices(out)
        copies = bytes_all_devices(out) if nbytes is None else nbytes
        self.ledger.record(
            Event(
                self.step,
                phase,
                "broadcast",
                carries,
                copies // systems,
                axis="swarmx",
                devices=systems,
                stage=stage,
            )
        )
        return out

    def reduce(
        self,
        stage: StageLike,
        piece: Piece,
        stacked: Any,
        shardings: Any,
        masks: Any,
        phase: Phase,
        carries: Carries,
    ) -> Any:
        """Every system's gradients -> the host tier, summed on the way (SwarmX's
        reduce): the [systems, ...] stack leaves the devices (each system its own row,
        in `shardings`) and `piece(stack, masks)` sums it where it lands. One `reduce`
        event over the `swarmx` link whose bytes are what each link carries: one
        system's gradients. The sum is the network's, so it is not a computation of the
        ledger (nor are the cross-device adds XLA compiles it into collectives)."""
        rows = self.place(stacked, with_memory_kind(shardings, "pinned_host"))
        systems = _devices(rows)
        self.ledger.record(
            Event(
                self.step,
                phase,
                "reduce",
                carries,
                bytes_all_devices(rows) // systems,
                axis="swarmx",
                devices=systems,
                stage=stage.index,
            )
        )
        args = (rows, masks)
        if self.real:
            return settled(stage.fn(piece)(*args))
        return self.shape(piece, stage, args)

    def send(self, stage: int, tree: Any, shardings: Any, phase: Phase, carries: Carries) -> Any:
        """Device to device across pipeline stages: a point-to-point transfer over `pipe`."""
        out = self.place(tree, shardings)
        self.ledger.record(
            Event(
                self.step,
                phase,
                "collective",
                carries,
                bytes_all_devices(out),
                axis="pipe",
                devices=_devices(out),
                op="collective-permute",
                group=2,
                stage=stage,
                copies=copies(out),
            )
        )
        return out

    def exchange(
        self,
        stage: int,
        tree_a: Any,
        to_b: Any,
        tree_b: Any,
        to_a: Any,
        phase: Phase,
        carries: Carries,
    ) -> tuple[Any, Any]:
        """Two stages swap trees so that each can sum both: an all-reduce over `pipe`
        between two stages (the tied embedding's gradient halves, as Megatron-LM sums
        them), one event recorded on `stage`. `to_b`, `to_a`: the shardings on the
        receiving stage. Returns (b's tree on a, a's tree on b)."""
        at_b, at_a = self.place(tree_a, to_b), self.place(tree_b, to_a)
        self.ledger.record(
            Event(
                self.step,
                phase,
                "collective",
                carries,
                bytes_all_devices(at_b) + bytes_all_devices(at_a),
                axis="pipe",
                devices=_devices(at_a) + _devices(at_b),
                op="all-reduce",
                group=2,
                stage=stage,
            )
        )
        return at_a, at_b

    def place(self, tree: Any, shardings: Any) -> Any:
        """`tree` in `shardings`, recording nothing: for what a counted transfer already
        carried in another form (a sparse weight's mask, as its block coordinates)."""
        if self.real:
            return put(tree, shardings)
        return jax.tree.map(lambda x, s: shaped(x.shape, x.dtype, s), tree, shardings)

    def _record_transfer(
        self,
        phase: Phase,
        kind: str,
        carries: Carries,
        tree: Any,
        stage: int,
        nbytes: int | None,
    ) -> None:
        moved = bytes_all_devices(tree) if nbytes is None else nbytes
        self.ledger.record(
            Event(self.step, phase, kind, carries, moved, devices=_devices(tree), stage=stage)
        )

    # ---- computations --------------------------------------------------------------------

    def run(
        self,
        phase: Phase,
        piece: Piece,
        stage: StageLike,
        args: tuple,
        count_args: tuple | None = None,
        repeat: int = 1,
        carries: Carries = "",
        on: Where = "device",
        recompute: float = 0.0,
    ) -> Any:
        """Run `stage`'s `piece` on `args` (real) or shape it (abstract), and record its
        FLOPs and collectives: those of the piece compiled over `count_args` (default `args`), times
        `repeat`. A phase of k identical layers is counted as one layer times k (XLA's
        cost analysis counts a scanned body once, whatever its trip count).
        `recompute`: FLOPs per device and repeat that recompute a forward pass. Not
        counting (`counting`), only its outputs' shapes."""
        count_args = args if count_args is None else count_args
        # a piece counted over what it runs on (its arrays, or one layer's shapes when it
        # runs one layer) compiles once for both; a planner's dry run compares nothing
        compile_to_run = self.real or (self.compiles_to_run and self.counting)
        same = compile_to_run and (count_args is args or signature(count_args) == signature(args))
        run = stage.executable(piece, args) if same else None
        if self.counting:
            if run is not None:
                counted = self.counter.count_compiled(piece, run, stage.mesh, args, self.context)
            else:
                counted = self.count(piece, stage, count_args)
            for event in piece_events(
                counted,
                self.step,
                phase,
                stage.index,
                carries,
                on,
                repeat,
                recompute,
                self.axis_labels,
                self.fused_attention,
            ):
                self.ledger.record(event)
        else:
            self.will_count(piece, stage, count_args)
        if self.real:
            return settled((run or stage.fn(piece))(*args))
        return self._shaped(piece, stage, args, count_args)

    def shape(self, piece: Piece, stage: StageLike, args: tuple) -> Any:
        """The abstract outputs of `piece` on `args`, shardings included; nothing
        recorded."""
        return self._shaped(piece, stage, args, args)

    def _shaped(self, piece: Piece, stage: StageLike, args: tuple, count_args: tuple) -> Any:
        """Shapes of `piece` on `args`, each with the sharding it declares for it or, where
        it declares none, that of the piece counted over `count_args`
        (`Counter.outputs`), matched leaf by leaf (a stack of k layers has the one-layer
        piece's leaves; a vjp's tree structure also names its trip count, so the
        structures differ)."""
        fn = stage.fn(piece)
        leaves, treedef = self.counter.outputs(
            piece, fn, stage.mesh, args, self.context, count_args
        )
        return treedef.unflatten(leaves)

    def will_count(self, piece: Piece, stage: StageLike, args: tuple) -> None:
        """Not counting: list a piece the counted step will count."""
        self.pieces.append(Listed(piece, stage.fn(piece), stage.mesh, args, self.context))

    def count(self, piece: Piece, stage: StageLike, args: tuple) -> Counted:
        """Compile `stage`'s `piece` over the abstract `args` once per signature and count it."""
        return self.counter.count(piece, stage.fn(piece), stage.mesh, args, self.context)


def one_layer(tree: Any) -> Any:
    """The abstract first layer of a stack of layers (axis 0)."""
    return jax.tree.map(lambda x: shaped((1, *x.shape[1:]), x.dtype, x.sharding), tree)


def _devices(tree: Any) -> int:
    return len(jax.tree.leaves(tree)[0].sharding.device_set)
