"""`TrainConfig` (a run's steps, batch, optimizer, precision, schedule, data) and the
block sparsity it may carry (`SparsityConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardemu.config.checks import MAX_TOKENS_PER_STEP, SEED_LIMIT, require_finite, require_positive
from shardemu.config.model import ModelConfig
from shardemu.config.parallelism import Parallelism
from shardemu.errors import ConfigError

OptimizerName = Literal["adamw", "lamb"]

BLOCK_SIZES = (1, 4, 8, 16)
DATASETS = ("synthetic", "stdlib")  # data.CORPORA
PRECISIONS = ("fp32", "bf16", "fp16-mixed")  # numerics/precision.py


@dataclass(frozen=True)
class SparsityConfig:
    """Block sparsity of the layers' dense weights (MISSION.md, "Dynamic sparse
    pre-training of BERT"; Dietrich et al. 2021, RigL: Evci et al. 2020).

    sparsity       fraction of each sparse weight's blocks that are zero, in [0, 1)
    block          square blocks of 1, 4, 8 or 16 weights on a side
    mode           `static` keeps the initial random pattern; `dynamic` prunes and
                   regrows blocks `updates` times over the run
    updates        pattern updates over the run (dynamic), every steps // updates steps
    prune_ratio    the fraction of non-zero blocks pruned at the first update, decayed
                   by a cosine to 0 at the last step
    regrow         which zero blocks come back: `random`, or the largest `gradient` norm
    distribution   `uniform`: every weight at `sparsity`; `erk`: Erdos-Renyi-Kernel
                   densities (Evci et al. 2020, section 3), the same total
    """

    sparsity: float = 0.9
    block: int = 16
    mode: Literal["static", "dynamic"] = "static"
    updates: int = 160
    prune_ratio: float = 0.5
    regrow: Literal["random", "gradient"] = "random"
    distribution: Literal["uniform", "erk"] = "uniform"

    def __post_init__(self) -> None:
        if not isinstance(self.sparsity, int | float) or not 0 <= self.sparsity < 1:
            raise ConfigError(
                f"--sparsity {self.sparsity} must be in [0, 1): the fraction of zero blocks "
                f"(0.9 keeps 10% of the weights)"
            )
        if self.block not in BLOCK_SIZES:
            raise ConfigError(
                f"--block {self.block} must be one of {', '.join(map(str, BLOCK_SIZES))}"
            )
        choices = {"mode": ("static", "dynamic"), "regrow": ("random", "gradient"),
                   "distribution": ("uniform", "erk")}  # fmt: skip
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(
                    f"sparse {name} must be one of {', '.join(allowed)}, got {value!r}"
                )
        require_positive("SparsityConfig", updates=self.updates)
        if not isinstance(self.prune_ratio, int | float) or not 0 < self.prune_ratio <= 1:
            raise ConfigError(f"--prune-ratio {self.prune_ratio} must be in (0, 1]")

    @property
    def density(self) -> float:
        return 1.0 - self.sparsity


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `batch` is the global batch (sequences per step, all replicas):
    batch = microbatch size * microbatches * replica * grad_accum (the source material's
    b * r, times accumulation steps)."""

    steps: int = 20
    batch: int = 8
    seq: int = 64
    seed: int = 0
    microbatches: int = 1
    grad_accum: int = 1
    optimizer: OptimizerName = "adamw"
    learning_rate: float = 3e-3
    warmup_steps: int = 0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    schedule: str = "1f1b"  # the pipeline schedule, by name (parallel/schedules.py)
    virtual: int = 1  # model chunks per pipeline stage (interleaved 1F1B)
    stage_layers: tuple[int, ...] | None = None  # layers per stage (None: even)
    sparsity: SparsityConfig | None = None  # block-sparse layer weights (None: dense)
    data: str = "synthetic"  # the training text: `synthetic` or `stdlib` (data.py)
    # `fp32`, or 16-bit weights, activations and gradients with FP32 master weights and
    # optimizer state: `bf16`, `fp16-mixed` (loss-scaled) (numerics/precision.py)
    precision: str = "fp32"
    # split the residual stream over `tensor` by sequence (Korthikanti et al. 2022)
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sparsity, dict):  # from config.json
            object.__setattr__(self, "sparsity", SparsityConfig(**self.sparsity))
        require_positive(
            "TrainConfig",
            steps=self.steps,
            batch=self.batch,
            seq=self.seq,
            microbatches=self.microbatches,
            grad_accum=self.grad_accum,
            virtual=self.virtual,
        )
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        if self.optimizer not in ("adamw", "lamb"):
            raise ConfigError(f"optimizer must be 'adamw' or 'lamb', got {self.optimizer!r}")
        require_finite(
            "TrainConfig", True, learning_rate=self.learning_rate, grad_clip=self.grad_clip
        )
        require_finite("TrainConfig", False, weight_decay=self.weight_decay)
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"TrainConfig.{name} must be an integer >= 0, got {value!r}")
        if self.batch * self.seq > MAX_TOKENS_PER_STEP:
            raise ConfigError(
                f"--batch {self.batch} x --seq {self.seq} = {self.batch * self.seq:.3g} tokens "
                f"per step is more than shardemu counts (2**40); use a smaller --batch"
            )
        if self.seed >= SEED_LIMIT:
            raise ConfigError(f"--seed {self.seed} is too large; use 0 <= seed < 2**32")
        if self.data not in DATASETS:
            raise ConfigError(f"--data {self.data!r} is not one of {', '.join(DATASETS)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}"
            )
        sparse = self.sparsity
        if sparse is not None and self.precision != "fp32":
            raise ConfigError(
                f"--sparsity with --precision {self.precision} is not supported yet (the "
                f"masks would have to follow the FP32 master weights); use --precision fp32"
            )
        if sparse is not None and sparse.mode == "dynamic" and sparse.updates > self.steps:
            raise ConfigError(
                f"--sparse-updates {sparse.updates} is more than the {self.steps} steps; "
                f"update the pattern at most once a step (--sparse-updates <= --steps)"
            )

    def check_fits(self, model: ModelConfig, parallelism: Parallelism) -> None:
        """Refuse settings the model or mesh cannot take, before anything compiles."""
        if self.seq > model.max_positions:
            raise ConfigError(
                f"--seq {self.seq} exceeds {model.name}'s {model.max_positions} positions; "
                f"use --seq <= {model.max_positions}"
            )
        if self.sequence_parallel and self.seq % parallelism.tensor:
            raise ConfigError(
                f"--sequence-parallel splits the sequence over tensor={parallelism.tensor}, "
                f"which does not divide --seq {self.seq}; use a --seq that is a multiple of "
                f"{parallelism.tensor}, or leave sequence parallelism off"
            )
        if self.batch % parallelism.replica:
            raise ConfigError(
                f"global --batch {self.batch} is not divisible by replica={parallelism.replica}; "
                f"use a multiple of {parallelism.replica}"
            )
        split = parallelism.replica * self.microbatches * self.grad_accum
        if self.batch % split:
            raise ConfigError(
                f"global --batch {self.batch} is not divisible by replica * microbatches * "
                f"grad_accum = {parallelism.replica} * {self.microbatches} * {self.grad_accum}"
                f" = {split}; use a multiple of {split}"
            )

    @property
    def tokens(self) -> int:
        """Tokens per step, all replicas."""
        return self.batch * self.seq

    def microbatch_size(self, parallelism: Parallelism) -> int:
        """Sequences per microbatch per replica (the b of b * r)."""
        return self.batch // (parallelism.replica * self.microbatches * self.grad_accum)
