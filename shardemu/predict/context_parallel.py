"""Context parallelism in a resident plan (`Parallelism.context` > 1).

The microbatch is counted on a stage's `context` x `tensor` devices
(`resident_count.py`), each sequence split over `context` and each layer's keys and
values all-gathered over it before attention (Llama 3's all-gather context parallelism:
Dubey et al. 2024, "The Llama 3 Herd of Models", Section 3.3.2); so each device's
compute, the keys' and values' all-gathers forward and their gradients'
reduce-scatters backward, and what a layer keeps for its backward (its s / c tokens'
tensors, and the gathered keys and values) are counted as the CPU compiles them.

One thing is not as a GPU job runs it: the counted program sums each microbatch's
weight gradients over `context` inside its backward (the weights are replicated over
it), where Megatron-LM accumulates them over the microbatches and reduces them once a
step over the data- and context-parallel group together (Megatron-Core's
`get_data_parallel_group(with_context_parallel=True)`, as Llama 3 does). So those
all-reduces leave the pieces (`per_step_reductions`) and the step's gradient reduction
spans `replica` x `context` (`resident_step._StepEvents.all_reduce`). A sum over
`context` x `tensor` (a sequence-parallel layer norm's weight gradient) keeps its part
over `tensor`, which the non-context plan keeps every microbatch too. The loss's scalar
sums over `context` go with them (a few bytes).

Causal load balance (each rank two chunks, Megatron-LM's and Llama 3's layout) needs no
change to what is counted: XLA computes each rank's whole [s / c, s] score block, masked,
so every rank has the same work, as the balanced layout gives a kernel that skips masked
blocks.
"""

from __future__ import annotations

import dataclasses

from shardemu.accounting.ledger import Event
from shardemu.predict.resident_count import Microbatch

CONTEXT = "context"
# the pieces whose counted programs reduce weight gradients over `context`
_REDUCING = ("backward", "head", "embed-backward")


def per_step_reductions(mb: Microbatch, context: int, tensor: int) -> Microbatch:
    """`mb`'s pieces without their per-microbatch gradient all-reduces over `context`
    (the step reduces them over `replica` x `context`: module docstring); an all-reduce
    over `context` x `tensor` becomes its part over `tensor` alone."""
    if context == 1 or not mb.pieces:
        return mb
    pieces = dict(mb.pieces)
    for name in _REDUCING:
        pieces[name] = [kept for e in pieces[name] for kept in _tensor_part(e, context, tensor)]
    return dataclasses.replace(mb, pieces=pieces)


def _tensor_part(e: Event, context: int, tensor: int) -> list[Event]:
    """`e`, or none of it where it is an all-reduce over `context`, or its part over
    `tensor` where it is one over `context` x `tensor`: the ring sends 2 (n - 1) / n of
    the buffer (Thakur et al. 2005), n = t instead of c t."""
    axes = set((e.axis or "").split("+"))
    if e.kind != "collective" or e.op != "all-reduce" or CONTEXT not in axes:
        return [e]
    if axes != {CONTEXT, "tensor"} or tensor == 1:
        return []
    n = context * tensor
    share = ((tensor - 1) / tensor) / ((n - 1) / n)
    return [dataclasses.replace(e, bytes=round(e.bytes * share), axis="tensor", group=tensor)]
