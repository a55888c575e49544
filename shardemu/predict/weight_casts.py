"""FP8 weight casts timed where the target makes them (`accounting/cached_casts.py`):
Transformer Engine under Megatron-Core casts a layer's weights at a step's first
microbatch and keeps the FP8 copies for the others, so a resident plan's count leaves
the casts out of its layer pieces and times them once a step, with the layer's update.
Under ZeRO stage 3 a layer's weights are gathered for each microbatch and freed after
it, so there is no copy to keep: the casts stay in every microbatch's pieces, as the
JAX program makes them (`zero.placed_casts`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shardemu.accounting.count import Counter, Listed
from shardemu.accounting.ledger import Event
from shardemu.stages.pieces import Piece

# the pieces that cast a layer's weights (its forward and backward, recomputing or not)
LAYER_PIECES = frozenset({Piece.FWD, Piece.FWD_KEEP, Piece.BWD, Piece.BWD_KEEP})
Bytes = tuple[int, int]  # as XLA's CPU emits the kernels, and fused (`Counted.cast_bytes`)


@dataclasses.dataclass(frozen=True)
class WeightCasts:
    """The bytes of one layer's weight casts that its counted pieces leave out: its
    forward's and its backward's (`recomputes`: the backward recomputes the forward)."""

    forward: Bytes = (0, 0)
    backward: Bytes = (0, 0)
    recomputes: bool = False

    @property
    def once(self) -> Bytes:
        """What a step casts once: the backward's alone when it recomputes the forward,
        whose casts it makes again; else both."""
        if self.recomputes:
            return self.backward
        return (self.forward[0] + self.backward[0], self.forward[1] + self.backward[1])


def counted_casts(counter: Counter, pieces: Iterable[Listed], full_recompute: bool) -> WeightCasts:
    """A layer's `WeightCasts`, from the counted `pieces` (counted already)."""
    forward, backward = (
        (Piece.FWD, Piece.BWD) if full_recompute else (Piece.FWD_KEEP, Piece.BWD_KEEP)
    )
    by_name = {
        p.name: counter.count(p.name, p.fn, p.mesh, p.args, p.context).cast_bytes
        for p in pieces
        if p.name in (forward, backward)
    }
    return WeightCasts(by_name.get(forward, (0, 0)), by_name.get(backward, (0, 0)), full_recompute)


def with_bytes(events: list[Event], casts: Bytes) -> list[Event]:
    """`events` with their (first) computation moving the casts' bytes too."""
    emitted, fused = casts
    out, done = [], not (emitted or fused)
    for e in events:
        if not done and e.kind == "compute":
            e = dataclasses.replace(
                e,
                memory_bytes=e.memory_bytes + emitted,
                fused_memory_bytes=e.fused_memory_bytes + fused,
            )
            done = True
        out.append(e)
    return out
