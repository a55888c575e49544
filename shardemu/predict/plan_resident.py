"""Abstract mode for resident training: weights and optimizer state stay on the devices,
microbatches flow through a pipeline schedule, gradients are all-reduced over `replica`.

The work of one microbatch is counted, not guessed: on one pipeline stage's tensor
devices (replica = 1), the stage pieces (`stages/stage.py`) are compiled over shapes and
counted (`accounting/count.py`): the embedding, one layer's forward (keeping its vjp
residuals, or only its input with `recompute="full"`) and backward, the head and loss,
the embedding's backward, and the optimizer updates on the device. A step's ledger is
then assembled from the schedule's slots (`accounting/assemble.py`): each F or B slot is
its chunk's layers' events, the first and last virtual stages add the embedding and
head, and activations (or their gradients) cross to the neighbouring stage point to
point over `pipe`. After its last backward each stage all-reduces its gradients over
`replica` (ring: each device sends 2 (r-1)/r of them; Thakur et al. 2005) and runs its
optimizer update. Every event is scaled to the stage's r * t devices (replicas do
identical work). An `expert` axis is data parallelism too, whose experts are split over
it (`expert_parallel.py`: their memory, all-to-alls and gradient reductions). The cost
model then places the events (`costmodel.py`), so the pipeline bubble, exposed
communication and the data-parallel all-reduce come out of the timeline.

Memory per device: weights, gradients and two Adam moments (4x the stage's weight bytes)
plus the activations of the microbatches a stage holds at its peak (from the schedule)
times its layers' kept bytes (residuals, or only the layer inputs with recomputation).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from shardemu.accounting import flops
from shardemu.accounting.assemble import assemble
from shardemu.accounting.ledger import Event, Ledger, Phase
from shardemu.config import ConfigError, ModelConfig, Parallelism, SparsityConfig, TrainConfig
from shardemu.models import Model, as_model, count_params
from shardemu.numerics.precision import arithmetic
from shardemu.parallel.rules import Rules, rules_or_default
from shardemu.parallel.schedules import Schedule, Slot
from shardemu.pipelined.layout import PipelineLayout
from shardemu.predict.costmodel import predict, require_fit
from shardemu.predict.expert_parallel import expert_parallel
from shardemu.predict.hardware import Hardware
from shardemu.predict.microbatch import choose_microbatch
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap
from shardemu.predict.plan import Plan
from shardemu.predict.resident_count import (
    CountKey,
    Microbatch,
    Recompute,
    counted_microbatch,
    memory_bound,
    selective,
)
from shardemu.predict.resident_memory import device_bytes, kept, resident_layout
from shardemu.predict.sparse import (
    layer_factor,
    model_flops_sparse,
    scale_compute,
    sparse_report,
)
from shardemu.predict.zero import require_planned_stage, zero


def _scaled(e: Event, factor: float, replica: int, **changes: Any) -> Event:
    """`e` repeated `factor` times (layers of a chunk) on `replica` times the devices."""
    return dataclasses.replace(
        e,
        flops=e.flops * factor * replica,
        recompute_flops=e.recompute_flops * factor * replica,
        bytes=round(e.bytes * factor * replica),
        devices=e.devices * replica,
        **changes,
    )


@functools.lru_cache(maxsize=4096)
def _phase(kind: str, index: int, layers: tuple[int, int]) -> Phase:
    """One phase object per phase, shared by every plan in the process, so that the
    phases it makes for each microbatch (`Phase.at`) are made once: a search assembles
    hundreds of steps of the same phases."""
    return Phase(kind, index, layers)  # type: ignore[arg-type]


def _step_events(
    mb: Microbatch, sched: Schedule, lay: PipelineLayout, par: Parallelism, overlap: Overlap
) -> list[Event]:
    """The step's ledger: the schedule's slots (each virtual stage runs `lay`'s layers),
    then each stage's gradient all-reduce (after its last backward, or only the shared
    weights' there when the layers' reduce in buckets during their last backward:
    `overlap.py`) and optimizer updates."""
    step = _StepEvents(mb, sched, lay, par, overlap)
    return assemble(sched, step.slot_events, after=step.after())


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
        self.bucketed = overlap.grad_reduce == "bucketed" and par.data > 1
        self.last_backward: dict[int, int] = {}  # virtual stage -> time of its last backward
        self.last_b: dict[int, Slot] = {}  # stage -> its last backward
        for sl in sched.in_order:
            if sl.kind == "B":
                self.last_backward[sched.virtual_stage(sl)] = sl.time
                self.last_b[sl.stage] = sl
        # one list per (F or B, virtual stage, reduce); `assemble` sets the microbatch
        self.chunk_events = functools.cache(self._chunk_events)

    def phase(self, kind: str, vs: int, micro: int | None = None) -> Phase:
        tag = _phase(kind, vs, self.lay.slices[vs])
        return tag if micro is None else tag.at(micro)

    def all_reduce(
        self, grad_bytes: int, tag: Phase, stage: int = 0, expert_bytes: int = 0
    ) -> list[Event]:
        """The ring all-reduce of `grad_bytes` per device over the data-parallel groups
        (replica, and expert: the experts' `expert_bytes` of them over replica alone):
        each device sends 2 (n-1)/n of them (Thakur et al. 2005); under ZeRO stage 2 the
        ring reduce-scatter, (n-1)/n."""
        r, ep, t = self.par.replica, self.par.expert, self.par.tensor
        op, factor = ("reduce-scatter", 1) if self.mb.zero_stage >= 2 else ("all-reduce", 2)
        parts = [("replica+expert" if ep > 1 else "replica", r * ep, grad_bytes - expert_bytes)]
        if expert_bytes:
            parts.append(("replica", r, expert_bytes))
        return [
            Event(
                0,
                tag,
                "collective",
                "gradients",
                bytes=round(factor * (n - 1) / n * size * r * ep * t),
                axis=axis,
                devices=r * ep * t,
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
        mb, r = self.mb, self.par.data
        piece = mb.pieces["forward" if kind == "F" else "backward"]
        n = self.lay.layers_of(tag.index)
        if not reduce:
            return [_scaled(e, n, r, phase=tag) for e in piece]
        grads, experts, out = mb.layer_bytes * n, mb.expert_bytes * n, []
        buckets = self.overlap.buckets(grads)
        part = [_scaled(e, n / buckets, r, phase=tag) for e in piece]
        share = lambda total, i: total * (i + 1) // buckets - total * i // buckets  # noqa: E731
        for i in range(buckets):
            out += [*part, *self.all_reduce(share(grads, i), tag, 0, share(experts, i))]
        return out

    def _chunk_events(self, kind: str, vs: int, reduce: bool = False) -> list[Event]:
        """Virtual stage `vs`'s F or B slot: its pieces, and its output sent on to the
        next virtual stage over `pipe`."""
        last_vs, r, t = self.lay.last, self.par.data, self.par.tensor
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
                else [_scaled(e, 1, r, phase=tag) for e in self.mb.pieces[name]]
            )
        ]
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
                )
            )
        return events

    def slot_events(self, slot: Slot) -> list[Event]:
        vs = self.sched.virtual_stage(slot)
        reduce = self.bucketed and slot.kind == "B" and slot.time == self.last_backward[vs]
        return self.chunk_events(slot.kind, vs, reduce)

    def after(self) -> list[Event]:
        """After the slots, each stage: its gradients' all-reduce (the shared weights'
        alone when the layers' went in buckets) and its optimizer updates."""
        mb, sched, r, out = self.mb, self.sched, self.par.data, []
        for s, n in enumerate(self.lay.stage_layers()):
            shared = s in (0, self.par.pipe - 1)
            layers = 0 if self.bucketed else n
            grads = mb.layer_bytes * layers + (mb.shared_bytes if shared else 0)
            if r > 1 and grads:
                last = self.last_b[s]
                tag = self.phase("backward", sched.virtual_stage(last), last.microbatch)
                out += self.all_reduce(grads, tag, s, mb.expert_bytes * layers)
            update = Phase("update", s)
            out += [_scaled(e, n, r, phase=update, stage=s) for e in mb.pieces["update0"]]
            if shared:
                out += [_scaled(e, 1, r, phase=update, stage=s) for e in mb.pieces["update-shared"]]
            if mb.zero > 1:  # each replica updated its share: the weights all-gathered
                weights = mb.layer_bytes * n + (mb.shared_bytes if shared else 0)
                out.append(self.all_gather(weights, mb.zero, update, s))
        return out

    def all_gather(self, weights: int, replicas: int, tag: Phase, stage: int) -> Event:
        """ZeRO's all-gather of the updated `weights` (bytes per device, in
        their own dtype, as Megatron-LM's distributed optimizer gathers them) over
        `replica`: each device sends (n-1)/n of them (ring)."""
        devices = self.par.data * self.par.tensor
        return Event(
            0,
            tag,
            "collective",
            "weights",
            bytes=round((replicas - 1) / replicas * weights * devices),
            axis="replica",
            devices=devices,
            op="all-gather",
            group=replicas,
            stage=stage,
        )


def plan_resident(
    model: Model | ModelConfig,
    par: Parallelism,
    train: TrainConfig,
    microbatch_size: int,
    hardware: Hardware,
    recompute: Recompute = "full",
    overlap: Overlap = DEFAULT_OVERLAP,
    attention: str = "materialized",
    must_fit: bool = False,
    rules: Rules | None = None,
) -> Plan:
    """Predict a resident (pipelined) step of `train`'s batch, schedule, precision,
    sparsity and stage layers (each stage's layers, as `pipeline_layout` splits them) on
    `hardware`, `microbatch_size` sequences a microbatch, its communication overlapped as
    `overlap` says and its attention core `materialized` or `fused` (`ATTENTION`): the
    report, the step's ledger and its timeline. With `must_fit`, a layout over the
    device memory raises `CapacityError` before its step is assembled and timed, and
    before its microbatch is counted where its least bytes (`memory_bound`) are over
    already. Parameters and activations are sharded by `rules` (Megatron-LM's
    tensor parallelism by default). Needs `par.tensor` JAX devices (one stage's tensor
    group)."""
    batch, seq, schedule, virtual = train.batch, train.seq, train.schedule, train.virtual
    precision, sparsity = train.precision, train.sparsity
    t0 = time.perf_counter()
    model = as_model(model)
    train.check_sequence_split(par.tensor)
    require_planned_stage(train)
    if overlap.tp_overlap == "chunked" and not train.sequence_parallel:
        raise ConfigError(
            "Overlap.tp_overlap chunked hides the all-gathers and reduce-scatters of "
            "sequence-parallel layers (Megatron-Core refuses its tp_comm_overlap without "
            "sequence parallelism); set TrainConfig.sequence_parallel, or "
            "Overlap.tp_overlap none"
        )
    rules = rules_or_default(rules, train.sequence_parallel)  # the run's own default
    hardware = hardware.at_precision(arithmetic(model.cfg, precision))
    lay, sched, key = resident_layout(
        model, par, batch, seq, microbatch_size, schedule, virtual, recompute, precision,
        attention, train.stage_layers, rules,
    )  # fmt: skip
    model = key.model
    layout = f"{par} microbatch {microbatch_size} {schedule} recompute={recompute}"
    if must_fit:  # nothing compiled for a layout whose least bytes are over the memory
        bound = _on_mesh(memory_bound(*key), key, train, par, recompute)
        least = device_bytes(bound, key, recompute, par, lay, sched)
        require_fit({"device": least}, hardware, layout, at_least=True)
    mb = _on_mesh(counted_microbatch(*key), key, train, par, recompute)
    held = device_bytes(mb, key, recompute, par, lay, sched)
    keep = kept(mb, key, recompute)
    if must_fit:
        require_fit({"device": held}, hardware, layout)
    if recompute == "selective":
        mb = selective(mb, key)
    ledger = Ledger(_step_events(mb, sched, lay, par, overlap))
    timed = ledger.events
    if sparsity is not None:  # the layers' matmuls at the hardware's block-sparse speed
        factor = layer_factor(hardware, model, seq, sparsity)
        layers = {k: scale_compute(mb.pieces[k], factor) for k in ("forward", "backward")}
        timed = _step_events(
            dataclasses.replace(mb, pieces={**mb.pieces, **layers}), sched, lay, par, overlap
        )
    model_flops = ledger.step_totals(0)["model_flops"]
    timeline, prediction = predict(
        timed, hardware, par, model_flops, batch * seq, {"device": held}, overlap
    )
    report = {
        "model": model.name,
        "mesh": str(par),
        "devices": par.num_devices,
        "param_count": count_params(model),
        **_settings(train, microbatch_size, sched, lay, recompute, overlap, attention),
        "activation_bytes_per_layer": keep.to_json(),
        **_counts(ledger, model, par, batch, seq, prediction.step_time_s, sparsity),
        **prediction.to_json(),
        **sparse_report(hardware, sparsity),
        "elapsed_s": time.perf_counter() - t0,
    }
    return Plan(report, ledger, timeline, prediction)


def _settings(
    train: TrainConfig,
    microbatch_size: int,
    sched: Schedule,
    lay: PipelineLayout,
    recompute: str,
    overlap: Overlap,
    attention: str,
) -> dict[str, Any]:
    """A plan's settings in its report, as the schedule and layout took them."""
    return {
        "batch": train.batch,
        "seq": train.seq,
        "microbatch_size": microbatch_size,
        "microbatches": sched.microbatches,
        "schedule": train.schedule,
        "virtual": train.virtual,
        "stage_layers": lay.stage_layers(),
        "recompute": recompute,
        "precision": train.precision,
        "zero": train.zero,
        "sequence_parallel": train.sequence_parallel,
        "overlap": overlap.to_json(),
        "attention": attention,
        "bubble_fraction": sched.bubble_fraction,
    }


def _on_mesh(
    mb: Microbatch, key: CountKey, train: TrainConfig, par: Parallelism, recompute: str
) -> Microbatch:
    """A microbatch counted on one tensor group (or its memory bound), as each device of
    `par` holds and runs it: its experts split over `expert`, its optimizer state over
    `replica` under ZeRO."""
    return zero(expert_parallel(mb, key, par.expert, recompute), train, par)


def _counts(
    ledger: Ledger,
    model: Model,
    par: Parallelism,
    batch: int,
    seq: int,
    step: float,
    sparsity: SparsityConfig | None,
) -> dict[str, Any]:
    """A step's counts in the report: the ledger's totals, the analytic model FLOPs
    beside them, and what the hardware executes (less the optimizer update)."""
    totals = ledger.step_totals(0)
    analytic = flops.training_step(model, batch, seq)
    executed = sum(
        e.flops for e in ledger.events if e.kind == "compute" and e.carries != "optimizer_state"
    )
    return {
        **totals,
        "model_flops_analytic": analytic,
        "model_flops_rel_err": totals["model_flops"] / analytic - 1,
        "executed_flops": executed,
        "tflops_per_device": executed / par.num_devices / step / 1e12 if step else 0.0,
        **model_flops_sparse(model, batch * seq, totals["model_flops"], sparsity),
    }


def plan_resident_auto(
    model: Model,
    par: Parallelism,
    train: TrainConfig,
    hardware: Hardware,
    **settings: Any,
) -> Plan:
    """`plan_resident` at the microbatch size `choose_microbatch` picks for this layout;
    the report says so under `microbatch_choice`."""

    def plan(size: int) -> tuple[dict[str, Any], Any]:
        planned = plan_resident(model, par, train, size, hardware, **settings)
        return planned.report, planned

    _, planned = choose_microbatch(train.batch, par, plan)
    return planned
