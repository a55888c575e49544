"""Configuration dataclasses, validated on construction.

Everything a run depends on is one of these frozen dataclasses, so a run directory can
record it whole (`dataclasses.asdict`) and two runs can be compared field by field.

Model presets live with their families (`models/gpt.py`, `models/bert.py`), each
with its sources; `ModelConfig.family` names a registered family (`models/family.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from shardemu.errors import ConfigError

OptimizerName = Literal["adamw", "lamb"]


def require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


def _require_finite(owner: str, positive: bool, **values: float) -> None:
    """Each value a finite real number, > 0 or >= 0 (NaN fails every comparison, so
    it is tested for apart)."""
    for name, value in values.items():
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise ConfigError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


SEED_LIMIT = 2**32  # numpy.random.default_rng and jax.random.key take seeds below this
# Tokens per step beyond which shapes stop being countable: activations are tokens x width
# elements, and XLA's dimension arithmetic is int64 (2**40 tokens x 2**17 width < 2**63).
MAX_TOKENS_PER_STEP = 2**40
# BERT masks 15% of a sequence's tokens for prediction (Devlin et al. 2019, Section 3.1)
MASKED_LM_PROB = 0.15


@dataclass(frozen=True)
class ModelConfig:
    """Transformer dimensions. Symbols: L layers, d embed, A heads, d_ff mlp, V vocab."""

    name: str
    family: str  # a registered family (models/family.py), checked when a Model is built
    vocab_size: int
    num_layers: int
    embed_dim: int
    num_heads: int
    mlp_dim: int
    max_positions: int
    type_vocab_size: int = 2  # BERT segment types; unused by GPT
    layer_norm_eps: float = 1e-5
    gelu_approximate: bool = True  # GPT-2 uses the tanh form; BERT the exact erf form
    init_std: float = 0.02
    param_dtype: str = "float32"
    # BERT: positions per sequence its masked-LM head predicts (`predictions`); 0: 15%
    max_predictions: int = 0

    def __post_init__(self) -> None:
        require_positive(
            "ModelConfig",
            vocab_size=self.vocab_size,
            num_layers=self.num_layers,
            embed_dim=self.embed_dim,
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            max_positions=self.max_positions,
            type_vocab_size=self.type_vocab_size,
        )
        _require_finite(
            "ModelConfig", True, layer_norm_eps=self.layer_norm_eps, init_std=self.init_std
        )
        if not isinstance(self.max_predictions, int) or self.max_predictions < 0:
            raise ConfigError(
                f"ModelConfig.max_predictions must be a whole number of positions (0 for "
                f"15% of the sequence), got {self.max_predictions!r}"
            )
        if self.embed_dim % self.num_heads:
            raise ConfigError(
                f"ModelConfig.embed_dim={self.embed_dim} is not divisible by "
                f"num_heads={self.num_heads}; pick heads that divide the embedding width"
            )
        if self.param_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"ModelConfig.param_dtype must be float32, bfloat16 or float16, "
                f"got {self.param_dtype!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def predictions(self, seq: int) -> int:
        """How many positions of a sequence of `seq` tokens BERT's masked-LM head
        predicts: `max_predictions`, or the ceiling of 15% of them, at most `seq`. The
        reference pre-training data gathers `max_predictions_per_seq` positions a
        sequence (Google's create_pretraining_data.py: 20 at s = 128 and 80 at 512, as
        NVIDIA's BERT also uses; Graphcore's MLPerf BERT 76 at 512)."""
        return min(seq, self.max_predictions or math.ceil(MASKED_LM_PROB * seq))

    def pad_vocab(self, multiple: int) -> ModelConfig:
        """Round the vocabulary up to a multiple, as Megatron-LM's
        `--make-vocab-size-divisible-by` does, so a vocab-parallel embedding divides."""
        require_positive("pad_vocab", multiple=multiple)
        if multiple > self.vocab_size:
            raise ConfigError(
                f"--pad-vocab {multiple} is larger than {self.name}'s vocabulary of "
                f"{self.vocab_size}; pad to a multiple such as 128 (times --mesh tensor)"
            )
        padded = -(-self.vocab_size // multiple) * multiple
        return self.replace(vocab_size=padded)


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
        _require_finite(
            "TrainConfig", True, learning_rate=self.learning_rate, grad_clip=self.grad_clip
        )
        _require_finite("TrainConfig", False, weight_decay=self.weight_decay)
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
    activations    what a phase's backward gets from its forward: `recompute` keeps the
                   phase's input on device and recomputes the rest; `offload` sends that
                   input to the host tier and back; `keep` keeps everything the backward
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

    phases: int | None = None
    device_memory: int | None = None
    rts: int = 1
    rts_optimizer: int | None = None
    activations: ActivationPolicy = "recompute"
    optimizer_on: OptimizerPlace = "host"
    prefetch: bool = True
    weight_streaming: bool = False

    def __post_init__(self) -> None:
        if self.phases is not None:
            require_positive("PhasedConfig", phases=self.phases)
        require_positive("PhasedConfig", rts=self.rts)
        if self.rts_optimizer is not None:
            require_positive("PhasedConfig", rts_optimizer=self.rts_optimizer)
        if self.device_memory is not None and self.device_memory < 1:
            raise ConfigError(f"--device-memory must be positive, got {self.device_memory}")
        if self.activations not in ("keep", "offload", "recompute", "keep-activations"):
            raise ConfigError(
                f"--activations must be keep, offload, recompute or keep-activations, got "
                f"{self.activations!r}"
            )
        if self.optimizer_on not in ("host", "device"):
            raise ConfigError(f"--optimizer-on must be host or device, got {self.optimizer_on!r}")
        if self.weight_streaming:
            self._check_weight_streaming()
        elif self.activations == "keep-activations":
            raise ConfigError(
                "--activations keep-activations is weight streaming's policy (activations "
                "kept per system, weights streamed again); add --weight-streaming, or use keep"
            )

    def _check_weight_streaming(self) -> None:
        """What a weight-streaming cluster fixes: one layer a phase, whole weights on
        every system, the update in MemoryX, activations kept or recomputed per system."""
        fixed = [
            (self.phases is not None, f"--phases {self.phases} (one layer a phase)"),
            (self.rts != 1, f"--rts {self.rts} (every system receives whole weights)"),
            (self.rts_opt != 1, f"--rts-optimizer {self.rts_opt} (the state lives in MemoryX)"),
            (self.optimizer_on != "host", "--optimizer-on device (the update runs in MemoryX)"),
            (
                self.activations not in ("keep-activations", "recompute"),
                f"--activations {self.activations} (use keep-activations or recompute)",
            ),
        ]
        bad = [text for wrong, text in fixed if wrong]
        if bad:
            raise ConfigError(f"--weight-streaming does not take {'; '.join(bad)}")

    @property
    def rts_opt(self) -> int:
        return self.rts if self.rts_optimizer is None else self.rts_optimizer

    def check_mesh(self, parallelism: Parallelism) -> None:
        r = parallelism.replica
        if self.weight_streaming and (parallelism.tensor, parallelism.pipe) != (1, 1):
            raise ConfigError(
                f"--weight-streaming trains on --systems N (the replica axis); tensor and "
                f"pipe must be 1, got mesh {parallelism}"
            )
        if r % self.rts:
            raise ConfigError(f"--rts {self.rts} does not divide replica={r}; use a divisor of {r}")
        if self.rts_opt not in (1, self.rts, r):
            raise ConfigError(
                f"--rts-optimizer {self.rts_opt} must be 1, --rts ({self.rts}) or the replica "
                f"size ({r})"
            )
