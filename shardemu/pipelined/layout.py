"""Which layers each pipeline stage runs: even stages, uneven `--stage-layers`, and the
model chunks of interleaved schedules.

With p stages and v chunks per stage there are p v virtual stages, run in model order:
virtual stage j = chunk * p + stage holds the next block of layers (Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters", Section 2.2.2:
device s holds chunks s, s + p, ...). Stage s's n_s layers are split into v equal
chunks, so virtual stage j has n_{j mod p} / v layers. Without `stage_layers` every
stage gets L / p layers. Graphcore's BERT-Large on 4 IPUs puts fewer layers on the
stage that also holds the embedding (Graphcore, "BERT-Large training on the IPU",
pipeline configuration [3, 7, 7, 7]), which `stage_layers` expresses. Megatron-Core's
`account_for_embedding_in_pipeline_split` and `account_for_loss_in_pipeline_split` count
the embedding and the loss as a layer each in an even split, so the first and the last
chunk hold a layer fewer, none where a chunk is one layer (Llama 3 405B: Dubey et al.
2024, §3.3.2): `Split`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax

from shardemu.config import TrainConfig
from shardemu.errors import ConfigError
from shardemu.models import Model


@dataclass(frozen=True)
class PipelineLayout:
    stages: int  # p: pipeline stages (pipe slices)
    virtual: int  # v: model chunks per stage
    slices: tuple[tuple[int, int], ...]  # per virtual stage: its layers [start, end)

    @property
    def last(self) -> int:
        """The last virtual stage: the one that runs the head and the loss."""
        return len(self.slices) - 1

    def stage_of(self, j: int) -> int:
        return j % self.stages

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def layers_of(self, j: int) -> int:
        lo, hi = self.slices[j]
        return hi - lo

    def stage_layers(self) -> list[int]:
        """Layers per stage, all chunks together."""
        return [
            sum(self.layers_of(j) for j in range(s, len(self.slices), self.stages))
            for s in range(self.stages)
        ]


@dataclass(frozen=True)
class Split:
    """How the layers are dealt to the stages: `stage_layers` per stage (None: even),
    or evenly with the embedding (`embedding`) and the loss (`loss`) counted as a layer
    each (Megatron-Core's `account_for_embedding_in_pipeline_split`,
    `account_for_loss_in_pipeline_split`)."""

    stage_layers: tuple[int, ...] | None = None
    embedding: bool = False
    loss: bool = False

    @classmethod
    def of(cls, train: TrainConfig) -> Split:
        return cls(
            train.stage_layers,
            train.account_for_embedding_in_pipeline_split,
            train.account_for_loss_in_pipeline_split,
        )


EVEN = Split()  # the layers alone, evenly (or by `stage_layers`)


def refuse_phased(train: TrainConfig) -> None:
    """A phased run or plan spreads its phases evenly over the stages: a split of
    pipelined stages is refused, not dropped."""
    split = Split.of(train)
    if split == EVEN:
        return
    name = (
        "stage_layers"
        if split.stage_layers is not None
        else (f"account_for_{'embedding' if split.embedding else 'loss'}_in_pipeline_split")
    )
    raise ConfigError(
        f"TrainConfig.{name} sets the layers of pipelined stages; a phased run or plan "
        f"spreads its phases evenly over the stages (leave out TrainConfig.{name}, or the "
        f"phased settings)"
    )


def pipeline_layout(
    num_layers: int, stages: int, virtual: int = 1, split: Split = EVEN
) -> PipelineLayout:
    """The layers of each virtual stage, or a clear error naming the value and the fix."""
    if split.embedding or split.loss:
        return _counted_split(num_layers, stages, virtual, split)
    stage_layers = split.stage_layers
    if stage_layers is None:
        if num_layers % stages:
            raise ConfigError(
                f"{num_layers} layers do not split evenly over pipe={stages}; use a pipe size "
                f"that divides {num_layers}, or give the layers of each stage with "
                f"TrainConfig.stage_layers (e.g. {_suggest(num_layers, stages)})"
                f"{counted_hint(num_layers, stages * virtual)}"
            )
        stage_layers = (num_layers // stages,) * stages
    stage_layers = tuple(stage_layers)
    if len(stage_layers) != stages:
        raise ConfigError(
            f"TrainConfig.stage_layers {_fmt(stage_layers)} gives {len(stage_layers)} stages "
            f"but the mesh has pipe={stages}; give one layer count per stage"
        )
    if any(n < 1 for n in stage_layers):
        raise ConfigError(
            f"TrainConfig.stage_layers {_fmt(stage_layers)} has a stage without layers; every "
            f"stage needs at least one (use a smaller pipe)"
        )
    if sum(stage_layers) != num_layers:
        raise ConfigError(
            f"TrainConfig.stage_layers {_fmt(stage_layers)} sums to {sum(stage_layers)} but "
            f"the model has {num_layers} layers; the counts must add up to {num_layers}"
        )
    bad = [n for n in stage_layers if n % virtual]
    if bad:
        raise ConfigError(
            f"TrainConfig.virtual {virtual} does not divide the {bad[0]} layers of a stage "
            f"(layers per stage: {_fmt(stage_layers)}); each stage's layers split into "
            f"TrainConfig.virtual equal chunks, so use a divisor of every stage's layer count"
        )
    slices, start = [], 0
    for j in range(stages * virtual):
        size = stage_layers[j % stages] // virtual
        slices.append((start, start + size))
        start += size
    return PipelineLayout(stages, virtual, tuple(slices))


def _counted_split(num_layers: int, stages: int, virtual: int, split: Split) -> PipelineLayout:
    """Megatron-Core's even split of the layers and the embedding or the loss, each
    counted as a layer (`transformer_block.get_transformer_layer_offset`): every model
    chunk u of them; the first chunk's first is the embedding, the last chunk's last
    the loss."""
    counted = [name for name, on in (("embedding", split.embedding), ("loss", split.loss)) if on]
    flags = " and ".join(f"TrainConfig.account_for_{name}_in_pipeline_split" for name in counted)
    if split.stage_layers is not None:
        raise ConfigError(
            f"TrainConfig.stage_layers {_fmt(split.stage_layers)} and {flags} both set how "
            f"layers are split over the stages; give one of them"
        )
    chunks, units = stages * virtual, num_layers + len(counted)
    if units % chunks:
        raise ConfigError(
            f"{num_layers} layers and the {' and the '.join(counted)} ({flags}) make {units}, "
            f"which do not split evenly into pipe * virtual = {chunks} model chunks; use a "
            f"pipe and virtual whose product divides {units}, or leave out {flags}"
        )
    per = units // chunks
    slices, start = [], 0
    for j in range(chunks):
        size = per - (split.embedding and j == 0) - (split.loss and j == chunks - 1)
        slices.append((start, start + size))
        start += size
    return PipelineLayout(stages, virtual, tuple(slices))


def counted_hint(num_layers: int, chunks: int) -> str:
    """The split that would divide `num_layers` into `chunks` model chunks with the
    embedding or the loss counted as a layer (`Split`), said as advice; "" if none."""
    for extra, names in ((1, ("embedding",)), (2, ("embedding", "loss"))):
        if (num_layers + extra) % chunks == 0:
            flags = " and ".join(f"TrainConfig.account_for_{n}_in_pipeline_split" for n in names)
            return f"; or count the {' and the '.join(names)} as layers in the split ({flags})"
    return ""


def _fmt(counts: tuple[int, ...]) -> str:
    return ",".join(map(str, counts))


def _suggest(layers: int, stages: int) -> str:
    base, extra = divmod(layers, stages)
    if base == 0:
        return f"a pipe of at most {layers}"
    return _fmt(tuple(base + (s >= stages - extra) for s in range(stages)))


def stage_plan(model: Model, lay: PipelineLayout) -> list[dict[str, Any]]:
    """Per stage: its layers ([start, end) of each chunk), their parameters, the shared
    (embedding and head) parameters it holds (the first and the last stage do), and the
    bytes of both over all tensor shards."""
    shapes, _ = model.abstract_params()
    stack = jax.tree.leaves(shapes[model.stack_key])
    per_layer = sum(math.prod(x.shape[1:]) for x in stack)
    per_layer_bytes = sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in stack)
    shared = [x for k, v in shapes.items() if k != model.stack_key for x in jax.tree.leaves(v)]
    shared_params = sum(math.prod(x.shape) for x in shared)
    shared_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in shared)
    holders = {lay.stage_of(0), lay.stage_of(lay.last)}
    plan = []
    for s, n in enumerate(lay.stage_layers()):
        holds = s in holders
        plan.append(
            {
                "stage": s,
                "layers": [list(lay.slices[j]) for j in range(s, len(lay.slices), lay.stages)],
                "layer_params": n * per_layer,
                "shared_params": shared_params if holds else 0,
                "param_bytes": n * per_layer_bytes + (shared_bytes if holds else 0),
            }
        )
    return plan
