"""What to tell a user whose mesh does not divide a model's dimensions: a fix per
logical dimension, the parameters that fail grouped by the dimension that fails them,
and the sizes of a mesh axis that would divide every dimension it splits (so that
`--mesh tensor=3` on a model of 32 heads and a 14,336-wide MLP is told that 1, 2, 4, 8,
16 or 32 would do, once, rather than once a parameter)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

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
    "layers": (
        "use a pipe size that divides the layer count (a run or a resident plan may instead "
        "give each stage its layers: TrainConfig.stage_layers)"
    ),
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


@dataclass(frozen=True)
class Indivisible:
    """A tensor's dimension `dim` (logical `name`, `size` long) that its mesh axes `axes`
    (a PartitionSpec entry) of `n` devices together do not divide."""

    dim: int
    name: str | None
    size: int
    axes: object
    n: int

    @property
    def hint(self) -> str:
        return FIX_HINTS.get(self.name or "", f"change the rule for {self.name!r}")

    def sentence(self) -> str:
        return (
            f"dimension {self.dim} ({self.name!r}, size {self.size}) is not divisible by mesh "
            f"axis {self.axes!r} (size {self.n}); {self.hint}, or choose a mesh axis size "
            f"dividing {self.size}"
        )


def indivisible_message(failures: Sequence[tuple[str, Indivisible]]) -> str:
    """One sentence for several parameters (`failures`: each one's path and first
    failing dimension), grouped by that dimension: its name and size, the mesh axes,
    the parameters and the fix, each said once."""
    groups: dict[tuple[str | None, int, str, int], tuple[Indivisible, list[str]]] = {}
    for path, bad in failures:
        key = (bad.name, bad.size, repr(bad.axes), bad.n)
        groups.setdefault(key, (bad, []))[1].append(path)
    parts = []
    for bad, paths in groups.values():
        listed = ", ".join(paths[:-1]) + " and " + paths[-1] if len(paths) > 1 else paths[0]
        parts.append(
            f"their {bad.name!r} dimension {bad.size} is not divisible by mesh axis "
            f"{bad.axes!r} (size {bad.n}) in {listed}: {bad.hint}"
        )
    return f"{len(failures)} parameters cannot be sharded: {'; '.join(parts)}"
