"""A resident step's events, assembled from one counted microbatch (`plan_resident.py`).

Each F or B slot of the schedule is its chunk's layers' events (one layer's counted
pieces scaled to the chunk), the first and last virtual stages add the embedding and
head, and activations (or their gradients) cross to the neighbouring stage point to
point over `pipe`. The gradients reduce over the data-parallel axes in buckets during
the last backward or after it (`overlap.py`), each stage runs its optimizer update, and
ZeRO adds its collectives (`zero.py`). Every event is scaled to the stage's r * t
devices (replicas do identical work).
"""

from __future__ import annotations

import functools
from typing import Any

from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger import Event, Phase
from shardemu.config import Parallelism
from shardemu.parallel.schedules import Schedule, Slot
from shardemu.pipelined.layout import PipelineLayout
from shardemu.predict.overlap import MAX_BUCKETS, Overlap
from shardemu.predict.resident_count import Microbatch


def _scaled(
    e: Event, factor: float, replica: int, nbytes: int | None = None, **changes: Any
) -> Event:
    """`e` repeated `factor` times (layers of a chunk) on `replica` times the devices;
    its bytes `nbytes` where given (a part's exact share: `_StepEvents.parts`)."""
    return e.replaced(
        flops=e.flops * factor * replica,
        recompute_flops=e.recompute_flops * factor * replica,
        bytes=round(e.bytes * factor * replica) if nbytes is None else nbytes,
        devices=e.devices * replica,
        **changes,
    )


@functools.lru_cache(maxsize=4096)
def _phase(kind: str, index: int, layers: tuple[int, int]) -> Phase:
    """One phase object per phase, shared by every plan in the process, so that the
    phases it makes for each microbatch (`Phase.at`) are made once: a search assembles
    hundreds of steps of the same phases."""
    return Phase(kind, index, layers)  # type: ignore[arg-type]


def step_ledger(
    mb: Microbatch, sched: Schedule, lay: PipelineLayout, par: Parallelism, overlap: Overlap
) -> AssembledLedger:
    """The step's ledger, assembled when its events are first read: the schedule's slots
    (each virtual stage runs `lay`'s layers), then each stage's gradient all-reduce
    (after its last backward, or only the shared weights' there when the layers' reduce
    in buckets during their last backward: `overlap.py`) and optimizer updates."""
    return StepLedgers(mb, lay, par, overlap).of(sched)


class StepLedgers:
    """`step_ledger`s of one microbatch, layout, mesh and overlap at any schedule (`of`):
    a chunk's events do not depend on the schedule, so the steps made here share their
    slots' event lists (the two short steps a plan is timed from: `periodic.py`)."""

    def __init__(
        self, mb: Microbatch, lay: PipelineLayout, par: Parallelism, overlap: Overlap
    ) -> None:
        self.mb, self.lay, self.par, self.overlap = mb, lay, par, overlap
        self._chunks: Any = None  # the first step's `chunk_events`

    def of(self, sched: Schedule) -> AssembledLedger:
        step = _StepEvents(self.mb, sched, self.lay, self.par, self.overlap)
        if self._chunks is None:
            self._chunks = step.chunk_events
        step.chunk_events = self._chunks
        return AssembledLedger(sched, step.slot_events, after=step.after())


def _share(total: int, i: int, parts: int) -> int:
    """Part `i` of `total` bytes split into `parts` whole parts that add up to it."""
    return total * (i + 1) // parts - total * i // parts


class _StepEvents:
    """A resident step's events, slot by slot (`slot_events`) and after the slots."""

    def __init__(
        self,
        mb: Microbatch,
        sched: Schedule,
        lay: PipelineLayout,
        par: Parallelism,
        overlap: Overlap,
    ) -> None:
        self.mb, self.sched, self.lay, self.par, self.overlap = mb, sched, lay, par, overlap
        self.bucketed = overlap.grad_reduce == "bucketed" and par.data * par.context > 1
        self.fsdp = mb.zero_stage == 3 and mb.zero > 1  # ZeRO-3: layers gathered, reduced
        self.last_backward: dict[int, int] = {}  # virtual stage -> time of its last backward
        self.last_b: dict[int, Slot] = {}  # stage -> its last backward
        for sl in sched.in_order:
            if sl.kind == "B":
                self.last_backward[sched.virtual_stage(sl)] = sl.time
                self.last_b[sl.stage] = sl
        # one list per (F or B, virtual stage, reduce); `assemble` sets the microbatch
        self.chunk_events = functools.cache(self._chunk_events)
        self._alike: dict[tuple[int, float, str], Event] = {}  # `scaled`'s first copies
        # made once per setting (a chunk's buckets are of at most two sizes), a list
        # that callers copy, never change: its events are immutable
        self.all_reduce = functools.cache(self._all_reduce)

    def scaled(self, e: Event, factor: float, tag: Phase, nbytes: int | None = None) -> Event:
        """`e` scaled for a chunk (`_scaled`) in phase `tag`. Its copies for the other
        chunks' phases of `tag`'s kind keep the first as `_alike`: the same work, so the
        same stream and seconds (`costmodel.rules_key`), timed once for all the chunks
        (a 1,536-A100 search timed 3.1 million copies one by one)."""
        copy = _scaled(e, factor, self.par.data, nbytes, phase=tag)
        first = self._alike.setdefault((id(e), factor, tag.kind, nbytes), copy)
        if first is not copy:
            copy.__dict__["_alike"] = first
        return copy

    def phase(self, kind: str, vs: int, micro: int | None = None) -> Phase:
        tag = _phase(kind, vs, self.lay.slices[vs])
        return tag if micro is None else tag.at(micro)

    def _all_reduce(
        self, grad_bytes: int, tag: Phase, stage: int = 0, expert_bytes: int = 0
    ) -> list[Event]:
        """`all_reduce`: the ring all-reduce of `grad_bytes` per device over the
        data-parallel groups (replica, and expert: the experts' `expert_bytes` of them
        over replica alone; and context, whose devices hold the same weights:
        `context_parallel.py`):
        each device sends 2 (n-1)/n of them (Thakur et al. 2005). Under ZeRO the ring
        reduce-scatter, (n-1)/n: each replica needs only its share's sum. At stage 1 too,
        as Megatron-LM's distributed optimizer reduce-scatters the gradients into its
        whole buffer and all-gathers the updated weights (Rajbhandari et al. 2020, §7.2.1:
        P_os moves what data parallelism's all-reduce moves). In FP32 with
        `Overlap.grad_reduce_in_fp32`: 4 bytes for each of the weights' elements."""
        r, ep, c, t = self.par.replica, self.par.expert, self.par.context, self.par.tensor
        op, factor = ("reduce-scatter", 1) if self.mb.zero_stage >= 1 else ("all-reduce", 2)
        factor *= self.overlap.reduce_itemsize(self.mb.weight_itemsize) / self.mb.weight_itemsize
        with_context = "+context" if c > 1 else ""
        parts = [
            (
                ("replica+expert" if ep > 1 else "replica") + with_context,
                r * ep * c,
                grad_bytes - expert_bytes,
            )
        ]
        if expert_bytes:
            parts.append(("replica" + with_context, r * c, expert_bytes))
        return [
            Event(
                0,
                tag,
                "collective",
                "gradients",
                bytes=round(factor * (n - 1) / n * size * r * ep * c * t),
                axis=axis,
                devices=r * ep * c * t,
                op=op,
                group=n,
                stage=stage,
            )
            for axis, n, size in parts
            if n > 1 and size
        ]

    def layers(self, kind: str, tag: Phase, reduce: bool) -> list[Event]:
        """A chunk's layers' forward or backward; with `reduce`, the backward in
        `buckets` equal parts, each followed by the all-reduce of its gradients."""
        mb = self.mb
        piece = mb.pieces["forward" if kind == "F" else "backward"]
        n = self.lay.layers_of(tag.index)
        if n == 0:  # the embedding's or the loss's chunk alone (`layout.Split`)
            return []
        if self.fsdp:
            return self.gathered(kind, tag, piece, n)
        if not reduce:
            return [self.scaled(e, n, tag) for e in piece]
        grads, experts, out = mb.layer_bytes * n, mb.expert_bytes * n, []
        buckets = self.overlap.buckets(grads)
        for i, part in enumerate(self.parts(piece, n, buckets, tag)):
            shares = _share(grads, i, buckets), _share(experts, i, buckets)
            out += [*part, *self.all_reduce(shares[0], tag, 0, shares[1])]
        return out

    def parts(self, piece: list[Event], n: int, count: int, tag: Phase) -> list[list[Event]]:
        """A chunk's `n` layers of `piece` in `count` equal parts, one list of events a
        part: the same list for every part but the last, whose bytes hold what the
        others' whole bytes left, so that the parts move exactly what the chunk does
        unsplit (each part's share rounded lost or made up a byte a part)."""
        if count == 1:
            return [[self.scaled(e, n, tag) for e in piece]]
        whole = [round(e.bytes * n * self.par.data) for e in piece]
        part = [
            self.scaled(e, n / count, tag, w // count) for e, w in zip(piece, whole, strict=True)
        ]
        last = [
            self.scaled(e, n / count, tag, w - (count - 1) * (w // count))
            for e, w in zip(piece, whole, strict=True)
        ]
        return [part] * (count - 1) + [last]

    def gathered(self, kind: str, tag: Phase, piece: list[Event], n: int) -> list[Event]:
        """ZeRO stage 3 (FSDP: Zhao et al. 2023, "PyTorch FSDP", §3.3-3.4; Rajbhandari et
        al. 2020, P_os+g+p) of a chunk's n layers: in `parts` parts (a layer each, at
        most MAX_BUCKETS), each part's weights all-gathered over `replica` one part ahead
        of its computation (FSDP's forward and backward prefetch), gathered again for
        the backward (freed after the forward), and its backward's gradients
        reduce-scattered after it, every microbatch."""
        mb, parts = self.mb, min(n, MAX_BUCKETS)
        weights, experts = mb.layer_bytes * n, mb.expert_bytes * n
        shares = [_share(weights, i, parts) for i in range(parts)]
        gathers = [self.all_gather(w, mb.zero, tag, 0) for w in shares]
        out = gathers[:1]
        for i, part in enumerate(self.parts(piece, n, parts, tag)):  # the next part's
            # gather issued as this one computes: it waits for its stream alone
            # (`costmodel._reads_stored_weights`), and ahead of this part's reduce-scatter
            out += part + gathers[i + 1 : i + 2]
            if kind == "B":
                out += self.all_reduce(shares[i], tag, 0, _share(experts, i, parts))
        return out

    def _chunk_events(self, kind: str, vs: int, reduce: bool = False) -> list[Event]:
        """Virtual stage `vs`'s F or B slot: its pieces, and its output sent on to the
        next virtual stage over `pipe`."""
        last_vs, r, t = self.lay.last, self.par.data, self.par.context * self.par.tensor
        if kind == "F":
            names = (
                (["embed"] if vs == 0 else []) + ["forward"] + (["head"] if vs == last_vs else [])
            )
            tag, to = self.phase("forward", vs), vs + 1
        else:
            names = ["backward"] + (["embed-backward"] if vs == 0 else [])
            tag, to = self.phase("backward", vs), vs - 1
        events = [
            e
            for name in names
            for e in (
                self.layers(kind, tag, reduce)
                if name in ("forward", "backward")
                else [self.scaled(e, 1, tag) for e in self.mb.pieces[name]]
            )
        ]
        if self.fsdp:
            events = self.shared_gather(kind, vs, tag) + events + self.shared_reduce(kind, vs, tag)
        if 0 <= to <= last_vs and self.par.pipe > 1:  # to the next virtual stage, as its input
            carries = "activations" if kind == "F" else "gradients"
            events.append(
                Event(
                    0,
                    self.phase(tag.kind, to),
                    "collective",
                    carries,
                    bytes=self.mb.act_bytes * r * t,
                    axis="pipe",
                    devices=r * t,
                    op="collective-permute",
                    group=2,
                    copies=self.mb.act_copies,
                )
            )
        return events

    def shared_gather(self, kind: str, vs: int, tag: Phase) -> list[Event]:
        """Under ZeRO-3 (FSDP), the shared weights the embedding and the head read
        (`Microbatch.reads`), each part all-gathered whole ahead of the forward slot
        that uses it, the first and the last virtual stage's (the embedding's backward
        needs only the token ids)."""
        if kind != "F":
            return []
        used = [self.mb.reads[0]] if vs == 0 else []
        used += [self.mb.reads[1]] if vs == self.lay.last else []
        return [self.all_gather(n, self.mb.zero, tag, 0) for n in used if n]

    def shared_reduce(self, kind: str, vs: int, tag: Phase) -> list[Event]:
        """Under ZeRO-3 (FSDP), the shared weights' gradients reduce-scattered every
        microbatch once written: after the first virtual stage's backward (its
        embedding's; on one stage, the head's with it), and on the last of several
        stages after the forward slot whose head computes its own gradient."""
        last_head = kind == "F" and vs == self.lay.last and self.par.pipe > 1
        if (kind == "B" and vs == 0) or last_head:
            return self.all_reduce(self.mb.shared_bytes, tag, 0)
        return []

    def slot_events(self, slot: Slot) -> list[Event]:
        vs = self.sched.virtual_stage(slot)
        reduce = self.bucketed and slot.kind == "B" and slot.time == self.last_backward[vs]
        return self.chunk_events(slot.kind, vs, reduce)

    def after(self) -> list[Event]:
        """After the slots, each stage: its gradients' reduction (the shared weights'
        alone when the layers' went in buckets; none under FSDP, which reduced every
        microbatch's) and its optimizer updates, and under ZeRO stages 1 and 2 the
        updated weights' all-gather."""
        mb, sched, r, out = self.mb, self.sched, self.par.data, []
        for s, n in enumerate(self.lay.stage_layers()):
            shared = s in (0, self.par.pipe - 1)
            layers = 0 if self.bucketed or self.fsdp else n
            whole = shared and not self.fsdp  # FSDP's reduced and gathered in the slots
            grads = mb.layer_bytes * layers + (mb.shared_bytes if whole else 0)
            if r * self.par.context > 1 and grads:
                last = self.last_b[s]
                tag = self.phase("backward", sched.virtual_stage(last), last.microbatch)
                out += self.all_reduce(grads, tag, s, mb.expert_bytes * layers)
            update = Phase("update", s)
            out += [_scaled(e, n, r, phase=update, stage=s) for e in mb.pieces["update0"]]
            if shared:
                out += [_scaled(e, 1, r, phase=update, stage=s) for e in mb.pieces["update-shared"]]
            if mb.zero > 1:  # each replica updated its share: the weights all-gathered
                # (under ZeRO-3 they stay split, gathered where they are used)
                weights = mb.layer_bytes * (0 if self.fsdp else n)
                weights += mb.shared_bytes if whole else 0
                if weights:
                    out.append(self.all_gather(weights, mb.zero, update, s))
        return out

    def all_gather(self, weights: int, replicas: int, tag: Phase, stage: int) -> Event:
        """ZeRO's all-gather of `weights` (bytes per device, in their own dtype, as
        Megatron-LM's distributed optimizer and FSDP gather them) over `replica` (and
        `context`: `zero.py`): each device sends (n-1)/n of them (ring)."""
        devices = self.par.data * self.par.context * self.par.tensor
        return Event(
            0,
            tag,
            "collective",
            "weights",
            bytes=round((replicas - 1) / replicas * weights * devices),
            axis="replica+context" if self.par.context > 1 else "replica",
            devices=devices,
            op="all-gather",
            group=replicas,
            stage=stage,
        )
