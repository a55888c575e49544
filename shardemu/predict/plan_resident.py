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
import time
from collections.abc import Callable, Iterable
from typing import Any

from shardemu.accounting import flops
from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger import Event, Ledger
from shardemu.allocation import fewer_collections
from shardemu.config import ConfigError, ModelConfig, Parallelism, SparsityConfig, TrainConfig
from shardemu.models import Model, as_model, count_params
from shardemu.numerics.precision import arithmetic
from shardemu.parallel.rules import Rules, rules_or_default
from shardemu.parallel.schedules import Schedule
from shardemu.pipelined.layout import PipelineLayout, Split
from shardemu.predict.context_parallel import per_step_reductions
from shardemu.predict.costmodel import Timeline
from shardemu.predict.expert_parallel import expert_parallel
from shardemu.predict.hardware import Hardware
from shardemu.predict.layouts import Recompute
from shardemu.predict.memory_bound import memory_bound
from shardemu.predict.microbatch import Screen, choose_microbatch
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap
from shardemu.predict.periodic import (
    extrapolated,
    period_report,
    short_steps,
    shortened,
    timed_step,
)
from shardemu.predict.plan import Plan
from shardemu.predict.prediction import Prediction, require_fit
from shardemu.predict.resident_count import (
    CountKey,
    Microbatch,
    counted_microbatch,
    selective,
    selective_op,
)
from shardemu.predict.resident_memory import (
    Kept,
    device_bytes,
    device_bytes_at_least,
    kept,
    resident_layout,
)
from shardemu.predict.resident_step import StepLedgers, step_ledger
from shardemu.predict.roofline import least_training_step
from shardemu.predict.sparse import (
    layer_factor,
    model_flops_sparse,
    scale_compute,
    sparse_report,
)
from shardemu.predict.step_bound import busy_streams
from shardemu.predict.zero import placed_casts, zero


@fewer_collections()
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
    extrapolate: bool = True,
    band: bool = True,
) -> Plan:
    """Predict a resident (pipelined) step of `train`'s batch, schedule, precision,
    sparsity and stage layers (each stage's layers, as `pipeline_layout` splits them) on
    `hardware`, `microbatch_size` sequences a microbatch, its communication overlapped as
    `overlap` says and its attention core `materialized` or `fused` (`ATTENTION`): the
    report, the step's ledger and its timeline. With `must_fit`, a layout over the
    device memory raises `CapacityError` before its step is assembled and timed, and
    before its microbatch is counted where its least bytes (`memory_bound`) are over
    already. Parameters and activations are sharded by `rules` (Megatron-LM's
    tensor parallelism by default). A long periodic step is predicted from two short
    ones (`periodic.py`), unless `extrapolate` is False; its band is timed unless `band`
    is False. Needs `par.context` x `par.tensor` JAX devices (one stage's context x
    tensor group)."""
    t0 = time.perf_counter()
    c = counted_layout(model, par, train, microbatch_size, hardware, recompute, overlap,
                       attention, must_fit, rules)  # fmt: skip
    model, sched, lay, batch, seq = c.key.model, c.sched, c.lay, train.batch, train.seq
    ledger, totals, timeline, prediction, ms = _predicted(
        c.mb, c.timed, sched, lay, par, overlap, extrapolate, c.hardware, {"device": c.held},
        batch * seq, band,
    )  # fmt: skip
    report = {
        "model": model.name,
        "mesh": str(par),
        "devices": par.num_devices,
        "param_count": count_params(model),
        **_settings(train, microbatch_size, sched, lay, recompute, overlap, attention),
        "activation_bytes_per_layer": c.keep.to_json(),
        **_counts(totals, model, par, batch, seq, prediction.step_time_s, train.sparsity),
        **prediction.to_json(),
        **sparse_report(c.hardware, train.sparsity),
        **({"period": period_report(ms, sched.microbatches)} if ms else {}),
        "elapsed_s": time.perf_counter() - t0,
    }
    return Plan(report, ledger, timeline, prediction)


@dataclasses.dataclass(frozen=True)
class CountedLayout:
    """A resident layout up to its step: the profile at its precision, its layout,
    schedule and count key, its microbatch counted on the mesh (`mb`) and as its layers
    are timed (`timed`: recomputation and sparsity applied), and its device bytes."""

    hardware: Hardware
    lay: PipelineLayout
    sched: Schedule
    key: CountKey
    mb: Microbatch
    timed: Microbatch
    held: int
    keep: Kept  # what a layer keeps for its backward, in the report

    def least_step(self, par: Parallelism, overlap: Overlap) -> float:
        """No timeline of its step on `par` ends sooner: its busiest stream
        (`step_bound.busy_streams`), from the two short steps its plan is timed from,
        extrapolated (linear in the microbatches from p on, as the step's time:
        `periodic.py`), or its whole step where it is not periodic."""
        steps, lists = StepLedgers(self.timed, self.lay, par, overlap), {}

        def busy(sched: Schedule) -> dict[tuple[int, str], float]:
            return busy_streams(steps.of(sched), self.hardware, par, overlap, lists)

        ms = short_steps(self.sched)
        if ms is None:
            return max(busy(self.sched).values(), default=0.0)
        short, long = (busy(shortened(self.sched, k)) for k in ms)
        return max(extrapolated(short, long, ms, self.sched.microbatches).values())

    def same_step(self, other: CountedLayout) -> bool:
        """Whether `other`'s step is this one's: the same profile rates, layout,
        schedule, counted and timed microbatch and device bytes (a search's layouts that
        differ in a precision that counts alike: `search.Searcher.screen`)."""
        return (self.hardware, self.lay, self.sched, self.held, self.mb, self.timed) == (
            other.hardware, other.lay, other.sched, other.held, other.mb, other.timed
        )  # fmt: skip


def counted_layout(
    model: Model | ModelConfig, par: Parallelism, train: TrainConfig, microbatch_size: int,
    hardware: Hardware, recompute: Recompute, overlap: Overlap, attention: str,
    must_fit: bool, rules: Rules | None,
) -> CountedLayout:  # fmt: skip
    """`plan_resident`'s layout counted, its step not yet assembled (its docstring)."""
    model = as_model(model)
    _refuse_uncovered(par, train, overlap)
    rules = _rules(rules, model, par, train)
    hardware = hardware.at_precision(arithmetic(model.cfg, train.precision))
    lay, sched, key = resident_layout(
        model, par, train.batch, train.seq, microbatch_size, train.schedule, train.virtual,
        recompute, train.precision, attention, Split.of(train), rules, train.microbatch_group,
    )  # fmt: skip
    layout = f"{par} microbatch {microbatch_size} {train.schedule} recompute={recompute}"
    if must_fit:  # nothing compiled for a layout whose least bytes are over the memory
        bound = _on_mesh(memory_bound(key), key, train, par, recompute)
        least = device_bytes(bound, key, recompute, par, lay, sched)
        require_fit({"device": least}, hardware, layout, at_least=True)
    mb = _on_mesh(counted_microbatch(key), key, train, par, recompute)
    reduce = overlap.reduce_itemsize(mb.weight_itemsize)
    held = device_bytes(mb, key, recompute, par, lay, sched, reduce)
    if must_fit:
        require_fit({"device": held}, hardware, layout)
    keep, timed = kept(mb, key, recompute), mb
    if recompute == "selective":
        mb = timed = selective(mb, key)
    elif recompute == "selective-op":
        mb = timed = selective_op(mb, key)
    if train.sparsity is not None:  # the layers' matmuls at the hardware's block-sparse speed
        factor = layer_factor(hardware, key.model, train.seq, train.sparsity)
        layers = {k: scale_compute(mb.pieces[k], factor) for k in ("forward", "backward")}
        timed = dataclasses.replace(mb, pieces={**mb.pieces, **layers})
    return CountedLayout(hardware, lay, sched, key, mb, timed, held, keep)


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
        "microbatch_group": sched.group,  # interleaved: a chunk's microbatches in turn
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
    """A microbatch counted on one context x tensor group (or its memory bound), as each
    device of `par` holds and runs it: its experts split over `expert`, its optimizer
    state over `replica` under ZeRO, its weight gradients reduced over `context` once a
    step (`context_parallel.py`), FP8's weight casts where the weights stay
    (`zero.placed_casts`)."""
    mb = per_step_reductions(mb, par.context, par.tensor)
    return placed_casts(zero(expert_parallel(mb, key, par.expert, recompute), train.zero, par))


def _refuse_uncovered(par: Parallelism, train: TrainConfig, overlap: Overlap) -> None:
    """Refuse what a resident plan does not cover: a sequence the context (and, under
    sequence parallelism, tensor) size does not divide; chunked tensor overlap without
    sequence parallelism; context and experts split together (their all-to-alls are
    added per tensor group: `expert_parallel.py`)."""
    train.check_sequence_split(par.tensor, par.context)
    if overlap.tp_overlap == "chunked" and not train.sequence_parallel:
        raise ConfigError(
            "Overlap.tp_overlap chunked hides the all-gathers and reduce-scatters of "
            "sequence-parallel layers (Megatron-Core refuses its tp_comm_overlap without "
            "sequence parallelism); set TrainConfig.sequence_parallel, or "
            "Overlap.tp_overlap none"
        )
    if par.context > 1 and par.expert > 1:
        raise ConfigError(
            f"mesh {par}: plans of context and expert parallelism together are not built; "
            f"plan one of them (expert=1 or context=1)"
        )


def _predicted(
    mb: Microbatch,
    timed: Microbatch,
    sched: Schedule,
    lay: PipelineLayout,
    par: Parallelism,
    overlap: Overlap,
    extrapolate: bool,
    hardware: Hardware,
    memory: dict[str, int],
    tokens: int,
    band: bool = True,
) -> tuple[Ledger, dict[str, Any], Timeline, Prediction, tuple[int, int] | None]:
    """The step's ledger of `mb`'s events and its totals (`_totals`), and the timeline
    and prediction of `timed`'s (`periodic.timed_step`): the whole step's, or with
    `extrapolate` a long periodic step's from two short ones, whose microbatches come
    last (None: timed whole)."""
    ledger = step_ledger(mb, sched, lay, par, overlap)
    totals = _totals(ledger)

    steps = StepLedgers(timed, lay, par, overlap)

    def events_of(schedule: Schedule | None) -> AssembledLedger:
        if schedule is sched and timed is mb:
            return ledger
        return steps.of(schedule)  # type: ignore[arg-type]

    timeline, prediction, _, ms = timed_step(
        events_of, sched, extrapolate, hardware, par, totals["model_flops"], tokens, memory,
        overlap, band,
    )  # fmt: skip
    return ledger, totals, timeline, prediction, ms


def _totals(ledger: AssembledLedger) -> dict[str, Any]:
    """A step's totals (`Ledger.step_totals`) and the FLOPs the hardware executes (less
    the optimizer update), each slot's events totalled once (`AssembledLedger.summed`)."""

    def executed(events: Iterable[Event]) -> float:
        return sum(
            e.flops for e in events if e.kind == "compute" and e.carries != "optimizer_state"
        )

    return {**ledger.step_totals(0), "executed_flops": ledger.summed(executed)}


def _counts(
    totals: dict[str, Any],
    model: Model,
    par: Parallelism,
    batch: int,
    seq: int,
    step: float,
    sparsity: SparsityConfig | None,
) -> dict[str, Any]:
    """A step's counts in the report: its totals (`_totals`), the analytic model FLOPs
    beside them, and the hardware's TFLOP/s a device."""
    analytic = flops.training_step(model, batch, seq)
    return {
        **totals,
        "model_flops_analytic": analytic,
        "model_flops_rel_err": totals["model_flops"] / analytic - 1,
        "tflops_per_device": totals["executed_flops"] / par.num_devices / step / 1e12
        if step
        else 0.0,
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

    # On one stage a larger microbatch is never slower: the same FLOPs and activation
    # bytes in fewer, larger kernels (fewer kernel latencies and weight reads, each
    # matmul's roofline term no larger), per-microbatch collectives (ZeRO 3's
    # all-gathers) fewer, and more of the gradient reduction hidden behind the last
    # microbatch's backward; no bubble either way. So the largest size that fits is
    # the fastest, and smaller ones are not planned (tests/test_costmodel.py holds
    # the choice to planning every size).
    one_stage = par.pipe == 1
    plain = train.sparsity is None and par.expert == 1  # what the bytes' bound covers
    screen = _screen(model, par, train, hardware, settings) if one_stage and plain else None
    _, planned = choose_microbatch(train.batch, par, plan, screen, larger_no_slower=one_stage)
    return planned


def _screen(
    model: Model | ModelConfig, par: Parallelism, train: TrainConfig, hardware: Hardware,
    settings: dict[str, Any],
) -> Callable[[int], Screen]:  # fmt: skip
    """A size judged with nothing compiled: its least device bytes
    (`device_bytes_at_least`: a size over the memory is not planned while another may
    fit) and the model FLOPs at the profile's rate (`roofline.least_step_seconds`)."""
    model = as_model(model)
    rules = _rules(settings.get("rules"), model, par, train)
    least_step = least_training_step(model, train, par.num_devices, hardware)

    def screen(size: int) -> Screen:
        least = device_bytes_at_least(
            model, par, train.batch, train.seq, size, train.schedule, train.virtual,
            settings.get("recompute", "full"), train.precision,
            settings.get("attention", "materialized"), rules, train.zero, Split.of(train),
        )  # fmt: skip
        return Screen(least, least <= hardware.device_memory_bytes, least_step)

    return screen


def _rules(rules: Rules | None, model: Model, par: Parallelism, train: TrainConfig) -> Rules:
    """`rules`, or the run's own default for `train`'s sequence parallelism and `par`'s
    context and tensor sizes."""
    return rules_or_default(
        rules, train.sequence_parallel, context=par.context,
        tensor=par.tensor, kv_heads=model.cfg.kv_heads,
    )  # fmt: skip
