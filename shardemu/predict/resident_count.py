"""One resident microbatch counted, not guessed: on one pipeline stage's tensor devices
(replica = 1; with context parallelism its context x tensor devices), the stage pieces
(`stages/stage.py`) are compiled over shapes and counted (`accounting/count.py`): the
embedding, one layer's forward (keeping its vjp residuals, or only its input with
`recompute="full"`) and backward, the head and loss, the embedding's backward, and the
optimizer updates on the device (FP8's weight casts apart: `weight_casts.py`).
`memory_bound` finds a layout's least bytes by tracing
alone (`memory_bound.py`); `plan_resident.py` assembles a step from these.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardemu.accounting import flops
from shardemu.accounting.attention_core import AttentionShape
from shardemu.accounting.cached_casts import CachedWeights
from shardemu.accounting.count import PROCESS_COUNTER, Counter, with_shardings
from shardemu.accounting.ledger import Event, Ledger, Matmul, Phase
from shardemu.accounting.matmuls import compute_itemsize, squeezed
from shardemu.accounting.sizes import bytes_per_device, copies
from shardemu.config import Parallelism, PhasedConfig, TrainConfig
from shardemu.models import Model
from shardemu.numerics.precision import compute_model
from shardemu.parallel.mesh import mesh_from
from shardemu.parallel.rules import Rules, rules_or_default
from shardemu.phased.program import EMBED, EMBED_BWD, HEAD, recompute_flops
from shardemu.predict.activations import selective_op_sets
from shardemu.predict.plan_phased import padded_for
from shardemu.predict.weight_casts import LAYER_PIECES, WeightCasts, counted_casts
from shardemu.stages.executor import Executor
from shardemu.stages.pieces import Piece
from shardemu.stages.specs import AXIS_LABELS, stage_meshes, stage_rules
from shardemu.stages.stage import build_stages
from shardemu.stages.tiers import Tier

FORWARD, BACKWARD = Phase("forward", 0, (0, 1)), Phase("backward", 0, (0, 1))


@dataclasses.dataclass
class Microbatch:
    """One microbatch's work on one stage's tensor group, counted: events per piece
    (`embed`, `forward` and `backward` of one layer, `head`, `embed-backward`, `update`
    of one layer and of the shared weights), and the bytes per device of one layer's
    weights, of the shared weights, of what one layer keeps for its backward, of the
    optimizer state of one layer and of the shared weights (FP32 master weights
    included under mixed precision), and of a layer's input (what a pipeline stage
    sends the next, held by `act_copies` of its devices each: `sizes.copies`). Under
    expert parallelism (`expert_parallel.py`) `expert_bytes` is the part of
    `layer_bytes` that is a layer's experts, whose gradients reduce over `replica`
    alone. With ZeRO over `zero` replicas (`predict/zero.py`) the optimizer
    state is 1/zero of it a device, and the updated weights are all-gathered; with
    `zero_stage` 2 the gradients are reduce-scattered and 1/zero of them held.
    `reads`: the bytes per device of the shared weights the embedding and the head
    each read (FSDP gathers those: `resident_step._StepEvents.shared_gather`).
    `weight_itemsize`: the bytes of one of the weights' elements, and so of their
    gradients' (`Overlap.grad_reduce_in_fp32` reduces these in 4)."""

    pieces: dict[str, list[Event]]
    layer_bytes: int
    shared_bytes: int
    keep_bytes: int
    opt_bytes: tuple[int, int]
    act_bytes: int
    act_copies: int = 1
    expert_bytes: int = 0
    reads: tuple[int, int] = (0, 0)
    zero: int = 1
    zero_stage: int = 0
    casts: WeightCasts = WeightCasts()  # FP8's, left out of `pieces` (`weight_casts.py`)
    weight_itemsize: int = 4


def count_microbatch(
    model: Model,
    tensor: int,
    microbatch_size: int,
    seq: int,
    full_recompute: bool,
    counter: Counter | None = None,
    precision: str = "fp32",
    fused_attention: bool = False,
    rules: Rules | None = None,
    context: int = 1,
) -> Microbatch:
    """Count one microbatch's pieces on `context` x `tensor` JAX devices (no weights
    allocated; each sequence split over `context`: `context_parallel.py`), in
    `precision` (`model` is then the model that computes in it: `compute_model`), its
    parameters and activations sharded by `rules` (Megatron-LM's by default). With
    `fused_attention`, its kernels and kept bytes are FlashAttention's: no [s, s]
    scores in memory (`accounting/matmuls.py`)."""
    built, st, shared, layer, batch, settings = one_stage(
        model, tensor, microbatch_size, seq, precision, rules, context
    )
    counter = PROCESS_COUNTER if counter is None else counter  # an empty Counter is falsy

    def executor(ledger: Ledger, counting: bool) -> Executor:
        tiers = [Tier("device", None)]
        return Executor(
            ledger,
            tiers,
            AXIS_LABELS,
            False,
            counter,
            context=settings,
            fused_attention=fused_attention,
            counting=counting,
        )

    scores = (microbatch_size, model.cfg.num_heads // tensor, seq // context, seq)
    walk = (st, built, shared, layer, batch, full_recompute, scores if fused_attention else None)
    # the pieces listed first (shapes alone) and compiled two at a time (`count_all`:
    # XLA compiles without Python's lock), then counted from those compiles
    listing = executor(Ledger(), counting=False)
    _walk(listing, *walk)
    counter.count_all(listing.pieces)
    ledger = Ledger()
    keep, opt_bytes, x = _walk(executor(ledger, counting=True), *walk)
    pieces: dict[str, list[Event]] = {}
    for e in ledger.events:
        key = str(e.phase) if e.phase.kind == "update" else e.phase.kind
        pieces.setdefault(key, []).append(e)
    layer_bytes, shared_bytes = bytes_per_device(layer), bytes_per_device(shared)
    reads = shared_reads(st, shared, batch)
    casts = counted_casts(counter, listing.pieces, full_recompute)  # FP8's weights'
    return Microbatch(
        pieces, layer_bytes, shared_bytes, keep, tuple(opt_bytes), bytes_per_device(x),
        copies(x), reads=reads, casts=casts, weight_itemsize=compute_itemsize(layer),
    )  # fmt: skip


def shared_reads(st: Any, shared: Any, batch: Any) -> tuple[int, int]:
    """Bytes per device of the shared weights that the embedding and the head (with its
    loss) each read, from their traced programs (JAX's trace of a jitted piece is
    cached: the count's own): the tree holds both, and a model that does not tie them
    reads a part in each (Llama: the token embedding, the output projection and final
    norm)."""
    embed = st.fn(Piece.EMBED).trace(shared, batch)
    x, _ = embed.out_info
    return _reads(embed, shared), _reads(st.fn(Piece.HEAD).trace(shared, x, batch), shared)


def _reads(traced: Any, weights: Any) -> int:
    """Bytes per device of the leaves of `weights`, the traced program's first input,
    that it reads."""
    jaxpr = traced.jaxpr.jaxpr
    read = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    leaves = jax.tree.leaves(weights)
    return sum(
        bytes_per_device(x) for x, v in zip(leaves, jaxpr.invars, strict=False) if id(v) in read
    )


def _walk(
    ex: Executor,
    st: Any,
    built: Any,
    shared: Any,
    layer: Any,
    batch: Any,
    full_recompute: bool,
    scores: tuple[int, ...] | None,
) -> tuple[int, list[int], Any]:
    """One microbatch's pieces through `ex`, in order: (bytes a layer keeps for its
    backward, the optimizer state's bytes of a layer and of the shared weights, a
    layer's input). `scores`: the shard shape of a layer's attention probabilities,
    which fused attention does not keep."""
    x, mask = ex.run(EMBED, Piece.EMBED, st, (shared, batch))
    if full_recompute:
        y, keep = ex.run(FORWARD, Piece.FWD, st, (layer, x, mask)), bytes_per_device(x)
    else:
        y, vjp = ex.run(FORWARD, Piece.FWD_KEEP, st, (layer, x, mask))
        keep = bytes_per_device(vjp) - (_bytes_of_shape(vjp, scores) if scores else 0)
    _, (g_head, g_x) = ex.run(HEAD, Piece.HEAD, st, (shared, y, batch))
    if full_recompute:
        count = (layer, x, mask)
        g_w, _ = ex.run(
            BACKWARD,
            Piece.BWD,
            st,
            (*count, g_x),
            recompute=recompute_flops(ex, st, count, g_x),
        )
    else:
        g_w, _ = ex.run(BACKWARD, Piece.BWD_KEEP, st, (vjp, g_x))
    ex.run(BACKWARD, Piece.SQ_NORM, st, (g_w,))
    g_embed = ex.run(EMBED_BWD, Piece.EMBED_BWD, st, (shared, batch, g_x))
    ex.run(EMBED_BWD, Piece.ADD_SHARED, st, (g_embed, g_head))
    norm = jax.ShapeDtypeStruct((), np.float32, sharding=st.replicated)
    opt_bytes = []
    for part, phase, weights, opt_sh, tx in (
        ("layers", Phase("update", 0), layer, st.layer_opt, built.tx_layers),
        ("shared", Phase("update"), shared, st.shared_opt, built.tx_shared),
    ):
        opt = optimizer_state(tx, weights, opt_sh)
        opt_bytes.append(bytes_per_device(opt))
        name = Piece.update(part, "device")
        ex.run(phase, name, st, (weights, opt, weights, norm), carries="optimizer_state")
    return keep, opt_bytes, x


def one_stage(
    model: Model,
    tensor: int,
    microbatch_size: int,
    seq: int,
    precision: str,
    rules: Rules | None,
    context: int = 1,
) -> tuple:
    """(built stages, the stage, its shared weights, one layer's weights, a microbatch,
    the counting context), abstract and sharded, on one stage of `context` x `tensor`
    JAX devices. The counting context (the model, the rules, its attention's shape)
    keeps apart pieces whose inputs look alike but compute otherwise."""
    par = Parallelism(tensor=tensor, context=context)
    mesh = mesh_from(par, jax.devices()[: par.num_devices])
    train = TrainConfig(batch=microbatch_size, seq=seq, precision=precision)
    rules = stage_rules(
        rules_or_default(rules, False, context=context, tensor=tensor, kv_heads=model.cfg.kv_heads)
    )
    built = build_stages(model, stage_meshes(mesh, 1), train, PhasedConfig(), rules)
    st = built.stages[0]
    shared = with_shardings(built.shared_shapes, st.shared_compute)
    layer = with_shardings(built.layer_shape_one, st.layer_compute)
    batch = model.abstract_batch(microbatch_size, seq, st.batch)
    cached = (CachedWeights.of(layer, LAYER_PIECES),) if precision == "fp8" else ()
    counting = (model, rules, AttentionShape.of(model.cfg, seq, context), *cached)
    return built, st, shared, layer, batch, counting


def optimizer_state(tx: Any, weights: Any, shardings: Any) -> Any:
    """The abstract optimizer state of `weights`, sharded as `shardings`."""
    return with_shardings(jax.eval_shape(tx.init, weights), shardings)


def _bytes_of_shape(tree: Any, shape: tuple[int, ...]) -> int:
    """Per-device bytes of the arrays in `tree` whose shard is `shape` (leading 1s
    dropped on both sides): a layer's kept [b, A/t, s, s] attention probabilities."""

    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(tree)
        if squeezed(x.sharding.shard_shape(x.shape)) == squeezed(shape)
    )


class CountKey(NamedTuple):
    """What a layout's microbatch count depends on: `counted_microbatch`'s arguments."""

    model: Model  # padded for the mesh, in the precision's dtypes
    tensor: int
    microbatch_size: int
    seq: int
    full: bool  # full recomputation
    precision: str
    fused_attention: bool
    rules: Rules
    context: int = 1  # the sequence split over `context` (`context_parallel.py`)


def count_key(
    model: Model,
    par: Parallelism,
    microbatch_size: int,
    seq: int,
    recompute: str,
    precision: str,
    attention: str,
    rules: Rules | None = None,
) -> CountKey:
    """The count a layout's plan uses, sharded by `rules` (Megatron-LM's when None).
    `fp16-mixed` counts in bfloat16, its loss scaling and memory fp16's: XLA's CPU
    backend widens float16 elementwise work into kernels a GPU never runs (a BERT-Large
    layer's forward at 256 x 128: 10.9 GB besides its matmuls, 6.6 in BF16; test_roofline.py)."""
    computed = compute_model(padded_for(model, par), precision)
    if precision == "fp16-mixed":
        computed = computed.replace(param_dtype="bfloat16")
    full, fused = recompute == "full", attention == "fused"
    rules = rules_or_default(
        rules, False, context=par.context, tensor=par.tensor, kv_heads=model.cfg.kv_heads
    )
    return CountKey(
        computed, par.tensor, microbatch_size, seq, full, precision, fused, rules, par.context
    )


@functools.lru_cache(maxsize=256)
def counted_microbatch(key: CountKey) -> Microbatch:
    """`count_microbatch` once per process for each setting (`count_key`): a search plans
    one count at many pipeline depths, replicas, schedules and batch sizes, and counts
    ahead of its planning (`search.py`). With fused attention,
    each layer's backward also recomputes its scores Q K^T: FlashAttention keeps only
    the softmax statistics (Dao et al. 2022, Algorithm 4); and a causal model's cores
    run only the blocks on and below the diagonal (`flops.causal_fraction`), evenly over
    the context devices, which Llama 3 and Megatron-Core balance with two chunks a
    device: the kernels' time, not the FLOPs counted."""
    model, tensor, microbatch_size, seq, full, precision, fused_attention, rules, context = key
    mb = count_microbatch(
        model,
        tensor,
        microbatch_size,
        seq,
        full,
        precision=precision,
        fused_attention=fused_attention,
        rules=rules,
        context=context,
    )
    if fused_attention:  # Q K^T per device: it reads Q (its s / c queries) and K (all s
        # keys, gathered under context parallelism), writes nothing to memory
        fraction = flops.causal_fraction(model, seq)
        mb = _causal(mb, fraction)
        scores = flops.layer_forward(model, microbatch_size, seq)["attn_scores"]
        q_k = microbatch_size * (seq // context + seq) * model.cfg.embed_dim // tensor
        kernel = Matmul(
            scores / (tensor * context),
            q_k * jnp.dtype(model.cfg.param_dtype).itemsize,
            False,
            True,
            fraction,
            fused=True,
        )
        mb = _add_backward_flops(mb, scores, kernel)
    return mb


def _causal(mb: Microbatch, fraction: float) -> Microbatch:
    """`mb` with its attention cores' matmuls (`Matmul.attention`) computing `fraction`
    of their FLOPs on the target (`Matmul.share`): what the program states, and so the
    model's and the executed FLOPs, stay as counted."""
    if fraction == 1.0:
        return mb

    def computed(e: Event) -> Event:
        if not any(m.attention for m in e.matmuls):
            return e
        shares = tuple(m._replace(share=fraction) if m.attention else m for m in e.matmuls)
        return dataclasses.replace(e, matmuls=shares)

    return dataclasses.replace(
        mb, pieces={k: [computed(e) for e in v] for k, v in mb.pieces.items()}
    )


def _add_backward_flops(mb: Microbatch, extra: float, kernel: Matmul | None = None) -> Microbatch:
    """`mb` with each layer's backward computing `extra` FLOPs (over its tensor group)
    more, all of them recomputation: as one more matmul `kernel` (FLOPs and bytes per
    device) in each run of the piece, or else as more runs of the whole piece."""
    backward = mb.pieces["backward"]
    compute = next(e for e in backward if e.kind == "compute")
    added = dataclasses.replace(
        compute, flops=compute.flops + extra, recompute_flops=compute.recompute_flops + extra
    )
    if kernel is not None:
        added = dataclasses.replace(
            added, run_flops=compute.run_flops + kernel.flops, matmuls=(*compute.matmuls, kernel)
        )
    pieces = {**mb.pieces, "backward": [added if e is compute else e for e in backward]}
    return dataclasses.replace(mb, pieces=pieces)


def selective(mb: Microbatch, key: CountKey) -> Microbatch:
    """Selective recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation
    in Large Transformer Models", Section 4.2): keep everything but the attention core's
    s x s scores and probabilities (`selective_keep`), and recompute that core (Q K^T
    and probs V) in the backward pass: its forward FLOPs (flops.py) added to each
    layer's backward."""
    core = flops.layer_forward(key.model, key.microbatch_size, key.seq)
    return _add_backward_flops(mb, core["attn_scores"] + core["attn_context"])


def selective_op(mb: Microbatch, key: CountKey) -> Microbatch:
    """TorchTitan's selective-op checkpointing (`activations.selective_op_sets`): the
    projections it does not save are recomputed in the backward, their forward FLOPs
    added to each layer's, averaged over the steps where its saved set alternates. The
    elementwise work it recomputes too (norms, rotary embeddings, activations) is memory
    traffic this adds nothing for."""
    tokens = key.microbatch_size * key.seq
    sets = selective_op_sets(key.model)
    per_step = [sum(flops.matmul(tokens, o.inputs, o.outputs) for o in ops) for _, ops in sets]
    return _add_backward_flops(mb, sum(per_step) / len(per_step))


def selective_keep(mb: Microbatch, key: CountKey) -> Microbatch:
    """`mb` keeping what selective recomputation keeps per layer and device: not the
    two [b, A/t, s/c, s] tensors of the attention core (which fused attention never
    kept)."""
    if key.fused_attention:
        return mb
    cfg, b, s = key.model.cfg, key.microbatch_size, key.seq
    itemsize = jnp.dtype(cfg.param_dtype).itemsize
    scores = b * (cfg.num_heads // key.tensor) * (s // key.context) * s * itemsize
    return dataclasses.replace(mb, keep_bytes=max(mb.keep_bytes - 2 * scores, 0))
