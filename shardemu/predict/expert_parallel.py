"""Expert parallelism in a resident plan (`Parallelism.expert` > 1).

The microbatch is counted with the experts whole on its tensor group
(`resident_count.py`); expert parallelism then changes three things, each from the
model's shapes (GShard, Lepikhin et al. 2020, Section 3.2; Megatron-Core's expert
parallel groups, which sit inside the data-parallel ones):

- memory: each device holds 1/ep of a layer's experts (their weights, gradients and
  optimizer state), and the rest of the layer whole;
- communication: each layer's dispatched tokens [b, E, C, d] go to their experts and
  come back, an all-to-all over `expert` each way, forward and backward (and once more
  each way when full recomputation re-runs the forward): each device sends (ep - 1)/ep
  of its b E C d elements (`collectives.py`'s ring count), as a real run's ledger
  records them (tests/test_moe.py holds the two to each other);
- gradients: the experts' reduce over `replica` only, the rest over replica x expert
  (`plan_resident.py`). The compute per device is unchanged: it processes its tokens'
  experts, wherever they live.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from shardemu.accounting.ledger import Event, Phase
from shardemu.parallel.rules import is_logical_axes, resolve_specs, shard_shape
from shardemu.predict.resident_count import BACKWARD, FORWARD, CountKey, Microbatch
from shardemu.stages.specs import stage_rules


def expert_share(key: CountKey) -> float:
    """The fraction of a layer's per-device parameters (on the count's tensor group)
    that are its experts': those named with the `experts` axis."""
    shapes, logical = key.model.abstract_params()
    stack = key.model.stack_key
    sizes = {"pipe": 1, "replica": 1, "rts": 1, "expert": 1, "tensor": key.tensor}
    specs = resolve_specs(shapes[stack], logical[stack], stage_rules(key.rules), sizes)
    total = experts = 0
    flat = zip(
        jax.tree.leaves(shapes[stack]),
        jax.tree.leaves(logical[stack], is_leaf=is_logical_axes),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        strict=True,
    )
    for leaf, axes, spec in flat:
        elements = math.prod(shard_shape(leaf.shape, spec, sizes))
        total += elements
        experts += elements if "experts" in axes else 0
    return experts / total


def exchanges(key: CountKey, experts: int, recompute: str) -> tuple[Event, Event]:
    """One layer's all-to-alls over `expert` for one microbatch, forward and backward,
    on the count's tensor group (`devices` = tensor): dispatch and combine forward,
    their transposes backward (and dispatch and combine again with full
    recomputation, which re-runs the forward)."""
    cfg = key.model.cfg
    slots = cfg.num_experts * cfg.capacity(key.seq)
    buffer = key.microbatch_size * slots * cfg.embed_dim * jnp.dtype(cfg.param_dtype).itemsize
    sent = buffer * (experts - 1) / experts * key.tensor  # every tensor device sends

    def event(phase: Phase, times: int) -> Event:
        return Event(
            0, phase, "collective", "activations", bytes=round(times * sent), axis="expert",
            devices=key.tensor, op="all-to-all", group=experts,
        )  # fmt: skip

    return event(FORWARD, 2), event(BACKWARD, 4 if recompute == "full" else 2)


def expert_parallel(mb: Microbatch, key: CountKey, experts: int, recompute: str) -> Microbatch:
    """`mb` as a device of `experts` expert-parallel groups runs it (module docstring):
    its layer's experts and their optimizer state split, its all-to-alls added after
    each layer's forward and backward."""
    if experts == 1 or not key.model.cfg.num_experts:
        return mb
    share = expert_share(key)
    kept = 1 - share + share / experts
    forward, backward = exchanges(key, experts, recompute)
    pieces = dict(mb.pieces)
    if pieces:  # a memory bound has none
        pieces["forward"] = [*pieces["forward"], forward]
        pieces["backward"] = [*pieces["backward"], backward]
    return dataclasses.replace(
        mb,
        pieces=pieces,
        layer_bytes=round(mb.layer_bytes * kept),
        opt_bytes=(round(mb.opt_bytes[0] * kept), mb.opt_bytes[1]),
        expert_bytes=round(mb.layer_bytes * share / experts),
    )
