"""`shardemu search` against brute force: every layout of a tiny GPT on 4 devices planned
whole with `plan_resident`, the fitting ones ranked; the search (pruning, two short
plans extrapolated) must find the same layouts fitting (timed, or bounded by a step
they take at least), the same step times, the same winner, top and Pareto front. Then
the command line end to end, with the winner trained scaled down against one device."""

import dataclasses
import itertools
import json

import pytest
from cli_helpers import shardemu

from shardemu.accounting import flops
from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.models import Model, custom_model
from shardemu.pipelined.layout import EVEN
from shardemu.predict.bounds import Bounds
from shardemu.predict.layouts import Candidate, Space
from shardemu.predict.memory_bound import memory_bound
from shardemu.predict.overlap import DEFAULT_OVERLAP
from shardemu.predict.plan_resident import counted_layout, plan_resident
from shardemu.predict.profiles import PROFILES
from shardemu.predict.resident_count import counted_microbatch
from shardemu.predict.resident_memory import device_bytes, resident_layout
from shardemu.predict.roofline import least_step_seconds
from shardemu.predict.search import Searcher, search
from shardemu.predict.zero import zero
from shardemu.run.verify import scaled_down

DEVICES, BATCH, SEQ = 4, 16, 32
# the model `--model gpt --layers 4 --hidden 32 --heads 4 --vocab 64` builds, so the
# command-line test reuses the counts
TINY = custom_model("gpt", 4, 32, 4, 64, SEQ)
# device memory between the smallest layout's (1.4 MB) and the largest's (3.2 MB):
# about half the layouts do not fit, and pruning has work to do
MEMORY_GB = 0.0021  # all of it handed out: the tests' thresholds are the allocator's
HW = dataclasses.replace(
    PROFILES["a100-80gb"], name="a100-small", device_memory_gb=MEMORY_GB, memory_fragmentation=0.0
)
# phased on 1 x 1 x 2, one phase: 1.08 MB with offloaded activations (a phase's weights
# and gradients, the optimizer in the host or on the device), 2.5 MB keeping activations
PHASED_GB = 0.0011
# tensor 4 and microbatches of 2 add counts (4.8 s each) but no new kind of layout: the
# suite's time matters
SPACE = Space(precisions=("bf16",), modes="resident", max_tensor=2, max_microbatch=1)
# compute-bound (a slow peak, FP32 at half of it): FP32 layouts come out behind BF16's
SLOW = dataclasses.replace(HW, name="a100-slow", peak_tflops=1e-3, fp32_tflops=5e-4)
# a `top` no search here fills: prunes 5 and 6 never fire, every fitting layout is timed
ALL = 1000


@pytest.fixture(scope="module")
def searched():
    return search(TINY, HW, DEVICES, BATCH, SEQ, SPACE, top=3)


def brute_force(precision: str = "bf16", hw=HW) -> dict[str, dict]:
    """Every resident layout in the search's space, planned whole: label -> report."""
    out = {}
    for p, t in itertools.product((1, 2, 4), (1, 2)):
        if DEVICES % (p * t):
            continue
        r = DEVICES // (p * t)
        schedules = [("1f1b", 1)] + ([("interleaved", 2)] if p > 1 else [])
        for b, (schedule, v), rec in itertools.product(
            (1,), schedules, ("none", "selective", "full")
        ):
            try:
                train = TrainConfig(
                    batch=BATCH, seq=SEQ, schedule=schedule, virtual=v, precision=precision
                )
                report = plan_resident(
                    TINY, Parallelism(p, t, r), train, b, hw, rec, extrapolate=False
                ).report
            except ConfigError:  # interleaved with microbatches pipe does not divide
                continue
            name = f"{schedule}x{v}" if v > 1 else schedule
            out[f"p{p} t{t} r{r} b{b} {precision} {name} recompute={rec}"] = report
    return out


def test_search_finds_what_brute_force_finds(searched):
    brute = brute_force()
    fits = {k: r for k, r in brute.items() if r["memory_per_device"]["device"]["fits"]}
    assert 0 < len(fits) < len(brute)  # the memory limit bites
    rows = {r.label: r for r in searched.candidates if r.fits}
    # prune 6: fitting layouts not timed, by their busiest stream's seconds
    bounded = {r.label: r for r in searched.candidates if r.least_step_time_s is not None}
    assert bounded and all("busiest stream" in r.reason for r in bounded.values())
    assert set(rows) | set(bounded) == set(fits) and not set(rows) & set(bounded)
    for label, row in bounded.items():
        assert fits[label]["step_time_s"] >= row.least_step_time_s
        assert fits[label]["memory_per_device"]["device"]["bytes"] == row.device_bytes_at_least
    for label, row in rows.items():  # extrapolated or planned whole: the same step
        report = fits[label]
        assert row.step_time_s == pytest.approx(report["step_time_s"], rel=1e-9)
        assert row.device_bytes == report["memory_per_device"]["device"]["bytes"]
    assert any(r.status == "extrapolated" for r in rows.values())
    unfit = {r.label: r for r in searched.candidates if r.status == "does not fit"}
    # not timed, but their memory is the planner's, or found over the memory already by
    # its lower bound (nothing compiled)
    assert any(r.device_bytes_at_least is not None for r in unfit.values())
    for label, row in unfit.items():
        needed = brute[label]["memory_per_device"]["device"]["bytes"]
        assert (row.device_bytes or needed) == needed
        assert HW.device_memory_bytes < (row.device_bytes_at_least or needed) <= needed
        assert row.measures is None and "step_time_s" not in row.to_json()
    winner = min(fits, key=lambda k: fits[k]["step_time_s"])
    assert searched.best.label == winner
    assert [r.label for r in searched.top] == sorted(fits, key=lambda k: fits[k]["step_time_s"])[:3]
    whole = [
        {"label": k, "step_time_s": r["step_time_s"],
         "device_bytes": r["memory_per_device"]["device"]["bytes"]}
        for k, r in fits.items()
    ]  # fmt: skip
    assert {r.label for r in searched.pareto} == undominated(whole)


@pytest.mark.parametrize(
    "par, schedule, recompute, zero",
    [
        (Parallelism(1, 1, 1), "1f1b", "none", 0),  # one device: its step is its compute
        (Parallelism(2, 1, 2), "1f1b", "full", 0),
        (Parallelism(2, 2, 1), "interleaved", "selective", 0),
        (Parallelism(1, 2, 2), "1f1b", "none", 3),
        (Parallelism(4, 1, 1), "1f1b", "none", 0),  # the fill and drain bound it
    ],
)
def test_least_step_bounds_the_plan(par, schedule, recompute, zero):
    """Prune 6's bound (`CountedLayout.least_step`) against the plan timed whole: its busiest
    stream's seconds at most the step, equal to it on one device (nothing to wait for),
    and the plan's own device bytes. Prune 5's pipeline bound (`fill_and_drain`, nothing
    compiled) at most prune 6's, and over the precision's least step where the bubble
    is large (4 stages, 4 microbatches)."""
    virtual = 2 if schedule == "interleaved" else 1
    train = TrainConfig(
        batch=BATCH, seq=SEQ, schedule=schedule, virtual=virtual, precision="bf16", zero=zero
    )
    hw = PROFILES["a100-80gb"]
    layout = counted_layout(
        TINY, par, train, 1, hw, recompute, DEFAULT_OVERLAP, "materialized", True, None
    )
    least, held = layout.least_step(par, DEFAULT_OVERLAP), layout.held
    report = plan_resident(TINY, par, train, 1, hw, recompute, extrapolate=False, band=False).report
    assert held == report["memory_per_device"]["device"]["bytes"]
    if par.num_devices == 1:
        assert least == pytest.approx(report["step_time_s"], rel=1e-12)
    else:
        assert 0 < least < report["step_time_s"]
    bounds = Bounds(Model(TINY), hw, par.num_devices, BATCH, SEQ, SPACE)
    c = Candidate(par.pipe, par.tensor, par.replica, 1, "bf16", schedule=schedule,
                  virtual=virtual, recompute=recompute, zero=zero)  # fmt: skip
    assert 0 < bounds.fill_and_drain(c) <= least
    if par.pipe == 4:  # a bubble of 3 microbatches in 4: more than the head's FLOPs
        assert bounds.fill_and_drain(c) > bounds.least_step("bf16")


def test_memory_bound_holds_the_counts_device_bytes():
    """`memory_bound` (traced) against `counted_microbatch` (compiled): the weights' and
    optimizer state's bytes equal, and so each layout's device bytes from either (what a
    layer keeps is the target's: `resident_memory.kept`), with and without full
    recomputation, materialized or fused attention, on one and two tensor devices,
    under ZeRO 0 and 3."""
    for tensor, recompute, attention in itertools.product(
        (1, 2), ("none", "full"), ("materialized", "fused")
    ):
        par = Parallelism(pipe=2, tensor=tensor, replica=2)
        lay, sched, key = resident_layout(
            Model(TINY), par, BATCH, SEQ, 1, "1f1b", 1, recompute, "bf16", attention, EVEN
        )  # fmt: skip
        bound, counted = memory_bound(key), counted_microbatch(key)
        assert (bound.layer_bytes, bound.shared_bytes, bound.opt_bytes, bound.act_bytes) == (
            counted.layer_bytes, counted.shared_bytes, counted.opt_bytes, counted.act_bytes
        )  # fmt: skip
        for stage in (0, 3):
            held = [
                device_bytes(zero(mb, stage, par), key, recompute, par, lay, sched)
                for mb in (bound, counted)
            ]
            assert held[0] == held[1] > 0


def test_slower_precision_pruned_by_its_bound_changes_no_result():
    """Prune 5 on a compute-bound profile where FP32 computes at half BF16's rate: the
    search with both precisions finds brute force's top 3 and Pareto front over both,
    and each layout it did not plan takes at least its bound's time and bytes, and is
    beaten by the layout the reason names. Every planned layout's step is at least its
    model FLOPs at the compute rate (`least_step_seconds`)."""
    space = dataclasses.replace(SPACE, precisions=("fp32", "bf16"))
    got = search(TINY, SLOW, DEVICES, BATCH, SEQ, space, top=3)
    brute = {**brute_force("fp32", SLOW), **brute_force("bf16", SLOW)}
    model_flops = flops.training_step(Model(TINY), BATCH, SEQ)
    for label, report in brute.items():
        hw = SLOW.at_precision(label.split()[4])
        assert report["step_time_s"] >= least_step_seconds(model_flops, DEVICES, hw)
    rows = [
        {"label": k, "fits": r["memory_per_device"]["device"]["fits"],
         "step_time_s": r["step_time_s"], "device_bytes": r["memory_per_device"]["device"]["bytes"]}
        for k, r in brute.items()
    ]  # fmt: skip
    fits = sorted((r for r in rows if r["fits"]), key=lambda r: r["step_time_s"])
    assert [r.label for r in got.top] == [r["label"] for r in fits[:3]]
    assert {r.label for r in got.pareto} == undominated(fits)
    behind = [r for r in got.candidates if r.least_step_time_s is not None]
    by_rate = [r for r in behind if "model FLOPs" in r.reason]  # prune 5, not 6
    assert by_rate and all(r.precision == "fp32" for r in by_rate)
    for row in behind:
        report = brute[row.label]
        assert report["step_time_s"] >= row.least_step_time_s
        assert report["memory_per_device"]["device"]["bytes"] >= row.device_bytes_at_least


def undominated(rows: list[dict]) -> set[str]:
    """The labels of `rows` (label, device_bytes, step_time_s) no other row beats on
    memory and time, one at least strictly: the Pareto front by its definition."""
    return {
        r["label"]
        for r in rows
        if not any(
            o["device_bytes"] <= r["device_bytes"]
            and o["step_time_s"] < r["step_time_s"]
            or o["device_bytes"] < r["device_bytes"]
            and o["step_time_s"] <= r["step_time_s"]
            for o in rows
        )
    }


def test_pareto_front_is_the_undominated_layouts(searched):
    fitting = [r.to_json() for r in searched.candidates if r.fits]
    assert {r.label for r in searched.pareto} == undominated(fitting)


@pytest.mark.slow  # plans or trains for real
def test_search_command_writes_its_files_and_verifies_the_winner(searched, tmp_path):
    profile = tmp_path / "small.json"
    profile.write_text(json.dumps({"base": "a100-80gb", "name": "a100-small",
                                   "device_memory_gb": MEMORY_GB,
                                   "memory_fragmentation": 0.0}))  # fmt: skip
    out = tmp_path / "search"
    done = shardemu(
        "search", "--model", "gpt", "--layers", "4", "--hidden", "32", "--heads", "4",
        "--vocab", "64", "--hardware", str(profile), "--devices", str(DEVICES),
        "--batch", str(BATCH), "--seq", str(SEQ), "--precision", "bf16",
        "--max-microbatch", "1", "--max-tensor", "2", "--modes", "resident", "--top", "3",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "search.json").read_text())
    assert result["best"]["label"] == searched.best.label
    assert len(result["candidates"]) == len(searched.candidates)
    assert {k: v for k, v in result.items() if k not in ("elapsed_s", "verification")} == {
        k: v for k, v in json.loads(json.dumps(searched.to_json())).items() if k != "elapsed_s"
    }  # search.json is the search's own to_json(), whole
    check = result["verification"]
    assert check["equal"], check
    assert check["mesh"] == str(Parallelism(
        result["best"]["pipe"], result["best"]["tensor"], min(result["best"]["replica"], 2)
    ))  # fmt: skip
    assert len(check["losses"]) == len(check["losses_one_device"]) == check["steps"]
    assert (out / "pareto.png").stat().st_size > 10_000
    assert searched.best.label in done.stdout


@pytest.mark.slow  # plans or trains for real
def test_phased_pruning_drops_only_layouts_that_do_not_fit():
    """Phased settings of one mesh (rts 1; activations offloaded or kept, the optimizer
    in the host or on the device, prefetch or not) screened by the search, and each one
    it pruned (prune 4: it holds at least what a setting that did not fit holds) planned
    whole: none of those fits."""
    par, hw = Parallelism(1, 1, 2), dataclasses.replace(HW, device_memory_gb=PHASED_GB)
    s = Searcher(Model(TINY), hw, par.num_devices, BATCH, SEQ, Space(("fp32",), "phased"))
    group = [
        c for c in s.candidates(par, ("phased",), "fp32", 2)
        if c.rts == 1 and c.activations in ("offload", "keep")
    ]  # fmt: skip
    checked = s.check_group(group)
    s.finish(checked)
    rows = {r.label: r for r in checked}
    pruned = [c for c in group if rows[c.label].status == "pruned"]
    assert len(pruned) == 3  # behind the keep setting that does not fit: the other three
    assert sum(1 for r in rows.values() if r.fits) == 4
    for c in pruned:
        assert not s.screen(c).fits, c.label


def test_a_layout_whose_full_step_has_no_schedule_is_refused_not_fatal(searched):
    """Interleaved 1F1B over pipe 2 needs microbatches in multiples of 2: with batch 10
    on 2 replicas (5 microbatches) its two short plans (2 and 4 microbatches) exist, its
    full step does not. It is a refused row; the search goes on to its top (it once
    extrapolated such a layout into the top, then stopped planning it whole)."""
    space = dataclasses.replace(SPACE, max_tensor=1)
    got = search(TINY, HW, DEVICES, 10, SEQ, space, top=20)
    refused = [r for r in got.candidates if r.status == "refused"]
    assert refused and all("interleaved" in r.label and r.par.pipe == 2 for r in refused)
    assert all("microbatches divisible by stages" in r.reason for r in refused)
    assert got.top and all("interleaved" not in r.label or r.par.pipe != 2 for r in got.top)


def test_zero_stages_are_searched_and_found_as_their_plans(searched):
    """The same space at ZeRO stages 0 and 3 (`Space.zero_stages`): every layout of
    several replicas once more at stage 3 (no new count: ZeRO changes no microbatch),
    each fitting one's step time and device bytes those of its whole plan, and none
    holding more than its stage-0 twin."""
    space = dataclasses.replace(SPACE, zero_stages=(0, 3))
    result = search(TINY, HW, DEVICES, BATCH, SEQ, space, top=ALL)
    staged = {r.label: r for r in result.candidates if r.candidate and r.candidate.zero == 3}
    plain = {r.label: r for r in searched.candidates}
    assert staged and all(r.par.replica > 1 for r in staged.values())
    assert len(result.candidates) == len(searched.candidates) + len(staged)
    for label, row in staged.items():
        twin = plain[label.replace(" zero=3", "")]
        if not row.fits:
            continue
        c = row.candidate
        train = c.train_config(BATCH, SEQ)
        report = plan_resident(TINY, c.par, train, c.microbatch_size, HW, c.recompute).report
        assert row.step_time_s == pytest.approx(report["step_time_s"], rel=1e-9)
        assert row.device_bytes == report["memory_per_device"]["device"]["bytes"]
        assert not twin.fits or row.device_bytes <= twin.device_bytes
    fit_before = sum(r.fits or r.least_step_time_s is not None for r in searched.candidates)
    assert sum(r.fits for r in result.candidates) > fit_before


def test_context_sizes_are_searched_and_found_as_their_plans(searched):
    """The same space at context sizes 1 and 2 (`Space.context_sizes`): the layouts
    without context are the plain search's, and each of context 2 is a mesh of all the
    devices, its row's step time and device bytes those of its whole plan."""
    space = dataclasses.replace(SPACE, context_sizes=(1, 2))
    result = search(TINY, HW, DEVICES, BATCH, SEQ, space, top=ALL)
    split = [r for r in result.candidates if r.candidate and r.candidate.context == 2]
    assert split and all(" c2 " in r.label and r.par.num_devices == DEVICES for r in split)
    rest = {r.label for r in result.candidates} - {r.label for r in split}
    assert rest == {r.label for r in searched.candidates}
    fitting = [r for r in split if r.fits]
    assert fitting
    for row in fitting:
        c = row.candidate
        train = c.train_config(BATCH, SEQ)
        report = plan_resident(TINY, c.par, train, c.microbatch_size, HW, c.recompute).report
        assert row.step_time_s == pytest.approx(report["step_time_s"], rel=1e-9)
        assert row.device_bytes == report["memory_per_device"]["device"]["bytes"]


def test_layers_that_split_only_with_their_ends_are_searched_as_their_plans(searched):
    """A 2-layer GPT on the same 4 devices: pipe 4 (1F1B) and pipe 2 interleaved (4
    chunks) split its layers alone unevenly, but the layers with the embedding and the
    loss counted as one each make 4 (Megatron-Core's `account_for_*_in_pipeline_split`,
    as Llama 3 405B's 126 layers make 128 chunks): those layouts are searched so split
    (`Candidate.ends_in_split`), each fitting one's step time and device bytes those of
    its whole plan; a layout whose layers split alone is never split so. (Its layer is
    TINY's: the counts are the plain search's.)"""
    two = TINY.replace(num_layers=2)
    result = search(two, HW, DEVICES, BATCH, SEQ, SPACE, top=ALL)
    rows = [r for r in result.candidates if r.candidate]
    ends = [r for r in rows if r.candidate.ends_in_split]
    assert {(r.par.pipe, r.candidate.schedule) for r in ends} == {(4, "1f1b"), (2, "interleaved")}
    assert all(2 % (r.par.pipe * r.candidate.virtual) == 0 for r in rows if r not in ends)
    fitting = [r for r in ends if r.fits]
    assert fitting and all("ends-in-split" in r.label for r in ends)
    for row in fitting:
        c = row.candidate
        train = c.train_config(BATCH, SEQ)
        assert train.account_for_embedding_in_pipeline_split
        report = plan_resident(two, c.par, train, c.microbatch_size, HW, c.recompute).report
        assert row.step_time_s == pytest.approx(report["step_time_s"], rel=1e-9)
        assert row.device_bytes == report["memory_per_device"]["device"]["bytes"]
        # a winner so split is verified so split: two units a chunk, less the two ends
        tiny, _ = scaled_down(two, c)
        assert tiny.num_layers == 2 * c.pipe * c.virtual - 2


def test_sequence_parallelism_and_chunked_overlap_reach_every_resident_plan():
    """`Space.sequence_parallel` puts sequence parallelism into each resident layout's
    training settings, and its rules into the counts and memory bounds the search
    makes for it; chunked tensor overlap without it is refused, naming both."""
    from shardemu.parallel.rules import megatron_rules
    from shardemu.predict.overlap import Overlap

    space = dataclasses.replace(
        SPACE, sequence_parallel=True, overlap=Overlap(tp_overlap="chunked")
    )
    s = Searcher(Model(TINY), HW, DEVICES, BATCH, SEQ, space)
    (c, *_) = s.candidates(Parallelism(1, 2, 2), ("resident",), "bf16", 1)
    assert s.train_config(c, 2).sequence_parallel
    assert s.count_of(c).rules == megatron_rules(sequence_parallel=True)
    with pytest.raises(ConfigError, match="search with Space.sequence_parallel, or Overlap"):
        dataclasses.replace(SPACE, overlap=Overlap(tp_overlap="chunked"))


def test_selective_op_is_searched_where_the_attention_core_is_fused(searched):
    """TorchTitan's selective-op checkpointing saves the fused attention core's output,
    so the search tries it with `attention` fused (`layouts.resident_settings`) and never
    with the materialized scores: with fused attention, every layout searched at
    selective recomputation is searched at selective-op too, each fitting one's step time
    and device bytes those of its whole plan."""
    assert not [r for r in searched.candidates if "selective-op" in r.label]
    space = dataclasses.replace(SPACE, attention="fused", max_tensor=1)
    result = search(TINY, HW, DEVICES, BATCH, SEQ, space, top=3)
    labels = {r.label for r in result.candidates}
    ops = [r for r in result.candidates if "recompute=selective-op" in r.label]
    assert ops and {r.label.replace("selective-op", "selective") for r in ops} == {
        label for label in labels if label.endswith("recompute=selective")
    }
    fitting = [r for r in ops if r.fits]
    assert fitting
    for row in fitting:
        c = row.candidate
        report = plan_resident(
            TINY, c.par, c.train_config(BATCH, SEQ), c.microbatch_size, HW, c.recompute,
            attention="fused",
        ).report  # fmt: skip
        assert row.step_time_s == pytest.approx(report["step_time_s"], rel=1e-9)
        assert row.device_bytes == report["memory_per_device"]["device"]["bytes"]


def test_a_pipeline_bound_holds_its_fill_and_drain():
    """On four stages of one device each, a whole step's busy streams
    (`step_bound.busy_streams`, the plan's own ledger): each stage's chain with the
    earlier stages' first and last slots added is longer than its chain with the
    updates after the slots, and no longer than the step."""
    from shardemu.predict.step_bound import busy_streams

    par, hw = Parallelism(4, 1, 1), PROFILES["a100-80gb"]
    train = TrainConfig(batch=BATCH, seq=SEQ, precision="bf16")
    planned = plan_resident(TINY, par, train, 1, hw, "none", extrapolate=False, band=False)
    busy = busy_streams(planned.ledger, hw.at_precision("bf16"), par)
    assert {(s, "pipeline") for s in range(4)} <= set(busy)
    for stage in (1, 2, 3):  # the first stage has no stage before it to wait for
        assert busy[(stage, "chain")] < busy[(stage, "pipeline")]
    assert max(busy.values()) <= planned.report["step_time_s"]
    # the step is the last stage's chain, filled and drained, and what the stages wait
    # on besides (their sends): the bound is most of it
    assert busy[(3, "pipeline")] > 0.5 * planned.report["step_time_s"]


def test_a_twin_at_another_precision_is_its_own_plan():
    """BF16 and FP16 layouts count alike (`count_key`) and the A100 runs both at one
    rate: the search times one of each pair and gives the other its measures
    (`twins.py`). Each twin's step and device bytes equal its own plan, timed whole at
    its precision."""
    space = dataclasses.replace(SPACE, precisions=("bf16", "fp16-mixed"), max_tensor=1)
    got = search(TINY, HW, DEVICES, BATCH, SEQ, space, top=ALL)
    twins = [r for r in got.candidates if r.reason and r.reason.startswith("the step of")]
    assert twins and all(r.precision == "fp16-mixed" for r in twins)
    for row in twins[:4]:
        c = row.candidate
        train = c.train_config(BATCH, SEQ)
        report = plan_resident(TINY, c.par, train, c.microbatch_size, HW, c.recompute).report
        assert row.step_time_s == pytest.approx(report["step_time_s"], rel=1e-9)
        assert row.device_bytes == report["memory_per_device"]["device"]["bytes"]


def test_a_deep_pipeline_behind_a_found_layout_is_pruned_uncounted():
    """Prune 5's pipeline bound at GPT-3 175B's size, nothing compiled: 96 stages of
    one layer at tensor 1 and 8-sequence microbatches (12 a replica) take at least
    (12 + 95) / 12 of their last stage's share, far over the model's least step; once a
    layout found (here, a row as the search records one) is faster and no larger, the
    deep one is pruned with that bound as its reason, before its microbatch is counted.
    A single stage has no bubble: its layers' and head's least FLOPs are the model's,
    and its bound the precision's least step."""
    from shardemu.models import get_preset
    from shardemu.predict.rows import Measures, SearchRow

    hw = PROFILES["a100-80gb"]
    bounds = Bounds(Model(get_preset("gpt3-175b")), hw, 1536, 1536, 2048, SPACE, top=1)
    deep = Candidate(96, 1, 16, 8, "bf16")
    least = bounds.least_step("bf16")
    assert bounds.fill_and_drain(deep) > 5 * least
    one_stage = bounds.fill_and_drain(Candidate(1, 8, 192, 1, "bf16", recompute="none"))
    assert one_stage == pytest.approx(least, rel=2e-6)
    assert bounds.behind(deep) is None  # nothing found yet
    fast = Candidate(16, 8, 12, 1, "bf16", schedule="interleaved", virtual=2)
    step, held = 2 * least, bounds.least_bytes(deep)
    measures = Measures(True, step, held, 0, 0.0, 0.0, {}, 128)
    bounds.found.append(SearchRow.of(fast, "planned", measures=measures))
    row = bounds.behind(deep)
    assert row is not None and row.status == "pruned" and "fill and drain" in row.reason
    assert row.least_step_time_s == bounds.fill_and_drain(deep)
