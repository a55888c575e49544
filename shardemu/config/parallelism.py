"""`Parallelism`: the mesh a model is laid out on."""

from __future__ import annotations

from dataclasses import dataclass

from shardemu.config.checks import require_positive
from shardemu.errors import ConfigError


@dataclass(frozen=True)
class Parallelism:
    """How a model is decomposed (MISSION.md, IPU-POD section): `pipe` pipeline stages,
    `tensor` shards, `replica` data-parallel replicas, and `expert` expert-parallel
    groups: a mixture of experts' experts split over them, and the batch too, as
    data parallelism (GShard, Lepikhin et al. 2020, Section 3.2; DeepSpeed-MoE and
    Megatron-Core carve expert parallelism out of data parallelism alike), and
    `context` context-parallel groups: each sequence split over them (`parallel/rules.py`).
    Devices used = pipe*tensor*replica*expert*context."""

    pipe: int = 1
    tensor: int = 1
    replica: int = 1
    expert: int = 1
    context: int = 1

    def __post_init__(self) -> None:
        require_positive(
            "Parallelism", pipe=self.pipe, tensor=self.tensor, replica=self.replica,
            expert=self.expert, context=self.context,
        )  # fmt: skip

    @property
    def num_devices(self) -> int:
        return self.pipe * self.tensor * self.replica * self.expert * self.context

    @property
    def data(self) -> int:
        """The ways the batch is split: replica x expert."""
        return self.replica * self.expert

    def axis_sizes(self) -> dict[str, int]:
        return {
            "pipe": self.pipe, "tensor": self.tensor, "replica": self.replica,
            "expert": self.expert, "context": self.context,
        }  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> Parallelism:
        """Parse `pipe=P,tensor=T,replica=R,expert=E,context=C` (any subset; missing axes
        are 1)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in cls.__dataclass_fields__:  # the axes: pipe, tensor, ...
                raise ConfigError(
                    f"bad mesh item {part!r} in {text!r}; expected "
                    f"pipe=P,tensor=T,replica=R[,expert=E][,context=C]"
                )
            if key in sizes:
                raise ConfigError(f"mesh axis {key!r} given twice in {text!r}")
            try:
                sizes[key] = int(value)
            except ValueError:
                raise ConfigError(
                    f"mesh axis {key!r} needs an integer size, got {value!r} in {text!r}"
                ) from None
        return cls(**sizes)

    def __str__(self) -> str:
        text = f"pipe={self.pipe},tensor={self.tensor},replica={self.replica}"
        text += f",expert={self.expert}" if self.expert > 1 else ""
        return text + (f",context={self.context}" if self.context > 1 else "")
