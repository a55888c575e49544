"""The auto-planner behind `shardemu search`: every layout of a model on N devices of a
hardware profile, pruned by memory, predicted, and ranked by step time.

The space (`Space`): every mesh pipe x tensor x replica = N whose pipe divides the
layers and whose tensor divides the heads (up to `max_tensor`); for each, the
microbatch sizes (powers of two that divide the batch per replica, up to
`max_microbatch`), the precisions the profile computes in, and

- resident (`plan_resident.py`): schedule 1F1B or interleaved 1F1B with two chunks a
  stage, recomputation none, selective or full, and with `--attention fused`
  TorchTitan's selective-op (`activations.selective_op`). GPipe is left out: it has 1F1B's bubble
  and holds all m microbatches' activations instead of p (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters", section 2.2.1), so
  it never wins on time or memory;
- phased (`plan_phased.py`): replicated tensor sharding off or over the whole replica
  axis, activations recomputed, offloaded or kept, the optimizer update in the host or
  on the device, the next phase's weights prefetched or not, and the fewest phases that
  fit the device tier (the phased planner's own choice), the batch as pipelined passes
  of the microbatch size.

Pruning, in order, each exact: 1-4 never drop a layout that fits, and 5 and 6 only one
that can be neither among the best `top` nor on the memory/time Pareto front:

1. a mesh whose weights, gradients and Adam state alone exceed the device memory
   (16 bytes a parameter in every precision, over pipe x tensor devices) has no
   resident layout that fits, and one where a layer's weights over tensor (which a
   phase gathers whole before it runs) exceed it has no phased layout that fits;
2. a layout that does not fit its tiers (the planner's own memory count, made before
   its step is assembled: `must_fit`) is kept in the JSON with its device bytes and
   the reason, and not timed. A resident layout is first judged by a lower bound of
   its bytes, found with nothing compiled (`memory_bound.py`): over the
   memory, its row gives `device_bytes_at_least` instead, and a microbatch count no
   layout could use is never made (prune 5 also needs the bound);
3. a larger microbatch holds more activations: once no layout of a microbatch size
   fits, the larger sizes of that mesh and precision are not counted;
4. phased settings are screened least device memory first; a setting that holds at
   least what one of the same rts that did not fit holds, in each of activations, the
   optimizer's place and prefetch, is not planned;
5. branch and bound: the precisions are searched fastest compute rate first
   (`rate_classes`). A resident layout in a slower one cannot be faster than its
   model FLOPs at that rate on every device (`roofline.least_step_seconds`), nor hold
   fewer bytes than its least (`memory_bound`). Where `top` layouts already found are
   faster than that, and one of them is faster and holds no more, it can be neither
   among the top nor on the memory/time Pareto front, and is not counted or planned
   (GPT-3 175B on A100s: every FP32 layout, a third of the counting). Nor, in any
   precision, faster than its last stage's layers computing every microbatch after the
   pipeline's fill and before its drain (`Bounds.fill_and_drain`); the meshes are
   searched the least bubble first, so that such layouts meet fast ones already found
   and are not counted (GPT-3 175B on 1536 A100s: every layout at tensor 1);
6. branch and bound within a precision: once `top` layouts are found, a resident
   layout's microbatch is counted and its step assembled but not timed, and the busiest
   stream of any stage bounds its time (`step_bound.busy_streams`: a stage's
   computations, or each collective axis, one event at a time; the computations'
   chain with the tensor- and context-parallel collectives that wait for them, after
   the pipeline's fill and before its drain). Where `top` layouts found are faster
   than that and one holds no more than its device bytes, it is neither among the top
   nor on the Pareto front, and is not timed (the ZeRO stages and context sizes of one
   mesh share their counts).

Prediction: a step of m microbatches (or passes) is the schedule's steady state
repeated once every stage has started: from m = p microbatches, 1F1B's and the
interleaved schedule's step times are linear in m (Narayanan et al. 2021, section 2.2:
(m + p - 1) slots of a microbatch; interleaved, a bubble of (p - 1) / v slots).
Each layout is planned with its step's m microbatches, which the planner times from
two short steps (`periodic.py`: p and p + 1 microbatches for 1F1B, p and 2p for the
interleaved schedule) and extrapolates linearly to m (tests compare it with the full
plan: equal to 1e-9); its memory is the full step's. (The search planned p and 2p itself
until 2026-11-26, and its 2p plan was itself timed from p and p + 1: the same line, a
timeline more, and planned the best `top` again.) The best `top` are ranked by it.

Twins (`twins.py`): a resident layout that differs from a timed one in precision alone,
its counts, rates, layout and bytes equal (fp16-mixed and bf16 on an A100), takes that
one's measures, its reason naming it.

`modes="auto"` searches resident layouts, and phased ones only when no resident one
fits (phased execution is "because the weights do not fit": MISSION.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from shardemu.allocation import fewer_collections
from shardemu.config import ConfigError, ModelConfig, Parallelism
from shardemu.errors import CapacityError
from shardemu.models import Model, as_model
from shardemu.parallel.rules import Rules
from shardemu.predict.ahead import CountsAhead
from shardemu.predict.bounds import Bounds
from shardemu.predict.hardware import Hardware
from shardemu.predict.layouts import (
    Candidate,
    Mode,
    Space,
    memory_ranks,
    mesh_order,
    phased_settings,
    resident_settings,
)
from shardemu.predict.plan import Plan
from shardemu.predict.plan_phased import check_fit
from shardemu.predict.planning import plan
from shardemu.predict.resident_count import CountKey, count_key, counted_microbatch
from shardemu.predict.rows import (
    Measures,
    SearchResult,
    SearchRow,
    Status,
    judged_row,
    mesh_pruned_row,
    refusal_row,
)


@dataclasses.dataclass
class Searcher(Bounds):
    """One search: its inputs, the bounds that prune it (`Bounds`), and a planner call
    per candidate (`plan`)."""

    log: Callable[[str], None] = lambda _: None
    ahead: CountsAhead | None = None  # the counts being made in the background
    # the resident layouts that may need each count queued ahead (`resident_counts`)
    _needs: dict[CountKey, list[Candidate]] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )

    def plan(self, c: Candidate, microbatches: int) -> Plan:
        """The planner's plan of `c` with `microbatches` microbatches (or passes)."""
        if c.mode == "resident" and self.ahead is not None:
            self.ahead.ready(self.count_of(c))
        resident = {"recompute": c.recompute, "attention": self.space.attention}
        return plan(
            self.model,
            c.par,
            self.train_config(c, microbatches),
            self.hardware,
            phased=c.phased_config(self.hardware.device_memory_bytes),
            microbatch_size=c.microbatch_size,
            overlap=self.space.overlap,
            rules=self.rules,
            must_fit=True,
            band=False,  # ranked by the step alone: no band's ends timed
            **(resident if c.mode == "resident" else {}),
        )

    def count_of(self, c: Candidate) -> CountKey:
        """The microbatch count resident candidate `c`'s plans use."""
        return count_key(
            self.model,
            c.par,
            c.microbatch_size,
            self.seq,
            c.recompute,
            c.precision,
            self.space.attention,
            self.resident_rules(c.par),
        )

    def screen(self, c: Candidate) -> SearchRow:
        """`c` planned with its step's microbatches: a long periodic step timed by the
        planner from two short ones (`periodic.py`, status `extrapolated`; module
        docstring), a short one whole (`planned`)."""
        m = self.microbatches(c)
        twin = self.twins.of(c) if c.mode == "resident" else None
        if twin is not None:  # one step: its measures (`twins.py`)
            why = f"the step of {twin.label}: the same counts, layout and rates"
            row = SearchRow.of(c, twin.status, microbatches=m, measures=twin.measures, reason=why)
        else:
            try:
                planned = self.plan(c, m)
            except (CapacityError, ConfigError) as err:
                return refusal_row(c, m, err)
            how: Status = "extrapolated" if "period" in planned.report else "planned"
            row = judged_row(c, m, Measures.of(planned.prediction, m), how)  # type: ignore[arg-type]
            if c.mode == "resident":
                self.twins.add(c, row)
        if row.fits:
            self.found.append(row)
        return row

    def outpaced(self, c: Candidate) -> SearchRow | None:
        """Prune 6 (module docstring): resident `c`'s row when the layouts found so far
        are faster than its busiest stream and one of them holds no more (`beaten`),
        its microbatch counted but no step timed; else None."""
        if len(self.found) < self.top:
            return None  # nothing counted
        if self.ahead is not None:
            self.ahead.ready(self.count_of(c))
        least = self.least_resident(c)
        if least is None:
            return None  # `screen` says why
        return self.beaten(c, *least, "its busiest stream's seconds")

    def candidates(
        self, par: Parallelism, modes: tuple[Mode, ...], precision: str, size: int
    ) -> list[Candidate]:
        """`par`'s candidates at one precision and microbatch size."""
        base = {
            "pipe": par.pipe,
            "tensor": par.tensor,
            "replica": par.replica,
            "context": par.context,
            "microbatch_size": size,
            "precision": precision,
        }
        return [
            Candidate(**base, **s)
            for mode in modes
            for s in (
                resident_settings(
                    par, self.model.cfg.num_layers, self.space.zero_stages, self.space.attention
                )
                if mode == "resident"
                else phased_settings(par, self.model.cfg.num_layers)
            )
        ]

    def check(self, c: Candidate) -> SearchRow | None:
        """Phased `c`'s full step judged by its memory alone (`check_fit`): its row when
        it does not fit (prune 2) or is refused; None when it fits, its pieces then
        compiling in the background for `screen`."""
        m = self.microbatches(c)
        # the plan `screen` judges the step's memory by: m passes, or 2p
        train = self.train_config(c, min(m, 2 * c.pipe))
        phased = c.phased_config(self.hardware.device_memory_bytes)
        try:
            check_fit(
                self.model, c.par, train, phased, self.hardware, c.microbatch_size, self.rules
            )
        except (CapacityError, ConfigError) as err:
            return refusal_row(c, m, err)
        return None

    def check_group(self, group: list[Candidate]) -> list[SearchRow | Candidate]:
        """One mesh, precision and microbatch size's candidates: the resident ones
        screened, the phased ones judged by memory (`check`), each a row, or the
        candidate itself where it fits and is left for `finish` to screen. Prune 4:
        phased settings are judged least device memory first (`layouts.memory_ranks`); one
        that holds at least what a setting that did not fit holds, in every respect,
        is not planned."""
        out: list[SearchRow | Candidate] = [
            self.behind(c) or self.outpaced(c) or self.screen(c)
            for c in group
            if c.mode == "resident"
        ]
        failed: list[tuple[int, tuple[int, ...], str]] = []  # (rts, ranks, label)
        for c in sorted((c for c in group if c.mode == "phased"), key=memory_ranks):
            ranks = memory_ranks(c)
            worse = next(
                (
                    label
                    for rts, f, label in failed
                    if rts == c.rts and all(a >= b for a, b in zip(ranks, f, strict=True))
                ),
                None,
            )
            if worse is not None:
                why = f"holds at least what {worse} holds on the device, which does not fit"
                out.append(SearchRow.of(c, "pruned", reason=why))
                continue
            row = self.check(c)
            out.append(c if row is None else row)
            if row is not None and row.status == "does not fit":
                failed.append((c.rts, ranks, c.label))
        return out

    def finish(self, checked: list[SearchRow | Candidate]) -> None:
        """Screen, in place, the candidates `check_group` left: their pieces have been
        compiling since it judged their memory."""
        checked[:] = [self.screen(x) if isinstance(x, Candidate) else x for x in checked]

    def resident_counts(
        self, modes: tuple[Mode, ...], precisions: tuple[str, ...]
    ) -> Iterator[tuple[CountKey, ...]]:
        """The microbatch counts (`count_key`) the resident layouts of `modes` may
        need (those of layouts whose least bytes fit: `may_fit`), in the order the
        search plans them (prune 3 may leave the last unused), a group per mesh and
        microbatch size: yielded as found, so that counting starts while the later
        layouts' bounds are worked out. Each count first appears in the group of its
        first layout; every layout that may need it is kept (`_needs`) for
        `count_wanted`."""
        for par, precision, pruned, sizes in self.mesh_plans(modes, precisions):
            for size in sizes if "resident" in modes and "resident" not in pruned else []:
                group: dict[CountKey, None] = {}
                for c in self.candidates(par, ("resident",), precision, size):
                    if self.may_fit(c):
                        key = self.count_of(c)
                        if key not in self._needs:
                            group[key] = None
                        self._needs.setdefault(key, []).append(c)
                if group:  # a recomputing count after one that keeps residuals, whose
                    # counted forward lays them out for it (`recompute_flops`)
                    yield tuple(sorted(group, key=lambda k: k.full))

    def count_wanted(self, key: CountKey) -> bool:
        """Whether a count queued ahead is still needed when its turn comes: some
        layout that uses it may still fit and is not yet ruled out by prune 5 (`may_fit`:
        the layouts found since it was queued may rule them all out, and then are found
        before those layouts are reached, so no count of theirs is asked for)."""
        return any(self.may_fit(c) for c in self._needs.get(key, ()))

    def run_mode(
        self, modes: tuple[Mode, ...], rows: list[SearchRow], precisions: tuple[str, ...]
    ) -> None:
        """Search `modes`' layouts in `precisions` (one rate class) into `rows`, their
        counts queued to be made ahead. A group's fitting phased layouts are screened
        after the next group is judged, so their pieces compile meanwhile."""
        if self.ahead is not None:
            self.ahead.add(self.resident_counts(modes, precisions))
        groups: list[tuple[Parallelism, list[SearchRow | Candidate]]] = []
        waiting: list[SearchRow | Candidate] = []  # judged, its pieces compiling

        def fit(x: SearchRow | Candidate) -> bool:
            return isinstance(x, Candidate) or x.fits

        def bounded(x: SearchRow | Candidate) -> bool:  # pruned by prune 5
            return isinstance(x, SearchRow) and x.least_step_time_s is not None

        for par, precision, pruned, sizes in self.mesh_plans(modes, precisions):
            groups.append(
                (par, [mesh_pruned_row(par, precision, m, why) for m, why in pruned.items()])
            )
            use = tuple(m for m in modes if m not in pruned)
            for size in sizes if use else []:
                checked = self.check_group(self.candidates(par, use, precision, size))
                groups.append((par, checked))
                self.finish(waiting)
                waiting = checked
                if not any(fit(x) or bounded(x) for x in checked):
                    break  # prune 3: larger microbatches fit no better
            if precision == precisions[-1]:
                fits = len(self.found) + sum(isinstance(x, Candidate) for x in waiting)
                self.log(f"{par} {'/'.join(precisions)}: {fits} layouts fit so far")
        self.finish(waiting)
        groups.sort(key=lambda g: mesh_order(g[0]))  # listed so, whatever the search's order
        rows += [row for _, group in groups for row in group]  # type: ignore[misc]


@fewer_collections()
def search(
    model: Model | ModelConfig,
    hardware: Hardware,
    devices: int,
    batch: int,
    seq: int,
    space: Space,
    top: int = 5,
    log: Callable[[str], None] = lambda _: None,
    rules: Rules | None = None,
) -> SearchResult:
    """Search the layouts (module docstring): every candidate's row, the best `top`
    planned at the full batch (`top`, fastest first), and the memory/time Pareto front.
    `model` is a `Model` (your own family's included) or a registered family's config;
    every layout shards it by `rules` (Megatron-LM's by default). Needs the most virtual
    devices any planned mesh does (`run.verify.search_devices`)."""
    t0 = time.perf_counter()
    if top < 1:
        raise ConfigError(f"`top` must be a positive number of layouts, got {top}")
    model = as_model(model)
    model.check_rules(rules)
    s = Searcher(model, hardware, devices, batch, seq, space, top, rules, log=log)
    rows: list[SearchRow] = []
    order: dict[str, tuple[Mode, ...]] = {
        "auto": ("resident",),
        "resident": ("resident",),
        "phased": ("phased",),
        "both": ("resident", "phased"),
    }
    with CountsAhead(counted_microbatch, wanted=s.count_wanted) as s.ahead:
        for precisions in s.rate_classes():
            s.run_mode(order[space.modes], rows, precisions)
        if space.modes == "auto" and not any(r.fits for r in rows):
            log("no resident layout fits: searching phased layouts")
            for precisions in s.rate_classes():
                s.run_mode(("phased",), rows, precisions)
        fitting = sorted((r for r in rows if r.fits), key=lambda r: r.step_time_s)
        if not fitting:
            raise CapacityError(
                f"no layout of {s.model.name} on {devices} x {hardware.name} fits its "
                f"memory ({len(rows)} tried, Space.modes {space.modes}); use more devices, "
                f"a smaller `batch` or `seq`, or Space.modes both"
            )
        # screened with the planner's own plan of the full step (`screen`): the numbers
        # the table shows
        best = [
            dataclasses.replace(row, status="planned", screened_step_time_s=row.step_time_s)
            for row in fitting[:top]
        ]
    best.sort(key=lambda r: r.step_time_s)
    return SearchResult(
        s.model.name, hardware.name, devices, batch, seq, s.params, space, tuple(best),
        tuple(rows), time.perf_counter() - t0,
    )  # fmt: skip
