"""Activation memory per layer as a GPU or TPU stack keeps it, tensor by tensor.

A layer's backward pass needs some of its forward's tensors. `saved_tensors` lists them
for a transformer layer, each with its elements, bytes per element and whether tensor
parallelism splits it, following Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Section 4.1, Figure 3: a Megatron-LM GPT
layer): the two layer norms' inputs, the QKV matmul's input, Q and K for the scores, the
softmax's output (and with dropout its mask and output), V, the output projection's
input, the MLP's input, its activation's input and the second matmul's input (and with
dropout the two residual dropout masks). Under tensor parallelism (Section 4.2.1) the
layer norms' and the column-parallel matmuls' inputs (and the residual dropout masks)
are whole on every device and the rest split; sequence parallelism (4.2.2) splits those
too. Selective recomputation (Section 5) keeps everything but the attention core's
s x s tensors, which it recomputes; full recomputation keeps the layer's input.

A gated MLP (SwiGLU: Llama) keeps the gate's and the up projection's outputs and their
product; grouped-query attention keeps K and V at the key/value heads' width, split
over `tensor` where it divides the heads and whole on every tensor device where the
rules replicate them (`parallel.rules.megatron_rules`), sequence parallelism or not. Rotary
embeddings add nothing to keep (their backward is the same rotation). A mixture of
experts (`models/moe.py`) keeps its router's FP32 probabilities, the tokens dispatched
to each expert's E x C slots, the experts' gated MLP tensors over those slots, and the
experts' outputs (the combine's backward weighs them by the gates).

With FP8 matmuls (`--precision fp8`, `models/fp8.py`) the inputs of the projections
are kept as their FP8 casts, one byte an element, as Transformer Engine keeps them for
the backward (the QKV, output projection, MLP and second matmul inputs: 7 sbh bytes a
GPT layer less); the attention core, the layer norms and the activation stay 16-bit.

TorchTitan's "selective op" checkpointing (`recompute="selective-op"`; pytorch/torchtitan,
`torchtitan/models/llama3/parallelize.py`, `_save_list`) keeps instead the layer's input
(the checkpoint's), the fused attention core's output and its log-sum-exp, and the
outputs of every other projection matmul in the order its layer runs them (Q, K, V,
output; then gate, up, down, or the MLP's two), recomputing the rest: `selective_op`.

This is the second witness beside the CPU compile's count (`resident_count.py`, which
keeps what XLA's CPU fusions keep: 2.9x this for GPT-3 1.3B at tensor 4): the analytic
sum equals Korthikanti's closed forms (Table 2) exactly for their layer, and a resident
plan reports both (`activation_bytes_per_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from shardemu.errors import ConfigError
from shardemu.models import Model

MASK_BYTES = 1  # a dropout mask is one byte an element (Korthikanti et al., Section 4.1)


@dataclass(frozen=True)
class Saved:
    """One tensor a layer keeps for its backward: `elements` of `itemsize` bytes, split
    over the tensor axis or whole on every tensor device (`split`), whether sequence
    parallelism splits it where tensor parallelism does not (`by_sequence`: not the
    replicated key/value heads, computed whole on every device), and whether it is the
    attention core's s x s (what selective recomputation drops)."""

    name: str
    elements: int
    itemsize: int
    split: bool
    core: bool = False
    by_sequence: bool = True

    def bytes_per_device(self, tensor: int, sequence_parallel: bool) -> float:
        whole = self.elements * self.itemsize
        return whole / tensor if self.split or sequence_parallel and self.by_sequence else whole


def saved_tensors(
    model: Model,
    batch: int,
    seq: int,
    itemsize: int,
    dropout: bool = False,
    kv_split: bool = True,
    context: int = 1,
) -> list[Saved]:
    """What one layer of `model` keeps for its backward on `batch` sequences of `seq`
    tokens, its activations of `itemsize` bytes, its key/value heads split over tensor
    or replicated (`kv_split`) (module docstring). Under context parallelism each
    device holds its s / `context` tokens' tensors, the keys and values of all s
    (all-gathered before attention, and kept: Dubey et al. 2024, Section 3.3.2; the CPU
    compile keeps them too) and its queries' [s / c, s] scores."""
    cfg = model.cfg
    local = seq // context
    sbh, sbf = local * batch * cfg.embed_dim, local * batch * cfg.mlp_dim
    kv = seq * batch * cfg.kv_heads * cfg.head_dim
    scores = cfg.num_heads * local * seq * batch
    p = itemsize
    q = 1 if cfg.fp8_matmuls else itemsize  # a projection's input, kept as its FP8 cast
    out = [
        Saved("layer norm 1 input", sbh, p, split=False),
        Saved("QKV input", sbh, q, split=False),
        Saved("Q", sbh, p, split=True),
        Saved("K", kv, p, split=kv_split, by_sequence=kv_split),
        Saved("softmax output", scores, p, split=True, core=True),
        Saved("V", kv, p, split=kv_split, by_sequence=kv_split),
        Saved("projection input", sbh, q, split=True),
        Saved("layer norm 2 input", sbh, p, split=False),
        Saved("MLP input", sbh, q, split=False),
    ]
    if cfg.num_experts:  # a mixture of experts: the MLP runs on E x C slots a sequence
        slots = batch * cfg.num_experts * cfg.capacity(local)
        out += [
            Saved("router probabilities", seq * batch * cfg.num_experts, 4, split=False),
            Saved("dispatched tokens", slots * cfg.embed_dim, q, split=False),
            Saved("gate output", slots * cfg.mlp_dim, p, split=True),
            Saved("up output", slots * cfg.mlp_dim, p, split=True),
            Saved("down input", slots * cfg.mlp_dim, q, split=True),
            Saved("expert outputs", slots * cfg.embed_dim, p, split=False),
        ]
    elif model.family.gated_mlp:
        out += [
            Saved("gate output", sbf, p, split=True),
            Saved("up output", sbf, p, split=True),
            Saved("down input", sbf, q, split=True),
        ]
    else:
        out += [
            Saved("activation input", sbf, p, split=True),
            Saved("second matmul input", sbf, q, split=True),
        ]
    if dropout:
        out += [
            Saved("attention dropout mask", scores, MASK_BYTES, split=True, core=True),
            Saved("attention dropout output", scores, p, split=True, core=True),
            Saved("projection dropout mask", sbh, MASK_BYTES, split=False),
            Saved("MLP dropout mask", sbh, MASK_BYTES, split=False),
        ]
    return out


def layer_bytes(
    model: Model,
    batch: int,
    seq: int,
    itemsize: int,
    tensor: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dropout: bool = False,
    fused_attention: bool = False,
    kv_split: bool = True,
    context: int = 1,
) -> float:
    """Bytes per device one layer keeps for its backward (`saved_tensors`), with
    `recompute` none, selective (the attention core's s x s tensors recomputed) or full
    (the layer's input alone). With `fused_attention` (FlashAttention: Dao et al. 2022,
    Section 3.1) the core keeps no s x s tensor, only each query row's softmax
    statistic (its log-sum-exp, float32). `kv_split`: the key/value heads split over
    tensor (else replicated: `saved_tensors`); `context`: each sequence split over it
    (`saved_tensors`)."""
    local = seq // context
    if recompute == "full":
        whole = local * batch * model.cfg.embed_dim * itemsize
        return whole / tensor if sequence_parallel else whole
    if recompute == "selective-op":
        return selective_op(model, batch, local, itemsize, tensor, sequence_parallel, kv_split)
    drop_core = recompute == "selective" or fused_attention
    kept = sum(
        t.bytes_per_device(tensor, sequence_parallel)
        for t in saved_tensors(model, batch, seq, itemsize, dropout, kv_split, context)
        if not (drop_core and t.core)
    )
    if fused_attention and recompute != "selective":
        kept += batch * model.cfg.num_heads * local * 4 / tensor
    return kept


class Projection(NamedTuple):
    """A projection matmul of a layer: [tokens, `inputs`] x [`inputs`, `outputs`], its
    output split over tensor (`split`) or whole on every tensor device."""

    name: str
    inputs: int
    outputs: int
    split: bool


def projections(model: Model, kv_split: bool = True) -> list[Projection]:
    """A layer's projection matmuls in the order TorchTitan's layers run them (separate
    Q, K and V; SwiGLU's gate, then up, then down). Column-parallel outputs are split
    over tensor; the output and down projections' row-parallel outputs are whole
    (partial sums) until reduced."""
    cfg = model.cfg
    d, f, q, kv = (
        cfg.embed_dim,
        cfg.mlp_dim,
        cfg.num_heads * cfg.head_dim,
        cfg.kv_heads * cfg.head_dim,
    )
    attention = [Projection("Q", d, q, True), Projection("K", d, kv, kv_split),
                 Projection("V", d, kv, kv_split), Projection("output", q, d, False)]  # fmt: skip
    if model.family.gated_mlp:
        mlp = [Projection("gate", d, f, True), Projection("up", d, f, True)]
    else:
        mlp = [Projection("MLP in", d, f, True)]
    return [*attention, *mlp, Projection("down", f, d, False)]


def selective_op_sets(
    model: Model, kv_split: bool = True
) -> list[tuple[list[Projection], list[Projection]]]:
    """TorchTitan's selective-op checkpointing of one layer: the projections it saves
    and those it recomputes, (saved, recomputed), in each step. Its policy saves an
    `mm`'s output when the running count of the layer's matmuls is odd, so with an odd
    number of projections (Llama's 7) the two sets swap from step to step (Q, V, gate,
    down saved; then K, output, up); with an even number (GPT's 6) one pair serves."""
    if model.cfg.num_experts:
        raise ConfigError(
            "recompute='selective-op' is TorchTitan's policy for dense layers; a mixture of "
            "experts plans recompute none, selective or full"
        )
    ops = projections(model, kv_split)
    return [(ops[p::2], ops[1 - p :: 2]) for p in ((0, 1) if len(ops) % 2 else (0,))]


def selective_op(
    model: Model,
    batch: int,
    local: int,
    itemsize: int,
    tensor: int = 1,
    sequence_parallel: bool = False,
    kv_split: bool = True,
) -> float:
    """The bytes per device TorchTitan's selective-op checkpointing keeps of one layer
    on `batch` sequences of `local` tokens a device, at most: the fuller of its saved
    sets (`selective_op_sets`), the layer's input, and the fused attention core's
    output (saved as SDPA's) with its float32 log-sum-exp."""
    cfg = model.cfg
    tokens = batch * local

    def per_device(width: int, split: bool) -> float:
        whole = tokens * width * itemsize
        return whole / tensor if split or sequence_parallel else whole

    always = per_device(cfg.embed_dim, False) + per_device(cfg.num_heads * cfg.head_dim, True)
    always += batch * cfg.num_heads * local * 4 / tensor  # the log-sum-exp, float32
    return always + max(
        sum(per_device(o.outputs, o.split) for o in saved)
        for saved, _ in selective_op_sets(model, kv_split)
    )


def loss_bytes(
    model: Model, batch: int, seq: int, itemsize: int, tensor: int = 1, context: int = 1
) -> float:
    """The output head and loss's working set per device at their peak, on `batch`
    sequences of `seq` tokens: the logits of every position with a loss (`head_matmuls`)
    in the activations' dtype, their FP32 copy, the FP32 log-softmax the backward keeps
    and its FP32 gradient. Ours (`causal_lm.loss_sums`) and TorchTitan's loss
    (`.float()` before `cross_entropy`) both compute in FP32; the vocabulary is split
    over tensor (Megatron-LM's vocab-parallel cross entropy) and the positions over
    context. A transient: the last stage holds it once, at its head."""
    positions, _, vocab = model.family.head_matmuls(model.cfg, batch, seq)["logits"]
    per_entry = itemsize + (0 if itemsize == 4 else 4) + 4 + 4
    return positions / context * vocab / tensor * per_entry


def korthikanti(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    tensor: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Korthikanti et al. 2022, Table 2: bytes per layer and device of a GPT layer with
    16-bit activations and dropout, d_ff = 4h: sbh (10 + 24/t + 5as/(ht)) with tensor
    parallelism, sbh (34/t + 5as/(ht)) with sequence parallelism too, the 5as/(ht) term
    dropped by selective recomputation, 2sbh with full recomputation."""
    sbh, t = seq * batch * hidden, tensor
    core = 5 * heads * seq / (hidden * t)
    if recompute == "full":
        return 2 * sbh
    rest = 34 / t if sequence_parallel else 10 + 24 / t
    return sbh * (rest + (0 if recompute == "selective" else core))
