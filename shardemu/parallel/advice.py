"""What to tell a user whose mesh does not divide a model's dimensions: a fix per
logical dimension, and the sizes of a mesh axis that would divide every dimension it
splits (so that `--mesh tensor=3` on a model of 32 heads and a 14,336-wide MLP is told
that 1, 2, 4, 8, 16 or 32 would do, once, rather than once a parameter)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

# What to suggest when a dimension does not divide, by logical name.
FIX_HINTS = {
    "vocab": "pad the vocabulary to a multiple of 128 (ModelConfig.pad_vocab)",
    "heads": "use a model whose head count the axis divides",
    "kv_heads": (
        "use a tensor size that divides the key/value heads (ModelConfig.num_kv_heads), or "
        "map 'kv_heads' to None to replicate them (the default rules do so)"
    ),
    "mlp": "use a model whose MLP width the axis divides",
    "batch": "use a global TrainConfig.batch that is a multiple of the axis size",
    "layers": "use a pipe size that divides the layer count (or TrainConfig.stage_layers)",
}


def dividing_sizes(dims: Iterable[int]) -> list[int]:
    """The axis sizes that divide every one of `dims`: the divisors of their greatest
    common divisor."""
    g = math.gcd(*dims)
    return [n for n in range(1, g + 1) if g % n == 0]


def sizes_advice(splits: Mapping[str, list[int]], failing: Iterable[str]) -> str:
    """A sentence per mesh axis in `failing`: the sizes that divide every parameter
    dimension it splits alone (`splits`: axis -> those dimensions' sizes, the failing
    ones included)."""
    sentences = []
    for axis in failing:
        sizes = dividing_sizes(splits.get(axis, ()))
        if len(sizes) > 1:
            listed = ", ".join(map(str, sizes))
            sentences.append(
                f"Sizes of {axis!r} that divide every parameter dimension it splits: {listed}"
            )
        else:
            sentences.append(
                f"No size of {axis!r} above 1 divides every parameter dimension it splits: "
                "fix those named above"
            )
    return ". ".join(sentences)
