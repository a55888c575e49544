"""`TrainConfig` (a run's steps, batch, optimizer, precision, schedule, data) and the
block sparsity it may carry (`SparsityConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardemu.config.checks import (
    MAX_STEPS,
    MAX_TOKENS_PER_STEP,
    SEED_LIMIT,
    require_choice,
    require_finite,
    require_positive,
)
from shardemu.config.flags import choices_of, setting
from shardemu.config.model import ModelConfig
from shardemu.config.parallelism import Parallelism
from shardemu.errors import ConfigError

OptimizerName = Literal["adamw", "lamb"]
ScheduleName = Literal["gpipe", "1f1b", "interleaved"]  # parallel/schedules.py
Dataset = Literal["synthetic", "stdlib"]  # data.CORPORA
Precision = Literal["fp32", "bf16", "fp16-mixed", "fp8"]  # numerics/precision.py
SparseMode = Literal["static", "dynamic"]
Regrow = Literal["random", "gradient"]
Distribution = Literal["uniform", "erk"]

BLOCK_SIZES = (1, 4, 8, 16)
DATASETS = choices_of(Dataset)
PRECISIONS = choices_of(Precision)
SCHEDULES = choices_of(ScheduleName)
INTERLEAVED_CHUNKS = 2  # model chunks per stage an interleaved schedule takes by default


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

    The command line's `--sparsity S` makes one (none without it: dense weights).
    """

    sparsity: float = 0.9
    block: int = setting(16, "--block", "square blocks: 1, 4, 8 or 16")
    mode: SparseMode = setting(
        "static", "--sparse-mode", "static pattern, or dynamic prune-and-regrow"
    )
    updates: int = setting(
        160, "--sparse-updates", "dynamic: pattern updates over the run", metavar="N"
    )
    prune_ratio: float = setting(
        0.5, "--prune-ratio", "dynamic: fraction of non-zero blocks pruned at first, cosine-decayed"
    )
    regrow: Regrow = setting("random", "--regrow", "dynamic: which zero blocks regrow")
    distribution: Distribution = setting(
        "uniform",
        "--sparse-distribution",
        "the same density in every kernel, or Erdos-Renyi-Kernel",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.sparsity, int | float) or not 0 <= self.sparsity < 1:
            raise ConfigError(
                f"SparsityConfig.sparsity {self.sparsity} must be in [0, 1): the fraction of "
                f"zero blocks (0.9 keeps 10% of the weights)"
            )
        if self.block not in BLOCK_SIZES:
            raise ConfigError(
                f"SparsityConfig.block {self.block} must be one of "
                f"{', '.join(map(str, BLOCK_SIZES))}"
            )
        require_choice(self, "mode", SparseMode)
        require_choice(self, "regrow", Regrow)
        require_choice(self, "distribution", Distribution)
        require_positive("SparsityConfig", updates=self.updates)
        if not isinstance(self.prune_ratio, int | float) or not 0 < self.prune_ratio <= 1:
            raise ConfigError(f"SparsityConfig.prune_ratio {self.prune_ratio} must be in (0, 1]")

    @property
    def density(self) -> float:
        return 1.0 - self.sparsity


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `batch` is the global batch (sequences per step, all replicas):
    batch = microbatch size * microbatches * replica * grad_accum (the source material's
    b * r, times accumulation steps). `virtual` left None is 2 model chunks per stage
    with the interleaved schedule and 1 otherwise."""

    steps: int = setting(20, "--steps", "training steps")
    batch: int = setting(8, "--batch", "global batch (all replicas)")
    seq: int = setting(64, "--seq", "sequence length")
    seed: int = setting(0, "--seed", "seed of the initial weights, the data and the masks")
    microbatches: int = setting(
        1,
        "--microbatches",
        "microbatches per step, run through the pipeline --schedule over the pipe axis",
    )
    grad_accum: int = setting(
        1, "--grad-accum", "gradient accumulation steps (global batch = b * M * replica * K)"
    )
    optimizer: OptimizerName = setting("adamw", "--optimizer", "AdamW, or LAMB (You et al. 2020)")
    learning_rate: float = setting(3e-3, "--lr", "peak learning rate")
    warmup_steps: int = setting(0, "--warmup", "warm-up steps")
    weight_decay: float = setting(0.01, "--weight-decay", "decoupled weight decay")
    grad_clip: float = setting(1.0, "--grad-clip", "clip the global gradient norm to this")
    schedule: ScheduleName = setting(
        "1f1b", "--schedule", "pipeline schedule over the pipe axis (Narayanan et al. 2021)"
    )
    virtual: int | None = setting(
        None,
        "--virtual",
        "model chunks per stage, interleaved schedule only (default 2)",
        metavar="V",
    )
    microbatch_group: int | None = setting(
        None,
        "--microbatch-group",
        "interleaved schedule: microbatches a model chunk runs before the stage's next chunk, "
        "from pipe to --microbatches (Megatron-Core's --microbatch-group-size-per-virtual-"
        "pipeline-stage; default pipe)",
        metavar="G",
    )
    stage_layers: tuple[int, ...] | None = setting(
        None,
        "--stage-layers",
        "layers of each pipeline stage, e.g. 3,7,7,7 (default: even); plans: resident only",
        metavar="N,N,...",
    )
    # Megatron-Core's flags of these names (`transformer_block.get_transformer_layer_offset`):
    # the layers and the embedding or the loss split evenly over the model chunks, so the
    # first (last) chunk holds one layer fewer; Llama 3 405B's 126 layers and both make
    # 128 chunks, 8 a stage on 16 stages (Dubey et al. 2024, §3.3.2)
    account_for_embedding_in_pipeline_split: bool = setting(
        False,
        "--account-for-embedding-in-pipeline-split",
        "split the layers over pipeline stages and model chunks with the embedding counted "
        "as one: the first chunk holds one layer fewer (Megatron-Core's flag)",
    )
    account_for_loss_in_pipeline_split: bool = setting(
        False,
        "--account-for-loss-in-pipeline-split",
        "the same for the output projection and loss: the last chunk holds one layer fewer",
    )
    sparsity: SparsityConfig | None = None  # block-sparse layer weights (None: dense)
    data: Dataset = setting(
        "synthetic",
        "--data",
        "training text: the synthetic Markov corpus, or the Python standard library's "
        "source as bytes (with a held-out validation split)",
    )
    precision: Precision = setting(
        "fp32",
        "--precision",
        "fp32; or 16-bit weights, activations and gradients with FP32 master weights "
        "and optimizer state: bf16, fp16-mixed (with dynamic loss scaling); fp8: bf16 "
        "with the layers' matmuls on FP8 operands (E4M3 forward, E5M2 gradients, "
        "per-tensor current scaling)",
    )  # numerics/precision.py
    sequence_parallel: bool = setting(
        False,
        "--sequence-parallel",
        "split layer norms and residual adds over tensor by sequence (Korthikanti et "
        "al. 2022): reduce-scatter + all-gather instead of all-reduce, nothing repeated",
    )
    zero: int = setting(
        0,
        "--zero",
        "ZeRO stage (Rajbhandari et al. 2020) over replica: 1 shards the optimizer state "
        "and FP32 master weights, 2 also the gradients (reduce-scatter), 3 also the "
        "weights (FSDP: all-gathered where used); resident runs and plans",
    )

    def __post_init__(self) -> None:
        if isinstance(self.sparsity, dict):  # from config.json
            object.__setattr__(self, "sparsity", SparsityConfig(**self.sparsity))
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        require_choice(self, "schedule", ScheduleName)
        self._resolve_virtual()
        require_positive(
            "TrainConfig",
            steps=self.steps,
            batch=self.batch,
            seq=self.seq,
            microbatches=self.microbatches,
            grad_accum=self.grad_accum,
            virtual=self.virtual,
        )
        require_choice(self, "optimizer", OptimizerName)
        require_finite(
            "TrainConfig", True, learning_rate=self.learning_rate, grad_clip=self.grad_clip
        )
        require_finite("TrainConfig", False, weight_decay=self.weight_decay)
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"TrainConfig.{name} must be an integer >= 0, got {value!r}")
        for name in ("steps", "warmup_steps"):
            if getattr(self, name) > MAX_STEPS:
                raise ConfigError(
                    f"TrainConfig.{name} {getattr(self, name)} is more than the optimizer's "
                    f"int32 step count holds ({MAX_STEPS:,}); use fewer"
                )
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ConfigError(
                f"TrainConfig.zero must be 0, 1, 2 or 3, got {self.zero!r}: the ZeRO stage "
                f"(1 the optimizer state, 2 and the gradients, 3 and the weights)"
            )
        if self.batch * self.seq > MAX_TOKENS_PER_STEP:
            raise ConfigError(
                f"TrainConfig.batch {self.batch} x TrainConfig.seq {self.seq} = "
                f"{self.batch * self.seq:.3g} tokens per step is more than shardemu counts "
                f"(2**40); use a smaller TrainConfig.batch"
            )
        if self.seed >= SEED_LIMIT:
            raise ConfigError(f"TrainConfig.seed {self.seed} is too large; use 0 <= seed < 2**32")
        require_choice(self, "data", Dataset)
        require_choice(self, "precision", Precision)
        self._check_sparsity()

    def _resolve_virtual(self) -> None:
        """None: the schedule's own chunk count. Chunks other than 1, and a microbatch
        group, need interleaving."""
        interleaved = self.schedule == "interleaved"
        if self.virtual is None:
            object.__setattr__(self, "virtual", INTERLEAVED_CHUNKS if interleaved else 1)
        elif not interleaved and self.virtual != 1:
            raise ConfigError(
                f"TrainConfig.virtual {self.virtual} splits stages into chunks, which only "
                f"the interleaved schedule runs; set TrainConfig.schedule interleaved (or "
                f"leave TrainConfig.virtual out)"
            )
        if self.microbatch_group is not None:
            require_positive("TrainConfig", microbatch_group=self.microbatch_group)
            if not interleaved:
                raise ConfigError(
                    f"TrainConfig.microbatch_group {self.microbatch_group} groups the "
                    f"interleaved schedule's microbatches; set TrainConfig.schedule interleaved "
                    f"(or leave TrainConfig.microbatch_group out)"
                )

    def _check_sparsity(self) -> None:
        sparse = self.sparsity
        if sparse is not None and self.precision != "fp32":
            raise ConfigError(
                f"SparsityConfig.sparsity with TrainConfig.precision {self.precision} is not "
                f"supported yet (the masks would have to follow the FP32 master weights); "
                f"use TrainConfig.precision fp32"
            )
        if sparse is not None and sparse.mode == "dynamic" and sparse.updates > self.steps:
            raise ConfigError(
                f"SparsityConfig.updates {sparse.updates} is more than the {self.steps} steps; "
                f"update the pattern at most once a step (SparsityConfig.updates <= "
                f"TrainConfig.steps)"
            )

    def check_fits(self, model: ModelConfig, parallelism: Parallelism) -> None:
        """Refuse settings the model or mesh cannot take, before anything compiles."""
        if self.seq > model.max_positions:
            raise ConfigError(
                f"TrainConfig.seq {self.seq} exceeds {model.name}'s {model.max_positions} "
                f"positions; use TrainConfig.seq <= {model.max_positions}"
            )
        self.check_sequence_split(parallelism.tensor, parallelism.context)
        data = parallelism.data  # replica x expert: the batch is split over both
        if self.batch % data:
            raise ConfigError(
                f"global TrainConfig.batch {self.batch} is not divisible by "
                f"replica * expert = {data}; use a multiple of {data}"
            )
        split = data * self.microbatches * self.grad_accum
        if self.batch % split:
            raise ConfigError(
                f"global TrainConfig.batch {self.batch} is not divisible by replica * expert "
                f"* microbatches * grad_accum = {data} * {self.microbatches} * "
                f"{self.grad_accum} = {split}; use a multiple of {split}"
            )

    def check_sequence_split(self, tensor: int, context: int = 1) -> None:
        """Refuse a `context` size, and sequence parallelism over a `tensor` size (times
        `context`, which splits the sequence too), that does not divide `seq`."""
        if self.seq % context:
            raise ConfigError(
                f"TrainConfig.seq {self.seq} is not divisible by context={context} "
                f"(context parallelism splits every sequence over it); use a multiple of "
                f"{context}"
            )
        if self.sequence_parallel and self.seq % (tensor * context):
            over = f"tensor={tensor}" if context == 1 else f"tensor x context={tensor * context}"
            raise ConfigError(
                f"TrainConfig.sequence_parallel splits the sequence over "
                f"{over}, which does not divide TrainConfig.seq "
                f"{self.seq}; use a TrainConfig.seq that is a multiple of "
                f"{tensor * context}, or leave sequence parallelism off"
            )

    @property
    def tokens(self) -> int:
        """Tokens per step, all replicas."""
        return self.batch * self.seq

    def microbatch_size(self, parallelism: Parallelism) -> int:
        """Sequences per microbatch per replica (the b of b * r)."""
        return self.batch // (parallelism.data * self.microbatches * self.grad_accum)
