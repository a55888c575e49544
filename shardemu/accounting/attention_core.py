"""Which of a module's dots are an attention core's, and the layouts of its scores.

FlashAttention fuses the core (Q K^T, the softmax, P V and their gradients) into one
kernel whose [s, s] scores never reach memory (`matmuls.py`). Finding the core in an
SPMD-partitioned module is a matter of shapes: a dot with batch dimensions (heads x
batch) one of whose arrays is [.., s, s], or [.., r q, s] for grouped-query attention or
context parallelism (`scores_index`). With one sequence and one key/value group a device
(Llama 3 405B at tensor 8: its 8 groups over 8 devices; a micro-batch of 1), XLA drops
the unit dimensions and the core's dots keep no batch dimension: a [r q, d] x [s, d]
product looks like a projection's [tokens, d] x [d, f]. The model's own shape tells them
apart (`AttentionShape`): a count whose context names it finds those dots too.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from shardemu.accounting.hlo import ARRAY, CONTRACTING, dims, no_units
from shardemu.config import ModelConfig

# the widest attention head of the models we know (64 to 256: GPT-3's 128, Llama's 128,
# Gemma's 256); an expert's matmul contracts a model width, above it in any model but a
# toy's
MAX_HEAD_WIDTH = 256
# the most query heads a key/value head serves on one device: a multi-query model's
# heads (Falcon-40B's 128 over 8 groups is 16; PaLM's multi-query 48), at most 128 here
MAX_QUERY_GROUP = 128
_BATCH = re.compile(r"lhs_batch_dims=\{([\d,]*)\}")
_RHS_BATCH = re.compile(r"rhs_batch_dims=\{([\d,]*)\}")


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention shape, put in a count's context (`Counter.count`) to find
    the core's dots that keep no batch dimension: each has a [r queries, keys] array
    (r query heads of one key/value group merged with a device's queries, in either
    order) whose third dimension (the other operand's, or the contracted one) is
    `head_width`. A projection of [tokens, d] meets all of that only in a toy whose
    device holds one head and whose width is r times the sequence."""

    head_width: int
    keys: int  # the keys a query attends over: the whole sequence (gathered under CP)
    queries: int  # a device's queries: the sequence over the context axis
    group: int  # the most query heads a key/value head serves

    @classmethod
    def of(cls, cfg: ModelConfig, seq: int, context: int = 1) -> AttentionShape:
        """`cfg`'s attention over sequences of `seq`, split over `context` devices."""
        return cls(cfg.head_dim, seq, seq // context, cfg.num_heads // cfg.kv_heads)

    def scores(self, free: list[int]) -> bool:
        """Whether an array of the two dimensions `free` is the core's scores."""
        return any(
            sorted(free) == sorted((self.keys, r * self.queries)) for r in range(1, self.group + 1)
        )


def score_layouts(shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The layouts (1s dropped: `no_units`) of an attention core's scores whose matmul
    array is `shape`: [.., q, s]; or, for grouped-query attention, whose matmul merges a
    group's r query heads with the queries ([.., r q, s] or [.., s, r q]), those two and
    the [.., r, q, s] its softmax computes on, in any order. With context parallelism q
    is a rank's share of the s keys (s / cp), so r q need not be a multiple of s, nor s
    of r q: every r up to `MAX_QUERY_GROUP` that divides the merged dimension is taken,
    with either of the two as the merged one."""
    *lead, x, y = shape
    layouts = [shape, (*lead, y, x)]
    for merged, keys in ((x, y), (y, x)):
        for r in range(2, min(merged, MAX_QUERY_GROUP) + 1):
            if merged % r == 0:
                layouts += [(*lead, *p) for p in itertools.permutations((r, merged // r, keys))]
    return {no_units(tuple(layout)) for layout in layouts}


def scores_index(
    rest: str, arrays: tuple[str, str, str], shape: AttentionShape | None = None
) -> int | None:
    """Which of a dot's arrays (lhs, rhs, output) is an attention core's [.., s, s]
    (its two non-batch dimensions equal), or, for grouped-query attention or context
    parallelism, [.., r q, s] in either order (XLA merges the r query heads of a
    key/value group with the queries; a context-parallel rank's q queries are s / cp of
    the s keys): the head width, the dot's third dimension, below both and at most
    `MAX_HEAD_WIDTH`. A dot without batch dimensions only with the model's `shape`
    (`AttentionShape.scores`, its third dimension the head width). None: not the
    core's."""
    lhs_batch, rhs_batch = _BATCH.search(rest), _RHS_BATCH.search(rest)
    batched = bool(lhs_batch and rhs_batch and dims(lhs_batch.group(1)))
    if not batched and shape is None:
        return None
    shapes = [dims(ARRAY.search(array).group(2)) for array in arrays]  # type: ignore[union-attr]
    if batched:
        batches = (dims(lhs_batch.group(1)), dims(rhs_batch.group(1)), None)  # type: ignore[union-attr]
        frees = [
            [d[i] for i in range(len(d)) if i not in (batch or range(len(d) - 2))]
            for d, batch in zip(shapes, batches, strict=True)
        ]
    else:
        frees = [list(d) for d in shapes]
    for index, free in enumerate(frees):
        if batched and len(free) == 2 and free[0] == free[1]:
            return index
    if any(len(free) != 2 for free in frees):
        return None
    # not square: grouped-query attention ([.., r q, s], XLA merging a key/value group's
    # r query heads with the queries) or context parallelism ([.., q, cp q]: a rank's
    # queries against every key), or both. The array's third dimension (the other
    # operand's, or the contracted one) must be a head's width, below both of its own:
    # an expert's batched matmul contracts a model width (`MAX_HEAD_WIDTH`)
    contracted = dims(CONTRACTING.search(rest).group(1))  # type: ignore[union-attr]
    width = math.prod(shapes[0][a] for a in contracted if a < len(shapes[0]))
    out = frees[2]
    third = (out[1], out[0], width)  # each array's other dimension: rhs's, lhs's, contracted
    for index, free in enumerate(frees):
        if not third[index] < min(free):
            continue
        if batched and third[index] <= MAX_HEAD_WIDTH:
            return index
        if shape and third[index] == shape.head_width and shape.scores(free):
            return index
    return None
