"""FP8 casts of a step's weights, made once a step and kept for its microbatches.

Transformer Engine casts a linear layer's weight to FP8 (its amax, its scale and cast,
and the transposed copy the backward's GEMM reads) at a step's first microbatch and
keeps the FP8 copies for the others: `Linear.forward(..., is_first_microbatch)` ("during
FP8 training, it allows caching of the FP8 versions of the weights", Transformer Engine's
PyTorch API), which Megatron-Core's schedules set on each step's first microbatch
(`megatron/core/pipeline_parallel/schedules.py`, `forward_step`:
`model.set_is_first_microbatch()`). The JAX program (`models/fp8.py`) casts them in
every microbatch's piece, as it runs.

A count whose context holds `CachedWeights` (a resident plan in FP8:
`predict/resident_count.py`) leaves the kernels that read and write only those weights'
arrays out of the piece's memory traffic and reports their bytes apart
(`Counted.cast_bytes`), for the plan to time once a step.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import jax

from shardemu.accounting.hlo import no_units


@dataclass(frozen=True)
class CachedWeights:
    """The per-device layouts (1s dropped) of the weights whose casts are made once a
    step, in every form XLA may compute on them: any order of their dimensions, and
    two groups of adjacent ones merged (a [d, heads, head width] projection as [d, heads
    x head width]); and the pieces that cast them (the layers' forward and backward:
    an optimizer update also works on the weights alone, every step)."""

    layouts: frozenset[tuple[int, ...]]
    pieces: frozenset[str]

    @classmethod
    def of(cls, weights: Any, pieces: frozenset[str]) -> CachedWeights:
        """The layouts of the arrays of `weights` (abstract and sharded, as a piece takes
        them) of two dimensions or more, cast in `pieces`: vectors (norm scales) are not
        cast to FP8."""
        layouts: set[tuple[int, ...]] = set()
        for leaf in jax.tree.leaves(weights):
            shape = no_units(leaf.sharding.shard_shape(leaf.shape))
            if len(shape) < 2:
                continue
            layouts.update(itertools.permutations(shape))
            for cut in range(1, len(shape)):
                merged = (math.prod(shape[:cut]), math.prod(shape[cut:]))
                layouts.update((merged, merged[::-1]))
        return cls(frozenset(layouts), pieces)

    def holds(self, arrays: list[tuple[int, ...]]) -> bool:
        """Whether a kernel whose arrays (its operands and outputs, 1s dropped) are
        `arrays` works on these weights alone: every one but scalars is of their
        layouts, and one at least."""
        shaped = [a for a in arrays if a]
        return bool(shaped) and all(a in self.layouts for a in shaped)
