"""The layouts a search enumerates (`search.py`): a `Candidate` is one (mesh,
microbatch size, precision, resident or phased settings), and hands itself to the
planner as configs (`train_config`, `phased_config`); a `Space` says which are tried;
`meshes` and the settings generators list them (`rows.py` holds what the search makes
of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.config.checks import require_choice, require_positive
from shardemu.config.flags import choices_of, setting
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap

Mode = Literal["resident", "phased"]
Modes = Literal["auto", "resident", "phased", "both"]
MODES = choices_of(Modes)
# how the attention core runs: as XLA emits it ([s, s] scores in memory) or fused
# (FlashAttention: Dao et al. 2022); `accounting/matmuls.py`, `resident_count.py`
Attention = Literal["materialized", "fused"]
ATTENTION = choices_of(Attention)
# what a resident layer recomputes in its backward: nothing, the attention core
# (Korthikanti et al. 2022), the projections TorchTitan's selective-op policy does not
# save (`activations.selective_op`), or the whole layer
Recompute = Literal["none", "selective", "selective-op", "full"]
RECOMPUTE = choices_of(Recompute)
STATE_BYTES_PER_PARAM = 16  # weights + gradients + two Adam moments (+ FP32 masters in 16-bit)
INTERLEAVED_CHUNKS = 2
# phased activation policies by the device memory they need, least first: `offload`
# sends each phase's input to the host, `recompute` keeps it, `keep` keeps everything
LEAST_MEMORY = ("offload", "recompute", "keep")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout: a mesh, a microbatch size, a precision and how the step runs."""

    pipe: int
    tensor: int
    replica: int
    microbatch_size: int
    precision: str
    mode: Mode = "resident"
    context: int = 1  # each sequence split over it (`context_parallel.py`)
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "full"  # resident
    zero: int = 0  # resident: the ZeRO stage over replica
    # resident: the embedding and the loss counted as a layer each in the pipeline split
    # (`layout.Split`), where the layers alone do not divide the model chunks
    ends_in_split: bool = False
    rts: int = 1  # phased
    activations: str = "recompute"  # phased
    optimizer_on: str = "host"  # phased
    prefetch: bool = True  # phased

    @property
    def par(self) -> Parallelism:
        return Parallelism(
            pipe=self.pipe, tensor=self.tensor, replica=self.replica, context=self.context
        )

    @property
    def label(self) -> str:
        mesh = f"p{self.pipe} t{self.tensor} r{self.replica}"
        mesh += f" c{self.context}" if self.context > 1 else ""
        mesh += f" b{self.microbatch_size}"
        if self.mode == "resident":
            sched = self.schedule if self.virtual == 1 else f"{self.schedule}x{self.virtual}"
            how = f"{sched} recompute={self.recompute}"
            how += f" zero={self.zero}" if self.zero else ""
            how += " ends-in-split" if self.ends_in_split else ""
        else:
            how = f"phased rts={self.rts} {self.activations} optimizer={self.optimizer_on}"
            how += "" if self.prefetch else " no-prefetch"
        return f"{mesh} {self.precision} {how}"

    def train_config(self, batch: int, seq: int) -> TrainConfig:
        """The training settings of `batch` sequences of `seq` tokens in this layout."""
        return TrainConfig(
            batch=batch,
            seq=seq,
            precision=self.precision,
            schedule=self.schedule,
            virtual=self.virtual,
            zero=self.zero,
            account_for_embedding_in_pipeline_split=self.ends_in_split,
            account_for_loss_in_pipeline_split=self.ends_in_split,
        )

    def phased_config(self, device_memory: int | None) -> PhasedConfig | None:
        """A phased layout's settings against `device_memory` (the planner picks the
        fewest phases that fit); None for a resident layout."""
        if self.mode == "resident":
            return None
        return PhasedConfig(
            device_memory=device_memory,
            rts=self.rts,
            activations=self.activations,
            optimizer_on=self.optimizer_on,  # type: ignore[arg-type]
            prefetch=self.prefetch,
        )

    def settings(self) -> dict[str, Any]:
        """The fields that apply to this candidate's mode."""
        out = dataclasses.asdict(self)
        drop = (
            ("rts", "activations", "optimizer_on", "prefetch")
            if self.mode == "resident"
            else ("schedule", "virtual", "recompute", "zero")
        )
        return {k: v for k, v in out.items() if k not in drop}


@dataclasses.dataclass(frozen=True)
class Space:
    """What the search enumerates (see the module docstring)."""

    precisions: tuple[str, ...]
    modes: Modes = setting(
        "auto",
        "--modes",
        "resident, phased, both, or auto: phased only when no resident layout fits",
    )
    max_tensor: int = setting(8, "--max-tensor", "largest tensor axis")
    max_microbatch: int = setting(8, "--max-microbatch", "largest microbatch size")
    overlap: Overlap = DEFAULT_OVERLAP  # not searched: how the training system overlaps
    # the ZeRO stages resident layouts over several replicas are searched at (`zero.py`)
    zero_stages: tuple[int, ...] = (0,)
    # the context sizes layouts are searched at (`context_parallel.py`): each splits
    # every sequence, and so the devices, that many ways more
    context_sizes: tuple[int, ...] = (1,)
    sequence_parallel: bool = setting(
        False,
        "--sequence-parallel",
        "resident layouts with sequence parallelism (Korthikanti et al. 2022), which "
        "--tp-overlap chunked needs",
    )
    # resident layouts' attention core (plan_resident); `shardemu plan` takes it too
    attention: Attention = setting(
        "materialized",
        "--attention",
        "resident plans: the attention core as XLA emits it, its [s, s] scores in "
        "memory, or fused (FlashAttention) without them",
    )

    def __post_init__(self) -> None:
        require_choice(self, "modes", Modes)
        require_choice(self, "attention", Attention)
        require_positive("Space", max_tensor=self.max_tensor, max_microbatch=self.max_microbatch)
        if self.overlap.tp_overlap == "chunked" and not self.sequence_parallel:
            raise ConfigError(
                "Overlap.tp_overlap chunked hides sequence-parallel layers' collectives; "
                "search with Space.sequence_parallel, or Overlap.tp_overlap none"
            )
        if self.sequence_parallel and self.max_tensor == 1:
            raise ConfigError(
                "Space.sequence_parallel splits over tensor, and Space.max_tensor 1 leaves "
                "every layout tensor=1: it would change nothing; leave one of them out"
            )
        if not self.context_sizes or any(c < 1 for c in self.context_sizes):
            raise ConfigError(
                f"Space.context_sizes must be a non-empty list of positive integers, got "
                f"{list(self.context_sizes)!r}"
            )
        if not self.zero_stages or any(s not in (0, 1, 2, 3) for s in self.zero_stages):
            raise ConfigError(
                f"Space.zero_stages must be a non-empty list of 0, 1, 2 and 3 (ZeRO stages), "
                f"got {list(self.zero_stages)!r}"
            )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(
    model_cfg: ModelConfig,
    devices: int,
    batch: int,
    max_tensor: int,
    contexts: tuple[int, ...] = (1,),
    seq: int | None = None,
) -> list[Parallelism]:
    """Every pipe x tensor x replica (x context, of `contexts`) = `devices` the model and
    batch (and a sequence of `seq` tokens, which each context size must divide) can
    take, in `mesh_order`."""
    if devices < 1 or max_tensor < 1:
        raise ConfigError(
            f"`devices` and Space.max_tensor must be positive integers, got {devices}, {max_tensor}"
        )
    out = []
    for t in _divisors(devices):
        if t > max_tensor or model_cfg.num_heads % t or model_cfg.mlp_dim % t:
            continue
        for c in sorted(set(contexts)):
            if (devices // t) % c or (seq is not None and seq % c):
                continue
            for p in _divisors(devices // (t * c)):
                r = devices // (p * t * c)
                if splits(model_cfg.num_layers, p) is not None and batch % r == 0:
                    out.append(Parallelism(pipe=p, tensor=t, replica=r, context=c))
    if not out:
        raise ConfigError(
            f"no mesh of {devices} devices fits {model_cfg.name} ({model_cfg.num_layers} "
            f"layers, {model_cfg.num_heads} heads) with TrainConfig.batch {batch}: pipe must "
            f"divide the layers (or the layers and two, the embedding and the loss counted in "
            f"the split), tensor the heads (at most Space.max_tensor {max_tensor}), replica "
            f"the batch"
        )
    return sorted(out, key=mesh_order)


def mesh_order(par: Parallelism) -> tuple[int, int, int]:
    """The order meshes are listed in (`meshes`, a search's rows): by tensor, context,
    then pipe size."""
    return par.tensor, par.context, par.pipe


def resident_settings(
    par: Parallelism, layers: int, zero_stages: tuple[int, ...] = (0,), attention: str = ""
) -> Iterator[dict[str, Any]]:
    """Each resident setting of `par`: schedule, recomputation (TorchTitan's selective-op
    too where the attention core is fused, the only attention it saves) and ZeRO stage."""
    recomputes = ["none", "selective"] + (["selective-op"] if attention == "fused" else [])
    schedules = [("1f1b", 1, splits(layers, par.pipe))]
    if par.pipe > 1:
        schedules.append(
            ("interleaved", INTERLEAVED_CHUNKS, splits(layers, par.pipe * INTERLEAVED_CHUNKS))
        )
    stages = sorted(set(zero_stages)) if par.replica > 1 else [0]  # one replica: no ZeRO
    for schedule, virtual, ends in schedules:
        if ends is None:
            continue
        for recompute in [*recomputes, "full"]:
            for stage in stages:
                yield {
                    "mode": "resident",
                    "schedule": schedule,
                    "virtual": virtual,
                    "recompute": recompute,
                    "zero": stage,
                    "ends_in_split": ends,
                }


def splits(layers: int, chunks: int) -> bool | None:
    """How `layers` split evenly into `chunks` model chunks: alone (False), with the
    embedding and the loss counted as a layer each (True: Megatron-Core's
    `account_for_*_in_pipeline_split`, Llama 3 405B's 126 layers in 128 chunks), or not
    at all (None). A search tries the second only where the first fails."""
    if layers % chunks == 0:
        return False
    if chunks > 1 and (layers + 2) % chunks == 0:
        return True
    return None


def phased_settings(par: Parallelism, layers: int) -> Iterator[dict[str, Any]]:
    """Each phased setting of `par`; none where the stages cannot run equal phases of
    `layers` (a mesh the resident layouts reach by the split of `splits`)."""
    if layers % par.pipe:
        return
    for rts in sorted({1, par.replica}):
        for activations in LEAST_MEMORY:
            for optimizer_on in ("host", "device"):
                for prefetch in (False, True):
                    yield {
                        "mode": "phased",
                        "rts": rts,
                        "activations": activations,
                        "optimizer_on": optimizer_on,
                        "prefetch": prefetch,
                    }


def memory_ranks(c: Candidate) -> tuple[int, ...]:
    """Where a phased candidate stands in each setting's order of device memory, least
    first: offloaded activations leave the device, recomputed ones keep each phase's
    input, kept ones everything; an optimizer on the device streams its state in; a
    prefetch holds the next phase's weights beside this one's. (rts has no such order:
    a sharded phase still gathers its whole weights, beside its shard.)"""
    return (
        LEAST_MEMORY.index(c.activations),
        c.optimizer_on != "host",
        c.prefetch,
    )
