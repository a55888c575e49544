"""A long pipelined plan predicted from two short steps (`predict/periodic.py`) against
the same plan timed whole: every number of the report within 1e-9, for each periodic
schedule and the overlap settings that change when a stage waits; and the lazily
assembled ledger's file and totals against its placed events."""

import dataclasses
import json
import math

import pytest

from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger import Ledger
from shardemu.accounting.ledger_file import encode, read_events
from shardemu.config import Parallelism, PhasedConfig, TrainConfig
from shardemu.models import custom_model
from shardemu.predict.costmodel import build_timeline, step_seconds
from shardemu.predict.overlap import Overlap
from shardemu.predict.plan_phased import plan_phased
from shardemu.predict.plan_resident import plan_resident
from shardemu.predict.profiles import PROFILES
from shardemu.report.plandir import write_plan_dir

MODEL = custom_model("gpt", 8, 32, 4, 64, 32)
HW = PROFILES["a100-80gb"]
# (mesh, schedule, virtual, microbatches a replica, plan settings, train settings): a
# design over what changes how a stage waits, not their product
CASES = {
    "1f1b-bucketed": (Parallelism(pipe=2, replica=2), "1f1b", 1, 7, {}, {}),
    "interleaved-megatron": (
        Parallelism(pipe=2, replica=2), "interleaved", 2, 8,
        {"overlap": Overlap(grad_reduce="end", pipe_sends="blocking")}, {},
    ),
    # groups of 3 microbatches a chunk on 2 stages (Megatron-Core's
    # microbatch_group_size_per_vp_stage): from 3 and 6 microbatches
    "interleaved-grouped": (
        Parallelism(pipe=2, replica=2), "interleaved", 2, 9,
        {"overlap": Overlap(pipe_sends="blocking")}, {"microbatch_group": 3},
    ),
    "1f1b-fsdp-selective": (
        Parallelism(pipe=4, replica=2), "1f1b", 1, 11, {"recompute": "selective"}, {"zero": 3},
    ),
    "1f1b-tp-overlap": (
        Parallelism(pipe=2, tensor=2, replica=2), "1f1b", 1, 6,
        {"overlap": Overlap(tp_overlap="chunked"), "attention": "fused"},
        {"sequence_parallel": True, "precision": "bf16"},
    ),
}  # fmt: skip


def assert_close(a, b, path=""):
    """Every number of `a` within 1e-9 of `b`'s (relative), the rest equal."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15), (path, a, b)
    elif isinstance(a, list) and a and isinstance(a[0], float):  # a band's ends
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, f"{path}/{i}")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_plan_from_two_short_steps_equals_the_whole_plan(name):
    par, schedule, virtual, m, settings, train_settings = CASES[name]
    train = TrainConfig(
        batch=m * par.replica, seq=32, schedule=schedule, virtual=virtual, **train_settings
    )
    short = plan_resident(MODEL, par, train, 1, HW, **settings)
    whole = plan_resident(MODEL, par, train, 1, HW, **settings, extrapolate=False)
    period = short.report.pop("period")
    first = train_settings.get("microbatch_group", par.pipe)
    assert period["microbatches"] == m and period["predicted_from"][0] == first
    assert "period" not in whole.report
    for report in (short.report, whole.report):
        del report["elapsed_s"]
    assert_close(short.report, whole.report)
    assert short.report["breakdown"]["pipeline_bubble_s"] > 0  # a pipeline that waits
    # the timeline kept for the views is the longer short step's
    micro = {s.phase.micro for s in short.timeline.spans if s.phase.micro is not None}
    assert len(micro) == period["timeline_microbatches"] < m
    # the whole step's ledger: written from its slots as from its placed events
    assert isinstance(short.ledger, AssembledLedger)
    assert short.ledger.compact() == encode(whole.ledger.events)
    assert short.ledger.events == whole.ledger.events
    # timed from its slots' counted events as they are (`AssembledLedger.runs`), as from
    # its placed events: the same spans, each span's event the placed one but for its
    # phase and stage, which the span holds
    overlap = settings.get("overlap", Overlap())
    runs, placed = (
        build_timeline(x, HW, par, overlap) for x in (whole.ledger, whole.ledger.events)
    )
    assert runs.step_time_s == placed.step_time_s and runs.breakdown == placed.breakdown
    # a band's ends are timed without spans (`step_seconds`): the same step time
    assert all(
        step_seconds(x, HW, par, overlap) == runs.step_time_s
        for x in (whole.ledger, whole.ledger.events)
    )
    assert [s[:6] for s in runs.spans] == [s[:6] for s in placed.spans]
    # and as events each timed by itself, sharing no other's rules (a chunk's copies
    # of a piece, the placed copies of an event: `durations.rules_key`)
    alone = build_timeline([e.replaced() for e in whole.ledger.events], HW, par, overlap)
    assert [s[:6] for s in alone.spans] == [s[:6] for s in runs.spans]
    for a, b in zip(runs.spans, placed.spans, strict=True):
        assert dataclasses.replace(a.event, phase=a.phase, stage=a.stage) == b.event


def test_a_periodic_plans_run_directory_holds_the_whole_step_and_its_window(tmp_path):
    """`shardemu plan --out`'s files of a step timed from short ones: ledger.json reads
    back as the whole step's events, trace.json loads and holds the window's spans, and
    timeline.png is drawn."""
    par, train = Parallelism(pipe=2, replica=2), TrainConfig(batch=14, seq=32)
    planned = plan_resident(MODEL, par, train, 1, HW)
    write_plan_dir(tmp_path, planned)
    assert read_events(tmp_path / "ledger.json") == planned.ledger.events
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "X"]  # fmt: skip
    assert len(spans) == sum(s.duration > 0 for s in planned.timeline.spans)
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "config.json").read_text())["period"]["microbatches"] == 7


def test_a_phased_plan_of_many_passes_from_two_short_steps_equals_the_whole_plan():
    """Phased passes pipelined over pipe = 2 (1F1B), 6 passes, on one stage's devices."""
    par, cfg = Parallelism(pipe=2, replica=2), PhasedConfig(phases=4)
    train = TrainConfig(batch=12, seq=32)
    short = plan_phased(MODEL, par, train, cfg, hardware=HW, microbatch_size=1)
    whole = plan_phased(MODEL, par, train, cfg, hardware=HW, microbatch_size=1, extrapolate=False)
    assert short.report.pop("period")["microbatches"] == 6
    for report in (short.report, whole.report):
        del report["elapsed_s"]
    assert_close(short.report, whole.report)
    assert short.ledger.compact() == encode(whole.ledger.events)


def test_short_or_unperiodic_steps_are_timed_whole():
    """GPipe, and a 1F1B step of at most p + 1 microbatches, are not extrapolated."""
    par = Parallelism(pipe=2, replica=2)
    for schedule, m in (("gpipe", 8), ("1f1b", 3)):
        train = TrainConfig(batch=m * par.replica, seq=32, schedule=schedule)
        assert "period" not in plan_resident(MODEL, par, train, 1, HW).report


def test_an_assembled_ledgers_totals_need_no_placed_events():
    par = Parallelism(pipe=2, replica=2)
    train = TrainConfig(batch=16, seq=32, schedule="1f1b")
    ledger = plan_resident(MODEL, par, train, 1, HW).ledger
    summed = ledger.step_totals(0)
    assert ledger._events is None  # totalled slot list by slot list, nothing placed
    assert_close(summed, Ledger(ledger.events).step_totals(0))
