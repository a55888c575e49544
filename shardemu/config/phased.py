"""`PhasedConfig`: phased execution's settings (`shardemu/phased/`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardemu.config.checks import require_choice, require_positive
from shardemu.config.flags import setting
from shardemu.config.parallelism import Parallelism
from shardemu.errors import ConfigError

ActivationPolicy = Literal["keep", "offload", "recompute", "keep-activations"]
OptimizerPlace = Literal["host", "device"]


@dataclass(frozen=True)
class PhasedConfig:
    """Phased execution (MISSION.md, "Phased execution"; `shardemu/phased/`).

    phases         phases of layers, or None: the fewest that fit `device_memory`
                   (all layers, one a phase, when that is None too)
    device_memory  device-tier capacity in bytes per device (None: unbounded)
    rts            replicated tensor sharding: each replica stores 1/rts of every weight
                   and a phase all-gathers the rest over `replica` before it runs
    rts_optimizer  rts' for the optimizer state: 1, rts, or the replica size
                   (None: the same as rts)
    activations    what a phase's backward gets from its forward (None: the mode's own,
                   `keep-activations` with weight streaming, else `recompute`):
                   `recompute` keeps the phase's input on device and recomputes the
                   rest; `offload` sends that input to the host tier and back; `keep`
                   keeps everything the backward
                   needs (the weights it used included) on device, so nothing is
                   recomputed and weights come in once
    optimizer_on   `host`: the update runs in the host tier where the state lives (the
                   MemoryX arrangement); `device`: weights, state and gradients stream
                   in, the update runs on the device, weights and state stream out
    prefetch       request the next phase's weights before this phase runs (hidden
                   behind its compute), or only when they are needed
    weight_streaming  train as a Cerebras weight-streaming cluster (MISSION.md, "Weight
                   streaming"): `replica` is the N systems (tensor and pipe are 1), one
                   layer a phase, each layer's weights broadcast to every system over
                   SwarmX, each system's gradients leaving on their own and summed on
                   the way to the host tier (SwarmX's reduce) rather than all-reduced
                   between devices, the update in the host tier (MemoryX). Activations:
                   `keep-activations` (this mode's own: the forward's activations stay
                   on the device, its weights do not, so they stream in again for the
                   backward, as on a CS-2) or `recompute`
    """

    phases: int | None = setting(
        None,
        "--phases",
        "phases (default: the fewest that fit --device-memory, else one per layer)",
    )
    device_memory: int | None = setting(
        None, "--device-memory", "device tier capacity", metavar="BYTES"
    )
    rts: int = setting(1, "--rts", "replicated tensor sharding over replica")
    rts_optimizer: int | None = setting(
        None,
        "--rts-optimizer",
        "rts' for optimizer state: 1, --rts, or the replica size (default: --rts)",
        metavar="R2",
    )
    activations: ActivationPolicy | None = setting(
        None,
        "--activations",
        "what a phase's backward gets from its forward (default: recompute; with "
        "--weight-streaming, keep-activations)",
    )
    optimizer_on: OptimizerPlace = setting(
        "host", "--optimizer-on", "where the update runs (host: the MemoryX arrangement)"
    )
    prefetch: bool = setting(
        True,
        "--no-prefetch",
        "fetch a phase's weights only when it runs (default: one phase ahead)",
        negated=True,
    )
    weight_streaming: bool = setting(
        False,
        "--weight-streaming",
        "train as a Cerebras weight-streaming cluster: phased, one layer a phase, "
        "weights broadcast to --systems over SwarmX, gradients reduced into MemoryX",
    )

    def __post_init__(self) -> None:
        if self.activations is None:  # the mode's own policy
            policy = "keep-activations" if self.weight_streaming else "recompute"
            object.__setattr__(self, "activations", policy)
        if self.phases is not None:
            require_positive("PhasedConfig", phases=self.phases)
        require_positive("PhasedConfig", rts=self.rts)
        if self.rts_optimizer is not None:
            require_positive("PhasedConfig", rts_optimizer=self.rts_optimizer)
        if self.device_memory is not None:
            require_positive("PhasedConfig", device_memory=self.device_memory)
        require_choice(self, "activations", ActivationPolicy)
        require_choice(self, "optimizer_on", OptimizerPlace)
        if self.weight_streaming:
            self._check_weight_streaming()
        elif self.activations == "keep-activations":
            raise ConfigError(
                "PhasedConfig.activations keep-activations is weight streaming's policy "
                "(activations kept per system, weights streamed again); set "
                "PhasedConfig.weight_streaming, or use keep"
            )

    def _check_weight_streaming(self) -> None:
        """What a weight-streaming cluster fixes: one layer a phase, whole weights on
        every system, the update in MemoryX, activations kept or recomputed per system."""
        fixed = [
            (self.phases is not None, f"PhasedConfig.phases {self.phases} (one layer a phase)"),
            (self.rts != 1, f"PhasedConfig.rts {self.rts} (every system receives whole weights)"),
            (
                self.rts_opt != 1,
                f"PhasedConfig.rts_optimizer {self.rts_opt} (the state lives in MemoryX)",
            ),
            (
                self.optimizer_on != "host",
                "PhasedConfig.optimizer_on device (the update runs in MemoryX)",
            ),
            (
                self.activations not in ("keep-activations", "recompute"),
                f"PhasedConfig.activations {self.activations} (use keep-activations or recompute)",
            ),
        ]
        bad = [text for wrong, text in fixed if wrong]
        if bad:
            raise ConfigError(f"PhasedConfig.weight_streaming does not take {'; '.join(bad)}")

    @property
    def rts_opt(self) -> int:
        return self.rts if self.rts_optimizer is None else self.rts_optimizer

    def check_mesh(self, parallelism: Parallelism) -> None:
        r = parallelism.replica
        if self.weight_streaming and parallelism.num_devices != r:  # replicas alone
            raise ConfigError(
                f"PhasedConfig.weight_streaming trains on N systems (the replica axis); tensor, "
                f"pipe, context and expert must be 1, got mesh {parallelism}"
            )
        if r % self.rts:
            raise ConfigError(
                f"PhasedConfig.rts {self.rts} does not divide replica={r}; use a divisor of {r}"
            )
        if self.rts_opt not in (1, self.rts, r):
            raise ConfigError(
                f"PhasedConfig.rts_optimizer {self.rts_opt} must be 1, PhasedConfig.rts "
                f"({self.rts}) or the replica size ({r})"
            )
