"""`Parallelism`: the mesh a model is laid out on."""

from __future__ import annotations

from dataclasses import dataclass

from shardemu.config.checks import require_positive
from shardemu.errors import ConfigError


@dataclass(frozen=True)
class Parallelism:
    """How a model is decomposed (MISSION.md, IPU-POD section): `pipe` pipeline stages,
    `tensor` shards, `replica` data-parallel replicas. Devices used = pipe*tensor*replica."""

    pipe: int = 1
    tensor: int = 1
    replica: int = 1

    def __post_init__(self) -> None:
        require_positive("Parallelism", pipe=self.pipe, tensor=self.tensor, replica=self.replica)

    @property
    def num_devices(self) -> int:
        return self.pipe * self.tensor * self.replica

    def axis_sizes(self) -> dict[str, int]:
        return {"pipe": self.pipe, "tensor": self.tensor, "replica": self.replica}

    @classmethod
    def parse(cls, text: str) -> Parallelism:
        """Parse `pipe=P,tensor=T,replica=R` (any subset; missing axes are 1)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("pipe", "tensor", "replica"):
                raise ConfigError(
                    f"bad mesh item {part!r} in {text!r}; expected pipe=P,tensor=T,replica=R"
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
        return f"pipe={self.pipe},tensor={self.tensor},replica={self.replica}"
