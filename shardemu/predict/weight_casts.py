"""FP8 weight casts timed once a step, as Transformer Engine makes them under
Megatron-Core (`accounting/cached_casts.py`), not once a microbatch as the JAX program
makes them: a resident plan's count leaves them out of its layer pieces, and here they
join the layer's update, the other work a step does once for each layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shardemu.accounting.count import Counter
from shardemu.accounting.ledger import Event
from shardemu.stages.pieces import Piece

# the pieces that cast a layer's weights (its forward and backward, recomputing or not)
LAYER_PIECES = frozenset({Piece.FWD, Piece.FWD_KEEP, Piece.BWD, Piece.BWD_KEEP})


def once_a_step(counter: Counter, pieces: Iterable[tuple], full_recompute: bool) -> tuple[int, int]:
    """The bytes (as emitted, fused) of one layer's weight casts in a step, from the
    counted `pieces` (`Counter.count`'s arguments, counted already): the backward's when
    it recomputes the forward (whose casts it makes again), else the forward's (the
    casts) and the backward's (the transposed copies its GEMMs read)."""
    names = (Piece.BWD,) if full_recompute else (Piece.FWD_KEEP, Piece.BWD_KEEP)
    casts = [counter.count(*piece).cast_bytes for piece in pieces if piece[0] in names]
    return sum(c[0] for c in casts), sum(c[1] for c in casts)


def with_casts(update: list[Event], casts: tuple[int, int]) -> list[Event]:
    """A layer's update events, its computation moving the casts' bytes too."""
    emitted, fused = casts
    return [
        dataclasses.replace(
            e,
            memory_bytes=e.memory_bytes + emitted,
            fused_memory_bytes=e.fused_memory_bytes + fused,
        )
        if e.kind == "compute"
        else e
        for e in update
    ]
