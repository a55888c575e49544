"""The phased step program: forward, backward and update, as separate functions.

A step, for phases 0..N-1 of L/N layers each, spread over the pipeline stages in order:

    shared weights (embedding, head)   host -> device, to the first stage (and the last)
    forward  phase i = 0..N-1          weights_i host -> device (the next phase's are
                                       requested before this one runs: a real prefetch,
                                       since JAX dispatch is asynchronous; without
                                       `prefetch`, requested when needed), all-gathered
                                       over `replica` when rts > 1, x_{i+1} = layers_i(x_i);
                                       between stages x moves point to point over `pipe`
    head                               loss and d loss / d x_N
    backward phase i = N-1..0          by the activation policy (`PhasedConfig`):
                                       recompute / offload: weights_i come in again and
                                       the phase's vjp recomputes its forward from x_i
                                       (kept on device, or brought back from the host);
                                       keep: the forward's residuals are still on device;
                                       gradients leave reduced over `replica` (scattered
                                       to the stored 1/rts shards), then device -> host
    update                             clipped by the global gradient norm; in the host
                                       tier, or on the device with weights, state and
                                       gradients streamed in and out (`optimizer_on`)

Every transfer, collective and computation goes through an `Executor` (real arrays or
shapes, one code path); the functions here hold no state between steps. With weight
streaming (`PhasedConfig.weight_streaming`) fetches are SwarmX broadcasts to every
system, and each system's gradients leave on their own, summed on the way into the host
tier (`gradients_out`, `stages/systems.py`). Each event's phase is a typed `Phase`
(`accounting/ledger.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from shardemu.accounting.ledger import Phase
from shardemu.accounting.sizes import bytes_per_device
from shardemu.config import PhasedConfig
from shardemu.devices import host_value
from shardemu.numerics.precision import host_scale
from shardemu.phased.state import Forward, Layout, PhasedState
from shardemu.phased.update import update
from shardemu.sparsity import SparseState
from shardemu.stages.executor import Executor, one_layer
from shardemu.stages.pieces import Piece
from shardemu.stages.stage import Stage, sparse_grads

SHARED, EMBED, HEAD = Phase("shared"), Phase("embed"), Phase("head")
# the forward and backward pieces of the policies that keep a phase's residuals: all of
# them (weights included), or all but the weights (weight streaming, `stages/systems.py`)
KEEP_PIECES = {
    "keep": (Piece.FWD_KEEP, Piece.BWD_KEEP),
    "keep-activations": (Piece.FWD_ACTS, Piece.BWD_ACTS),
}
EMBED_BWD, SHARED_BWD = Phase("embed-backward"), Phase("shared-backward")


def fetch_layers(
    ex: Executor, lay: Layout, cfg: PhasedConfig, state: PhasedState, i: int, kind: str
) -> Any:
    """Phase i's stored weights, host tier -> its stage's device tier (with weight
    streaming, broadcast to every system)."""
    st, w = lay.stage_of(i), state.layers[i]
    nbytes = st.layer_bytes(w, state.opt_layers[i])
    fetch = weights_in(ex, cfg)
    return fetch(st.index, f"w{i}", w, st.layer_store, lay.phase(kind, i), "weights", nbytes)


def weights_in(ex: Executor, cfg: PhasedConfig) -> Any:
    """How weights come from the host tier: to one stage's devices, or (weight
    streaming) broadcast to every system over SwarmX; the same arguments either way."""
    return ex.broadcast if cfg.weight_streaming else ex.to_device


def gather(
    ex: Executor,
    cfg: PhasedConfig,
    st: Stage,
    key: str,
    stored: Any,
    part: str,
    phase: Phase,
    repeat: int,
) -> tuple[Any, str]:
    """All-gather stored 1/rts shards over `replica` before a phase runs; returns the
    weights to compute with and the device-tier key that now holds them."""
    if cfg.rts == 1:
        return stored, key
    count = (one_layer(stored),) if part == "layers" else None
    full = ex.run(
        phase,
        Piece.gather(part),
        st,
        (stored,),
        count_args=count,
        repeat=repeat if count else 1,
        carries="weights",
    )
    ex.tiers[st.index].admit(f"{key}*", bytes_per_device(full), phase)
    ex.tiers[st.index].release(key)
    return full, f"{key}*"


def fetch_shared(
    ex: Executor, lay: Layout, cfg: PhasedConfig, state: PhasedState
) -> dict[int, tuple[Any, str]]:
    """The shared weights (embedding, head) on the first and the last stage, gathered:
    per stage, the weights and their device-tier key."""
    first, last = lay.stages[0], lay.stages[-1]
    shared = {}
    for st in {first.index: first, last.index: last}.values():
        key = f"shared@{st.index}"
        stored = weights_in(ex, cfg)(
            st.index, key, state.shared, st.shared_store, SHARED, "weights"
        )
        shared[st.index] = gather(ex, cfg, st, key, stored, "shared", SHARED, 1)
    return shared


def forward(
    ex: Executor,
    lay: Layout,
    cfg: PhasedConfig,
    state: PhasedState,
    batches: dict[int, dict],
    shared: dict[int, tuple[Any, str]],
    scale: float,
) -> Forward:
    """Embedding, every phase in order (prefetching the next phase's weights), the head
    and its loss (times the loss scale `scale`)."""
    n, k = len(lay.slices), lay.layers_per_phase
    first, last = lay.stages[0], lay.stages[-1]
    x, mask = ex.run(EMBED, Piece.EMBED, first, (shared[0][0], batches[0]))
    ex.tiers[first.index].admit("x0", bytes_per_device(x), EMBED)
    out = Forward(None, None, None, {0: mask}, {}, {})
    ahead = 1 if cfg.prefetch else 0  # phases fetched before the one that runs
    fetched = {0: fetch_layers(ex, lay, cfg, state, 0, "forward")}
    for i in range(n):
        st, phase, tier = lay.stage_of(i), lay.phase("forward", i), ex.tiers[lay.stage_of(i).index]
        if i + ahead < n and i + ahead not in fetched:
            fetched[i + ahead] = fetch_layers(ex, lay, cfg, state, i + ahead, "forward")
        if st.index not in out.masks:  # first phase of a later stage: x arrives over `pipe`
            prev = lay.stage_of(i - 1)
            x, out.masks[st.index] = ex.send(
                prev.index, (x, mask), (st.act, st.mask), phase, "activations"
            )
            ex.tiers[prev.index].release(f"x{i}")
            tier.admit(f"x{i}", bytes_per_device(x), phase)
        mask = out.masks[st.index]
        weights, held = gather(ex, cfg, st, f"w{i}", fetched.pop(i), "layers", phase, k)
        out.gathered_bytes.append(bytes_per_device(weights))
        args, count = (weights, x, mask), (one_layer(weights), x, mask)
        if cfg.activations in KEEP_PIECES:  # the backward's residuals stay on the device
            piece = KEEP_PIECES[cfg.activations][0]
            y, kept = ex.run(phase, piece, st, args, count, k)
            out.kept[i] = (kept, count)
            tier.admit(f"res{i}", bytes_per_device(kept), phase)
            tier.release(f"x{i}")
            out.activation_bytes.append(bytes_per_device(kept))
        else:
            y = ex.run(phase, Piece.FWD, st, args, count, k)
            out.activation_bytes.append(bytes_per_device(x))
            out.kept[i] = x
            if cfg.activations == "offload":
                out.kept[i] = ex.to_host(st.index, x, st.act, phase, "activations")
                tier.release(f"x{i}")
        tier.release(held)
        x = y
        tier.admit(f"x{i + 1}", bytes_per_device(x), phase)
    scale_arg = ex.place(np.float32(scale), last.replicated)
    args = (shared[last.index][0], x, batches[last.index], None, scale_arg)
    out.loss, (out.g_head, out.g_x) = ex.run(HEAD, Piece.HEAD, last, args)
    ex.tiers[last.index].admit("g-head", bytes_per_device(out.g_head), HEAD)
    ex.tiers[last.index].release(f"x{n}")
    out.fetched = fetched
    return out


def recompute_flops(ex: Executor, st: Stage, count: tuple, g_x: Any) -> float:
    """FLOPs per device of one layer's recomputation: its backward from the phase
    input (counted: the piece the phase runs) minus its backward from kept residuals.
    (Not the forward's count: XLA drops the recomputed forward's last matmul, whose
    output the vjp never uses.) The latter, and the forward that lays out its
    residuals, are counted for that alone: nothing of them is recorded. Zero in a dry
    run for memory alone (`Executor.counting`), which lists the forward."""
    if not ex.counting:
        ex.will_count(Piece.FWD_KEEP, st, count)
        return 0.0
    _, vjp_one = ex.shape(Piece.FWD_KEEP, st, count)
    bwd = ex.count(Piece.BWD, st, (*count, g_x)).flops_per_device
    return bwd - ex.count(Piece.BWD_KEEP, st, (vjp_one, g_x)).flops_per_device


def backward_phase(
    ex: Executor,
    lay: Layout,
    cfg: PhasedConfig,
    fwd: Forward,
    i: int,
    g_x: Any,
    restored: dict[int, Any],
) -> tuple[Any, Any]:
    """Phase i's backward: (its weight gradients, d loss / d x_i)."""
    st, phase, k = lay.stage_of(i), lay.phase("backward", i), lay.layers_per_phase
    tier = ex.tiers[st.index]
    if cfg.activations == "keep":
        vjp, count = fwd.kept.pop(i)
        _, vjp_one = ex.shape(Piece.FWD_KEEP, st, count)
        g_w, g_x = ex.run(phase, Piece.BWD_KEEP, st, (vjp, g_x), (vjp_one, g_x), k)
        tier.admit(f"g{i}", bytes_per_device(g_w), phase)
        tier.release(f"res{i}")
        return g_w, g_x
    weights, held = gather(ex, cfg, st, f"w{i}", fwd.fetched.pop(i), "layers", phase, k)
    if cfg.activations == "keep-activations":  # the weights came in again, the rest stayed
        kept, count = fwd.kept.pop(i)
        _, kept_one = ex.shape(Piece.FWD_ACTS, st, count)
        args = (weights, kept, g_x)
        g_w, g_x = ex.run(phase, Piece.BWD_ACTS, st, args, (count[0], kept_one, g_x), k)
        tier.admit(f"g{i}", bytes_per_device(g_w), phase)
        tier.release(held)
        tier.release(f"res{i}")
        return g_w, g_x
    x_i = restored.pop(i) if cfg.activations == "offload" else fwd.kept.pop(i)
    mask = fwd.masks[st.index]
    count = (one_layer(weights), x_i, mask)
    g_w, g_x = ex.run(
        phase,
        Piece.BWD,
        st,
        (weights, x_i, mask, g_x),
        (*count, g_x),
        k,
        recompute=recompute_flops(ex, st, count, g_x),
    )
    tier.admit(f"g{i}", bytes_per_device(g_w), phase)
    tier.release(held)
    tier.release(f"x{i}")
    return g_w, g_x


def backward(
    ex: Executor,
    lay: Layout,
    cfg: PhasedConfig,
    state: PhasedState,
    fwd: Forward,
    shared: dict[int, tuple[Any, str]],
    batches: dict[int, dict],
) -> tuple[list[Any], Any, float]:
    """Every phase in reverse (prefetching the previous phase's weights and restored
    activations), then the embedding and the shared weights; the gradients end in the
    host tier. Returns (per-phase gradients, shared gradients, global gradient norm)."""
    n = len(lay.slices)
    first, last = lay.stages[0], lay.stages[-1]
    grads: list[Any] = [None] * n
    squares: list[Any] = []
    restored: dict[int, Any] = {}

    def prefetch(j: int) -> None:
        if cfg.activations == "keep":
            return
        fwd.fetched[j] = fetch_layers(ex, lay, cfg, state, j, "backward")
        if cfg.activations == "offload":
            sj = lay.stage_of(j)
            restored[j] = ex.to_device(
                sj.index, f"x{j}", fwd.kept[j], sj.act, lay.phase("backward", j), "activations"
            )

    ahead = 1 if cfg.prefetch else 0
    prefetch(n - 1)
    requested, g_x = {n - 1}, fwd.g_x
    for i in reversed(range(n)):
        st, phase = lay.stage_of(i), lay.phase("backward", i)
        if i - ahead >= 0 and i - ahead not in requested:
            requested.add(i - ahead)
            prefetch(i - ahead)
        if i + 1 < n and lay.stage_of(i + 1) is not st:
            g_x = ex.send(lay.stage_of(i + 1).index, g_x, st.act, phase, "gradients")
        g_w, g_x = backward_phase(ex, lay, cfg, fwd, i, g_x, restored)
        opt = state.opt_layers[i]
        masks = opt.masks if isinstance(opt, SparseState) else None
        grads[i], square = gradients_out(ex, cfg, st, phase, "layers", g_w, masks)
        ex.tiers[st.index].release(f"g{i}")
        squares.append(square)

    args = (shared[0][0], batches[0], g_x)
    g_embed = ex.run(EMBED_BWD, Piece.EMBED_BWD, first, args)
    tier = ex.tiers[first.index]
    tier.admit("g-embed", bytes_per_device(g_embed), EMBED_BWD)
    g_head = fwd.g_head
    if last is not first:  # the tied embedding's second term, from the head's stage
        g_head = ex.send(last.index, g_head, first.shared_store, SHARED_BWD, "gradients")
        ex.tiers[last.index].release("g-head")
        tier.admit("g-head", bytes_per_device(g_head), SHARED_BWD)
    g_shared = ex.run(SHARED_BWD, Piece.ADD_SHARED, first, (g_embed, g_head))
    tier.admit("g-shared", bytes_per_device(g_shared), SHARED_BWD)
    tier.release("g-embed")
    tier.release("g-head")
    shared_grads, square = gradients_out(ex, cfg, first, SHARED_BWD, "shared", g_shared, None)
    tier.release("g-shared")
    squares.append(square)
    for st_index, (_, key) in shared.items():
        ex.tiers[st_index].release(key)
    norm = math.sqrt(sum(host_value(s) for s in squares)) if ex.real else 0.0
    return grads, shared_grads, norm


def gradients_out(
    ex: Executor,
    cfg: PhasedConfig,
    st: Stage,
    phase: Phase,
    part: str,
    grads: Any,
    masks: Any,
) -> tuple[Any, Any]:
    """Gradients of a stack of layers (or of the shared weights) from the device tier
    to the host tier: (the gradients there, their squared norm). A sparse run's `masks`
    (in the host tier) drop its zero weights' gradients first, so that the norm that
    clips them is the sparse model's. With weight streaming, `grads` are stacked per
    system and SwarmX sums them on the way (`Executor.reduce`)."""
    store = st.layer_store if part == "layers" else st.shared_store
    if cfg.weight_streaming:
        rows = jax.tree.map(lambda _: st.stacked, store)
        name = Piece.swarmx_reduce(part)
        return ex.reduce(st, name, grads, rows, masks, phase, "gradients")
    if masks is not None:  # the masks came in as the weights' coordinates
        grads = sparse_grads(ex, st, phase, grads, ex.place(masks, st.on_device(masks)))
    square = ex.run(phase, Piece.SQ_NORM, st, (grads,))
    return ex.to_host(st.index, grads, store, phase, "gradients"), square


@dataclass
class StepOutput:
    state: PhasedState  # the next step's state
    grads: PhasedState  # this step's gradients as they reached the host tier
    loss: float
    grad_norm: float
    forward: Forward  # what each phase held (for the plan's rows)


def run_step(
    ex: Executor, lay: Layout, cfg: PhasedConfig, state: PhasedState, batches: dict[int, dict]
) -> StepOutput:
    """One training step: shared weights in, forward, backward, update."""
    scale = host_scale(state.opt_shared)  # mixed precision's loss scale, else 1
    shared = fetch_shared(ex, lay, cfg, state)
    fwd = forward(ex, lay, cfg, state, batches, shared, scale)
    grads, shared_grads, norm = backward(ex, lay, cfg, state, fwd, shared, batches)
    norm /= scale
    new_state = update(ex, lay, cfg, state, grads, shared_grads, norm)
    # with weight streaming, the loss comes as each system's share; on the last of
    # several stages, possibly on another process's devices (`host_value`)
    if not ex.real:
        loss = math.nan
    elif np.ndim(fwd.loss) == 0:
        loss = host_value(fwd.loss) / scale
    else:
        loss = float(np.sum(fwd.loss)) / scale
    return StepOutput(new_state, PhasedState(shared_grads, grads, None, []), loss, norm, fwd)
