"""A pipelined step executed for real: every stage runs its schedule's program.

The schedule (`parallel/schedules.py`) gives each stage an ordered program of forward
(F) and backward (B) operations on (microbatch, chunk). The step runs them in rounds:
in each round every stage whose next operation has its input runs it (the first
virtual stage's F reads the batch; any other F, the activations the previous virtual
stage sent; the last virtual stage's B, its own head's gradient; any other B, the
gradient the next virtual stage sent), and what it sends arrives for the next round. A
stage with nothing ready runs nothing: that is the bubble. The executed (round, stage,
microbatch, kind, chunk) list is the schedule with unit durations, which the tests
compare with `make_schedule`'s simulation. JAX dispatch is asynchronous, so the pieces
of different stages run concurrently on their own devices.

No work is repeated (as in Megatron-LM, Narayanan et al. 2021):
- the embedding runs only in the first virtual stage's F, its backward after that
  stage's B; the head and the loss only in the last virtual stage's F;
- F keeps its residuals on the stage's devices (the stage's device tier counts them)
  and B applies them: nothing is recomputed;
- the first and the last stage each hold the shared weights (the tied embedding); their
  two gradient halves are summed by an all-reduce over `pipe` between those two stages
  (Megatron-LM's embedding group), and both apply the same update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from shardemu.accounting.ledger import Phase
from shardemu.accounting.sizes import bytes_per_device
from shardemu.devices import host_value
from shardemu.numerics.precision import host_scale
from shardemu.parallel.schedules import Schedule, Slot, programs
from shardemu.pipelined.layout import PipelineLayout
from shardemu.sparsity import SparseState
from shardemu.stages.executor import Executor, one_layer
from shardemu.stages.pieces import Piece
from shardemu.stages.stage import Stage, sparse_grads

SHARED_BWD = Phase("shared-backward")


@jax.tree_util.register_dataclass
@dataclass
class PipelinedState:
    """Everything a pipelined run keeps between steps, on the devices of its stage."""

    chunks: list[Any]  # per virtual stage: its layers' parameters [n, ...]
    opt_chunks: list[Any]
    shared: dict[int, Any]  # per stage that holds them (first, last): embedding and head
    opt_shared: dict[int, Any]


@dataclass
class StepOutput:
    state: PipelinedState
    chunk_grads: list[Any]  # this step's gradients, per virtual stage
    shared_grads: Any  # the summed gradient of the shared weights
    loss: float
    grad_norm: float
    order: list[list[Slot]]  # per accumulation pass: the operations as executed
    peak_activations: list[float]  # per stage, in microbatches


class Sums:
    """Gradients summed over microbatches, per key, on the stage that computed them."""

    def __init__(self, ex: Executor) -> None:
        self.ex, self.trees = ex, {}

    def add(self, key: tuple, st: Stage, tree: Any, phase: Phase) -> None:
        """Add `tree` in; 16-bit gradients add up in FP32 (`numerics/precision.py`)."""
        if key in self.trees:
            piece = Piece.ACCUMULATE
            tree = self.ex.run(phase, piece, st, (self.trees[key], tree))
        self.trees[key] = tree


class Pass:
    """One pass of m microbatches through the pipeline (one accumulation step)."""

    def __init__(
        self,
        ex: Executor,
        lay: PipelineLayout,
        stages: tuple[Stage, ...],
        state: PipelinedState,
        batches: list[dict[int, dict]],
        counts: dict[int, Any],
        sums: Sums,
        offset: int,
        example_mask: bool,
        scale: float,
    ) -> None:
        self.ex, self.lay, self.stages, self.state = ex, lay, stages, state
        self.batches, self.counts, self.sums, self.offset = batches, counts, sums, offset
        self.example_mask = example_mask  # BERT's padding mask travels with its examples
        self.scale = np.float32(scale)  # the loss scale (mixed precision), else 1
        self.inputs: dict[tuple[int, int], tuple[Any, Any]] = {}  # (mb, j) -> (x, mask)
        self.grads_in: dict[tuple[int, int], Any] = {}  # (mb, j) -> d loss / d output
        self.kept: dict[tuple[int, int], tuple[Any, tuple]] = {}  # (mb, j) -> residuals
        self.masks: dict[int, Any] = {}  # stage -> the mask it last received
        self.losses: list[Any] = []
        self.residual_bytes: dict[int, int] = {}  # stage -> one (microbatch, chunk)'s

    def run(self, progs: list[list[tuple[str, int, int]]]) -> list[Slot]:
        """Run every stage's program in rounds; return the executed operations."""
        p = self.lay.stages
        pointer, executed, time = [0] * p, [], 0
        while any(pointer[s] < len(progs[s]) for s in range(p)):
            arrivals: list[tuple[dict, tuple[int, int], Any]] = []
            ran = False
            for s in range(p):
                if pointer[s] == len(progs[s]):
                    continue
                kind, mb, chunk = progs[s][pointer[s]]
                j = self.lay.virtual_stage(s, chunk)
                if kind == "F" and (j == 0 or (mb, j) in self.inputs):
                    arrivals += self.forward(mb, j)
                elif kind == "B" and (mb, j) in self.grads_in:
                    arrivals += self.backward(mb, j)
                else:
                    continue
                executed.append(Slot(time, s, mb, kind, chunk))  # type: ignore[arg-type]
                pointer[s] += 1
                ran = True
            if not ran:
                raise RuntimeError(f"pipeline program deadlocked in round {time}")
            for box, key, value in arrivals:
                box[key] = value
            time += 1
        return executed

    def _phase(self, kind: str, j: int, mb: int) -> Phase:
        return Phase(kind, j, self.lay.slices[j], self.offset + mb)  # type: ignore[arg-type]

    def forward(self, mb: int, j: int) -> list:
        """F of microbatch `mb` on virtual stage `j`: the layers (with the embedding
        first, or the head and loss last), residuals kept; the output sent on."""
        ex, lay, st = self.ex, self.lay, self.stages[self.lay.stage_of(j)]
        micro, phase = self.offset + mb, self._phase("forward", j, mb)
        shared, batch = self.state.shared.get(st.index), self.batches[mb].get(st.index)
        if j == 0:
            embed = Phase("embed", micro=micro)
            x, mask = ex.run(embed, Piece.EMBED, st, (shared, batch))
        else:
            x, mask = self.inputs.pop((mb, j))
        w = self.state.chunks[j]
        count = (one_layer(w), x, mask)
        args, k = (w, x, mask), lay.layers_of(j)
        y, vjp = ex.run(phase, Piece.FWD_KEEP, st, args, count, k)
        self.kept[(mb, j)] = (vjp, count)
        self.residual_bytes[st.index] = bytes_per_device(vjp)
        ex.tiers[st.index].admit(f"residuals {micro}/{j}", bytes_per_device(vjp), phase)
        if j == lay.last:
            head = Phase("head", micro=micro)
            scale = ex.place(self.scale, st.replicated)
            args = (shared, y, batch, self.counts[st.index], scale)
            loss, (g_shared, g_y) = ex.run(head, Piece.HEAD, st, args)
            self.losses.append(loss)
            self.sums.add(("shared", st.index), st, g_shared, head)
            return [(self.grads_in, (mb, j), g_y)]
        dest = self.stages[lay.stage_of(j + 1)]
        if dest is not st:
            to = self._phase("forward", j + 1, mb)
            if self.example_mask or dest.index not in self.masks:
                y, self.masks[dest.index] = ex.send(
                    st.index, (y, mask), (dest.act, dest.mask), to, "activations"
                )
            else:  # GPT's causal mask is the same for every microbatch: sent once
                y = ex.send(st.index, y, dest.act, to, "activations")
            mask = self.masks[dest.index]
        return [(self.inputs, (mb, j + 1), (y, mask))]

    def backward(self, mb: int, j: int) -> list:
        """B of microbatch `mb` on virtual stage `j`: the kept residuals applied to the
        gradient that arrived; weight gradients summed; the input's gradient sent back
        (or, on the first virtual stage, through the embedding)."""
        ex, lay, st = self.ex, self.lay, self.stages[self.lay.stage_of(j)]
        micro, phase = self.offset + mb, self._phase("backward", j, mb)
        vjp, count = self.kept.pop((mb, j))
        g = self.grads_in.pop((mb, j))
        _, vjp_one = ex.shape(Piece.FWD_KEEP, st, count)
        g_w, g_x = ex.run(phase, Piece.BWD_KEEP, st, (vjp, g), (vjp_one, g), lay.layers_of(j))
        ex.tiers[st.index].release(f"residuals {micro}/{j}")
        self.sums.add(("layers", j), st, g_w, phase)
        if j == 0:
            embed = Phase("embed-backward", micro=micro)
            args = (self.state.shared[st.index], self.batches[mb][st.index], g_x)
            g_embed = ex.run(embed, Piece.EMBED_BWD, st, args)
            self.sums.add(("shared", st.index), st, g_embed, embed)
            return []
        dest = self.stages[lay.stage_of(j - 1)]
        if dest is not st:
            to = self._phase("backward", j - 1, mb)
            g_x = ex.send(st.index, g_x, dest.act, to, "gradients")
        return [(self.grads_in, (mb, j - 1), g_x)]


def shared_holders(lay: PipelineLayout) -> list[int]:
    """The stages that hold the shared weights: the first and the last."""
    return sorted({lay.stage_of(0), lay.stage_of(lay.last)})


def run_step(
    ex: Executor,
    lay: PipelineLayout,
    stages: tuple[Stage, ...],
    schedule: Schedule,
    state: PipelinedState,
    passes: list[list[dict[int, dict]]],
    counts: dict[int, Any],
    example_mask: bool,
) -> StepOutput:
    """One training step: every accumulation pass through the schedule, the tied
    embedding's gradient sum, the global gradient norm, and every stage's update.
    `passes[a][mb]`: microbatch mb of pass a, per stage that reads the batch;
    `counts`: the whole batch's loss counts on those stages."""
    progs = programs(schedule.name, lay.stages, len(passes[0]), lay.virtual, schedule.group)
    scale = host_scale(state.opt_shared[shared_holders(lay)[0]])
    sums, order, losses = Sums(ex), [], []
    residual_bytes: dict[int, int] = {}
    for a, batches in enumerate(passes):
        offset = a * len(batches)
        run = Pass(ex, lay, stages, state, batches, counts, sums, offset, example_mask, scale)
        order.append(run.run(progs))
        losses += run.losses
        residual_bytes.update(run.residual_bytes)
    shared_grads = _sum_shared(ex, stages, shared_holders(lay), sums)
    chunk_grads = [
        _sparse(ex, lay, stages, j, sums.trees[("layers", j)], state.opt_chunks[j])
        for j in range(len(lay.slices))
    ]
    norm = _global_norm(ex, lay, stages, chunk_grads, shared_grads) / scale
    new_state = _update(ex, lay, stages, state, chunk_grads, shared_grads, norm)
    loss = float(sum(host_value(x) for x in losses)) / scale if ex.real else math.nan
    peaks = [ex.tiers[s].high_water / residual_bytes[s] / lay.virtual for s in range(lay.stages)]
    first = shared_holders(lay)[0]
    return StepOutput(new_state, chunk_grads, shared_grads[first], loss, norm, order, peaks)


def _sparse(
    ex: Executor, lay: PipelineLayout, stages: tuple[Stage, ...], j: int, grads: Any, opt: Any
) -> Any:
    """Virtual stage j's gradients, with a sparse run's zero weights' dropped."""
    if not isinstance(opt, SparseState):
        return grads
    st = stages[lay.stage_of(j)]
    return sparse_grads(ex, st, Phase("update", j, lay.slices[j]), grads, opt.masks)


def _sum_shared(
    ex: Executor, stages: tuple[Stage, ...], holders: list[int], sums: Sums
) -> dict[int, Any]:
    """The shared weights' full gradient on every stage that holds them: the embedding's
    half (first stage) plus the head's half (last stage), all-reduced over `pipe`."""
    if len(holders) == 1:
        return {holders[0]: sums.trees[("shared", holders[0])]}
    first, last = (stages[s] for s in holders)
    g_first, g_last = sums.trees[("shared", first.index)], sums.trees[("shared", last.index)]
    from_last, from_first = ex.exchange(
        first.index,
        g_first,
        last.shared_grads,
        g_last,
        first.shared_grads,
        SHARED_BWD,
        "gradients",
    )
    # the same operands in the same order on both stages: bit-identical sums
    add = Piece.ADD_SHARED
    return {
        first.index: ex.run(SHARED_BWD, add, first, (g_first, from_last)),
        last.index: ex.run(SHARED_BWD, add, last, (from_first, g_last)),
    }


def _global_norm(
    ex: Executor,
    lay: PipelineLayout,
    stages: tuple[Stage, ...],
    chunk_grads: list[Any],
    shared_grads: dict[int, Any],
) -> float:
    """The gradient norm over the whole model (clipping needs it on every stage), each
    gradient counted once."""
    parts = [
        (Phase("update", j, lay.slices[j]), lay.stage_of(j), g) for j, g in enumerate(chunk_grads)
    ]
    first = min(shared_grads)
    parts.append((Phase("update"), first, shared_grads[first]))
    squares = [ex.run(phase, Piece.SQ_NORM, stages[s], (g,)) for phase, s, g in parts]
    return math.sqrt(sum(host_value(s) for s in squares)) if ex.real else 0.0


def _update(
    ex: Executor,
    lay: PipelineLayout,
    stages: tuple[Stage, ...],
    state: PipelinedState,
    chunk_grads: list[Any],
    shared_grads: dict[int, Any],
    norm: float,
) -> PipelinedState:
    """The clipped optimizer update of every chunk on its stage, and of the shared
    weights on each stage that holds them."""

    def norm_on(st: Stage) -> Any:
        return ex.place(np.float32(norm), st.replicated)

    chunks, opt_chunks = [], []
    for j, g in enumerate(chunk_grads):
        st = stages[lay.stage_of(j)]
        args = (g, state.opt_chunks[j], state.chunks[j], norm_on(st))
        phase = Phase("update", j, lay.slices[j])
        w, o = ex.run(phase, Piece.UPDATE_LAYERS_DEVICE, st, args, carries="optimizer_state")
        chunks.append(w)
        opt_chunks.append(o)
    shared, opt_shared = {}, {}
    for s, g in shared_grads.items():
        st = stages[s]
        args = (g, state.opt_shared[s], state.shared[s], norm_on(st))
        shared[s], opt_shared[s] = ex.run(
            Phase("update"),
            Piece.UPDATE_SHARED_DEVICE,
            st,
            args,
            carries="optimizer_state",
        )
    return PipelinedState(chunks, opt_chunks, shared, opt_shared)
