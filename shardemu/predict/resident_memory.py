"""A resident layout before anything is counted: its stages and schedule
(`resident_layout`), and the device bytes of its fullest stage (`device_bytes`:
weights, gradients, optimizer state and the activations its schedule keeps in flight),
also as a lower bound with nothing compiled (`device_bytes_at_least`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from shardemu.config import ConfigError, Parallelism
from shardemu.models import Model
from shardemu.parallel.rules import Rules
from shardemu.parallel.schedules import Schedule, make_schedule
from shardemu.pipelined.layout import EVEN, PipelineLayout, Split, counted_hint, pipeline_layout
from shardemu.predict.activations import layer_bytes, loss_bytes
from shardemu.predict.layouts import ATTENTION, RECOMPUTE, Recompute
from shardemu.predict.memory_bound import memory_bound
from shardemu.predict.overlap import MAX_BUCKETS
from shardemu.predict.resident_count import CountKey, Microbatch, count_key, selective_keep
from shardemu.predict.zero import zero


@dataclass(frozen=True)
class Kept:
    """What one layer keeps for its backward, per device and microbatch: as the CPU
    compile counts it (`counted`: XLA's CPU fusions keep intermediates a GPU or TPU
    kernel does not) and as the target keeps it (`target`: `activations.layer_bytes`,
    tensor by tensor): the memory a plan holds. The CPU compile has no witness of
    TorchTitan's selective-op policy, which saves matmul outputs by their order (None)."""

    counted: float | None
    target: float

    def to_json(self) -> dict[str, float | None]:
        return {"counted": self.counted, "target": self.target}


def kept(mb: Microbatch, key: CountKey, recompute: str) -> Kept:
    """`Kept` of a layout's layers (`key`), with `recompute` none, selective,
    selective-op or full, its attention core materialized or fused (FlashAttention: no
    s x s tensors kept)."""
    counted = None if recompute == "selective-op" else mb.keep_bytes
    if recompute == "selective":
        counted = selective_keep(mb, key).keep_bytes
    model = key.model
    itemsize = jnp.dtype(model.cfg.param_dtype).itemsize
    rules = dict(key.rules)
    sequence_parallel = bool(rules.get("residual_sequence"))
    # grouped key/value heads follow their own rule (replicated where tensor does not
    # divide them); other families' keys and values are split with the heads
    kv_split = not model.family.grouped_query or bool(rules.get("kv_heads"))
    target = layer_bytes(
        model, key.microbatch_size, key.seq, itemsize, key.tensor, sequence_parallel,
        recompute, fused_attention=key.fused_attention, kv_split=kv_split,
        context=key.context,
    )  # fmt: skip
    return Kept(counted, target)


def _stage_bytes(
    mb: Microbatch,
    layers: int,
    shared: bool,
    microbatches: int,
    held: float,
    model: Model,
    keep: float,
    loss: float = 0.0,
    reduce_itemsize: int | None = None,
) -> int:
    """Device bytes per device of a stage of `layers` layers (and the shared weights
    where it holds them): weights, gradients and optimizer state, what its layers
    keep (`keep` a layer) for the `held` microbatches in flight at its peak
    (`Schedule.peak_activations`), and on the last stage the head and loss's working
    set (`loss`: `activations.loss_bytes`), held on top of them at the head; under
    ZeRO stage 3, the larger of that and a layer's reduce-scatter (`_reduce_scatter`),
    held on top of them in the backward less what that layer kept. Gradients
    are the weights' dtype, summed over microbatches in FP32 (`numerics/precision.py`).
    Under ZeRO (`zero.py`) stage 2, a replica's share of them, but for an accumulation
    buffer, reduce-scattered once full (as the resident engine and Megatron-LM's
    distributed optimizer do); stage 3 splits the layers' weights too, and their
    gradients, reduce-scattered every microbatch (FSDP), and holds two layers gathered
    whole (the one computing, the one prefetched:
    `resident_step._StepEvents.gathered`). It splits the shared weights (embedding,
    head) too, as the resident engine and PyTorch FSDP (TorchTitan wraps them) do: a
    replica's share of them and of their gradients held, and beside them, whole, the
    part the stage's head reads (on the last stage, whose peak `loss` marks; the
    embedding's on the first) and its gradient before its reduce-scatter
    (`Microbatch.reads`, `resident_step._StepEvents.shared_gather`)."""
    weights = mb.layer_bytes * layers + (mb.shared_bytes if shared else 0)
    optimizer = mb.opt_bytes[0] * layers + (mb.opt_bytes[1] if shared else 0)
    itemsize = jnp.dtype(model.cfg.param_dtype).itemsize
    grads = weights if microbatches == 1 else weights * 4 // itemsize
    if mb.zero_stage >= 2 and microbatches == 1:
        grads = round(grads / mb.zero)
    scatter = 0.0
    if mb.zero_stage == 3 and mb.zero > 1 and layers:
        split = 1 - 1 / mb.zero  # of the layers' weights, and of their accumulated gradients
        if microbatches > 1:
            grads -= round(mb.layer_bytes * layers * 4 // itemsize * split)
        per_part = -(-layers // min(layers, MAX_BUCKETS))  # layers gathered at a time
        weights += 2 * mb.layer_bytes * per_part - round(mb.layer_bytes * layers * split)
        # a layer's reduce-scatter comes after its backward, which freed what it kept
        scatter = _reduce_scatter(mb, reduce_itemsize) - keep
    if mb.zero_stage == 3 and mb.zero > 1 and shared:
        share = round(mb.shared_bytes / mb.zero)
        # gathered whole: what the head reads (the last stage, `loss`), or the embedding
        used = mb.reads[1] if loss else mb.reads[0]
        weights += share + used - mb.shared_bytes
        # of the gradients: a share (FP32 when accumulated: counted whole above), and
        # the whole one written there before its reduce-scatter
        if microbatches > 1:
            grads -= (mb.shared_bytes - share) * 4 // itemsize
        grads += used
    return weights + grads + optimizer + round(held * layers * keep + max(loss, scatter))


def _reduce_scatter(mb: Microbatch, reduce_itemsize: int | None) -> int:
    """Bytes per device that a layer's gradient reduce-scatter adds under ZeRO stage 3
    (FSDP) to the two layers held gathered
    (`_stage_bytes`). PyTorch FSDP2 (torch/distributed/fsdp/_fully_shard/,
    `FSDPParamGroup.post_backward` and `foreach_reduce`): at the end of a layer's
    backward its whole gradient (the weights' dtype) exists beside both gathered
    layers; then it frees that layer's gathered weights ("reshard"), releases the
    previous layer's reduce-scatter input, and allocates this one's, a whole layer in
    the reduction's dtype (`reduce_itemsize` bytes an element, 4 under
    `Overlap.grad_reduce_in_fp32`; None: the gradients' own), before it frees the
    gradient ("only after the copy-in finishes can we free the gradients"). So the
    most it adds is the gradient and what the input holds beyond one layer's weights.
    The loss's working set is freed by then: a stage holds the larger of the two."""
    width = reduce_itemsize or mb.weight_itemsize
    reduce_input = mb.layer_bytes * width // mb.weight_itemsize
    return mb.layer_bytes + max(0, reduce_input - mb.layer_bytes)


def resident_layout(
    model: Model,
    par: Parallelism,
    batch: int,
    seq: int,
    microbatch_size: int,
    schedule: str,
    virtual: int,
    recompute: str,
    precision: str,
    attention: str,
    split: Split,
    rules: Rules | None = None,
    group: int | None = None,
) -> tuple[PipelineLayout, Schedule, CountKey]:
    """A resident layout's layers per stage, its schedule (the interleaved one's
    microbatches in groups of `group`) and the count it uses; a `ConfigError` for a
    setting it cannot take."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"`recompute` must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "selective-op" and attention != "fused":
        raise ConfigError(
            f"`recompute` 'selective-op' saves the fused attention core's output (TorchTitan's "
            f"policy over SDPA), but `attention` is {attention!r}: plan it with `attention` "
            f"'fused'"
        )
    if attention not in ATTENTION:
        raise ConfigError(
            f"Space.attention must be one of {', '.join(ATTENTION)}, got {attention!r}"
        )
    key = count_key(model, par, microbatch_size, seq, recompute, precision, attention, rules)
    per_step = par.data * microbatch_size
    if batch % per_step:
        raise ConfigError(
            f"TrainConfig.batch {batch} is not divisible by replica * expert * "
            f"`microbatch_size` = {per_step}"
        )
    p, v, L = par.pipe, virtual, key.model.cfg.num_layers
    if split == EVEN and L % (p * v):
        raise ConfigError(
            f"{L} layers do not split into pipe * virtual = {p * v} equal chunks"
            f"{counted_hint(L, p * v)}"
        )
    lay = pipeline_layout(L, p, v, split)
    return lay, make_schedule(schedule, p, batch // per_step, v, group), key


def device_bytes(
    mb: Microbatch,
    key: CountKey,
    recompute: str,
    par: Parallelism,
    lay: PipelineLayout,
    sched: Schedule,
    reduce_itemsize: int | None = None,
) -> int:
    """Device bytes per device of the layout's fullest stage (`_stage_bytes`), its
    layers keeping what the target keeps (`kept`); `reduce_itemsize`: the bytes of an
    element the data-parallel reductions carry (None: the gradients' own)."""
    keep = kept(mb, key, recompute).target
    itemsize = jnp.dtype(key.model.cfg.param_dtype).itemsize
    loss = loss_bytes(key.model, key.microbatch_size, key.seq, itemsize, key.tensor, key.context)
    return max(
        _stage_bytes(
            mb,
            n,
            s in (0, par.pipe - 1),
            sched.microbatches,
            sched.peak_activations(s),
            key.model,
            keep,
            loss if s == par.pipe - 1 else 0.0,
            reduce_itemsize,
        )  # fmt: skip
        for s, n in enumerate(lay.stage_layers())
    )


def device_bytes_at_least(
    model: Model,
    par: Parallelism,
    batch: int,
    seq: int,
    microbatch_size: int,
    schedule: str = "1f1b",
    virtual: int = 1,
    recompute: Recompute = "full",
    precision: str = "fp32",
    attention: str = "materialized",
    rules: Rules | None = None,
    zero_stage: int = 0,
    split: Split = EVEN,
) -> int:
    """At most the device bytes per device `plan_resident` finds for this layout (under
    ZeRO stage `zero_stage`, its layers split by `split`), with nothing compiled
    (`memory_bound`): a search counts no microbatch that none of its layouts could fit."""
    lay, sched, key = resident_layout(
        model,
        par,
        batch,
        seq,
        microbatch_size,
        schedule,
        virtual,
        recompute,
        precision,
        attention,
        split,
        rules,
    )
    bound = zero(memory_bound(key), zero_stage, par)
    return device_bytes(bound, key, recompute, par, lay, sched)
