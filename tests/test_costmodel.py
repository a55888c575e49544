"""The cost model on hand-computed ledgers, hardware profiles, and the trace it writes.

The toy hardware makes arithmetic easy: 1 TFLOP/s at full efficiency, 1 GB/s to the host,
2 GB/s inside a 2-device node and 1 GB/s across nodes; every event is on one device."""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardemu.accounting.ledger import Event, Phase
from shardemu.config import ConfigError, Parallelism, PhasedConfig, TrainConfig
from shardemu.predict.costmodel import Span, Timeline, build_timeline
from shardemu.predict.hardware import Hardware, HardwareError
from shardemu.predict.prediction import predict
from shardemu.predict.profiles import PROFILES, get_hardware, load_profile
from shardemu.report.views import bar_columns, label_lanes, merged_bars, plot_timeline

HW = Hardware(
    name="toy", peak_tflops=1.0, device_memory_gb=1.0, host_memory_gb=10.0,
    host_link_gbps=1.0, intra_node_gbps=2.0, inter_node_gbps=1.0, devices_per_node=2,
    efficiency=1.0, host_tflops=1.0,
)  # fmt: skip
PAR = Parallelism(tensor=2, replica=2)
GB = 10**9


def F(i):  # the forward phase i
    return Phase("forward", i)


def fetch(phase, seconds, stage=0):
    return Event(0, phase, "h2d", "weights", bytes=int(seconds * GB), stage=stage)


def compute(phase, seconds, stage=0):
    return Event(0, phase, "compute", "", flops=seconds * 1e12, stage=stage)


def test_one_phase_waits_for_its_weights():
    t = build_timeline([fetch(F(0), 1), compute(F(0), 2)], HW, PAR)
    assert t.step_time_s == pytest.approx(3)
    assert t.breakdown["compute_s"] == pytest.approx(2)
    assert t.breakdown["exposed_transfer_s"] == pytest.approx(1)


def test_prefetch_hides_the_second_phase_weights():
    """fetch w0 | fetch w1 (prefetch) | fwd0 | fwd1: w1 streams in during fwd0."""
    events = [fetch(F(0), 1), fetch(F(1), 1), compute(F(0), 2), compute(F(1), 2)]
    t = build_timeline(events, HW, PAR)
    starts = [s.start for s in t.spans]
    assert starts == pytest.approx([0, 1, 1, 3])
    assert t.step_time_s == pytest.approx(5)
    assert t.breakdown["exposed_transfer_s"] == pytest.approx(1)


def test_bandwidth_bound_phases_wait_for_streaming():
    """Transfers of 3 s against 2 s of compute: the link sets the pace."""
    events = [fetch(F(0), 3), fetch(F(1), 3), compute(F(0), 2), compute(F(1), 2)]
    t = build_timeline(events, HW, PAR)
    assert t.step_time_s == pytest.approx(8)
    assert t.breakdown["compute_s"] == pytest.approx(4)
    assert t.breakdown["exposed_transfer_s"] == pytest.approx(4)


def test_prefetch_is_one_phase_ahead():
    """The third phase's weights cannot come in before the first phase's compute ends:
    the device tier holds only the running phase and the next."""
    events = [fetch(F(0), 1), fetch(F(1), 1), compute(F(0), 2), fetch(F(2), 1),
              compute(F(1), 2), compute(F(2), 2)]  # fmt: skip
    t = build_timeline(events, HW, PAR)
    assert t.spans[3].start == pytest.approx(3)  # after fwd0 ends, not when the link frees
    assert t.step_time_s == pytest.approx(7)


def test_pipeline_bubble_between_stages():
    """Stage 0 computes 1 s and sends for 0.5 s; stage 1 then computes 1 s while stage 0
    idles: 1 s of bubble on stage 0."""
    send = Event(0, F(1), "collective", "activations", bytes=GB // 2, axis="pipe", stage=0)
    events = [compute(F(0), 1, stage=0), send, compute(F(1), 1, stage=1)]
    t = build_timeline(events, HW, Parallelism(pipe=4))  # 4 devices: pipe crosses nodes
    assert [s.start for s in t.spans] == pytest.approx([0, 1, 1.5])
    assert t.step_time_s == pytest.approx(2.5)
    assert t.critical_stage == 0
    assert t.breakdown == pytest.approx(
        {
            "compute_s": 1,
            "exposed_transfer_s": 0,
            "exposed_communication_s": 0.5,
            "host_update_s": 0,
            "pipeline_bubble_s": 1,
        }  # fmt: skip
    )


def test_collectives_use_the_link_their_group_spans():
    """tensor=2 fits a 2-device node (2 GB/s); replica groups span 4 devices (1 GB/s).
    A collective after a computation runs after it, and blocks the next one."""

    def allreduce(axis):
        return Event(0, F(0), "collective", "", bytes=2 * GB, axis=axis, devices=1)

    events = [compute(F(0), 1), allreduce("tensor"), allreduce("replica"), compute(F(1), 1)]
    t = build_timeline(events, HW, PAR)
    assert [s.duration for s in t.spans] == pytest.approx([1, 1, 2, 1])
    assert t.spans[3].start == pytest.approx(3)  # waits for both collectives of fwd0
    assert t.breakdown["exposed_communication_s"] == pytest.approx(2)


def test_host_update_waits_for_all_gradients_and_utilisation():
    grads = Event(0, Phase("backward", 0), "d2h", "gradients", bytes=GB)
    update = Event(0, Phase("update", 0), "compute", "optimizer_state", flops=0.5e12, on="host")
    _, report = predict(
        [compute(Phase("backward", 0), 1), grads, update], HW, PAR, model_flops=4e12, tokens=100,
        memory={"device": GB // 2, "host": 20 * GB},
    )  # fmt: skip
    assert report.step_time_s == pytest.approx(2.5)
    assert report.utilisation == pytest.approx(4e12 / (4 * 1e12 * 2.5))
    assert report.tokens_per_s == pytest.approx(40)
    assert report.memory_per_device["device"].fits
    assert not report.memory_per_device["host"].fits
    assert report.to_json()["memory_per_device"]["host"] == {
        "bytes": 20 * GB, "capacity": HW.host_memory_bytes, "fits": False,
    }  # fmt: skip


def test_profiles_and_profile_files(tmp_path):
    assert {"ipu-pod16", "ipu-pod256", "cs2", "a100-40gb", "a100-80gb", "h100-sxm", "h200-sxm",
            "tpu-v4", "tpu-v5p"} <= set(PROFILES)  # fmt: skip
    assert get_hardware("ipu-pod256").device_memory_bytes == 900_000_000
    (tmp_path / "mine.toml").write_text('base = "a100-80gb"\nefficiency = 0.4\n')
    mine = get_hardware(str(tmp_path / "mine.toml"))
    assert mine == dataclasses.replace(PROFILES["a100-80gb"], name="mine", efficiency=0.4)
    (tmp_path / "full.json").write_text(json.dumps({**HW.to_json(), "name": "x"}))
    assert load_profile(tmp_path / "full.json") == dataclasses.replace(HW, name="x")
    with pytest.raises(HardwareError, match="unknown hardware 'gpu-9000'; use one of"):
        get_hardware("gpu-9000")
    (tmp_path / "bad.toml").write_text("peak_tflops = 10\nwarp_drive = 1\n")
    with pytest.raises(HardwareError, match="unknown key.*warp_drive"):
        load_profile(tmp_path / "bad.toml")
    (tmp_path / "short.toml").write_text("peak_tflops = 10\n")
    with pytest.raises(HardwareError, match="is missing device_memory_gb"):
        load_profile(tmp_path / "short.toml")
    with pytest.raises(HardwareError, match="efficiency must be in"):
        dataclasses.replace(HW, efficiency=1.5)


@pytest.mark.slow
def test_plan_writes_a_trace_that_adds_up(tmp_path):
    """The trace of a planned gpt-tiny step on pipe=2: every event complete, no overlap
    on a stream, and per stream the durations add up to the report's busy times."""
    from shardemu.models import get_preset
    from shardemu.predict.plan_phased import plan_phased
    from shardemu.report.plandir import write_plan_dir

    planned = plan_phased(
        get_preset("gpt-tiny"), Parallelism(pipe=2, tensor=2, replica=2),
        TrainConfig(batch=8, seq=16, seed=0), PhasedConfig(phases=2, rts=2),
        hardware=PROFILES["ipu-pod16"],
    )  # fmt: skip
    assert not any(tmp_path.iterdir())  # a planner writes nothing
    write_plan_dir(tmp_path, planned)
    report = planned.report
    assert {"step_time_s", "utilisation", "memory_per_device", "trace"} <= set(report)
    assert (tmp_path / "timeline.png").stat().st_size > 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert all({"ph", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    busy: dict[str, float] = {}
    by_stream: dict[tuple, list] = {}
    for e in events:
        if e["ph"] == "X":
            by_stream.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for (pid, tid), spans in by_stream.items():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:], strict=False))
        busy[f"stage{pid}/{names[(pid, tid)]}"] = sum(b - a for a, b in spans) / 1e6
    assert busy == pytest.approx({k: v for k, v in report["stream_busy_s"].items() if v > 0})
    assert max(end for spans in by_stream.values() for _, end in spans) / 1e6 == pytest.approx(
        report["step_time_s"]
    )


@pytest.mark.slow
def test_resident_plan_recomputation_and_schedules():
    """Resident pipelined plans of gpt-tiny on pipe=2: recomputation trades FLOPs for
    memory (full > selective > none in executed FLOPs, the reverse in memory) at equal
    model FLOPs; GPipe and 1F1B take about the same time but 1F1B holds fewer microbatches; the
    bubble appears in the timeline."""
    from shardemu.models import get_preset
    from shardemu.predict.plan_resident import plan_resident

    par, hw = Parallelism(pipe=2, tensor=2, replica=2), PROFILES["a100-80gb"]

    def plan(recompute="full", schedule="1f1b"):
        train = TrainConfig(batch=16, seq=16, schedule=schedule)
        r = plan_resident(get_preset("gpt-tiny"), par, train, 2, hw, recompute).report
        return r | {"memory": r["memory_per_device"]["device"]["bytes"]}

    full, selective, none = plan("full"), plan("selective"), plan("none")
    assert full["executed_flops"] > selective["executed_flops"] > none["executed_flops"]
    assert full["memory"] < selective["memory"] < none["memory"]
    assert selective["model_flops"] == pytest.approx(none["model_flops"], rel=1e-6)
    assert full["model_flops"] == pytest.approx(none["model_flops"], rel=0.1)
    gpipe = plan(schedule="gpipe")
    # equal bubbles in unit time; with real F and B durations the orders differ slightly
    assert gpipe["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.05)
    assert gpipe["memory"] > full["memory"]
    assert full["breakdown"]["pipeline_bubble_s"] > 0
    assert full["bubble_fraction"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1), p=2, m=4


def test_one_stage_whose_whole_batch_does_not_fit_takes_the_fastest_microbatch_that_does():
    """pipe = 1, no --microbatch-size: the whole batch when it fits (no choice made,
    none said); on a device too small for it (9 MB: the whole batch of 8 needs 11.2
    MB, 6.3 MB of it the loss's working set), the fastest of the sizes that fit,
    recorded as the choice, and the plan fits. That is the largest that fits: the
    smaller are not planned, and planning them shows each no faster; the whole batch is
    not planned either, its least bytes (nothing compiled) being over already."""
    from cli_helpers import shardemu

    from shardemu.models import get_preset
    from shardemu.predict.plan_resident import plan_resident
    from shardemu.predict.planning import plan

    small = dataclasses.replace(
        PROFILES["a100-80gb"], name="small", device_memory_gb=0.009, memory_fragmentation=0.0
    )
    train = TrainConfig(batch=8, seq=128)
    roomy = plan(get_preset("gpt-tiny"), Parallelism(), train, PROFILES["a100-80gb"])
    assert roomy.report["microbatch_size"] == 8 and "microbatch_choice" not in roomy.report
    tight = plan(get_preset("gpt-tiny"), Parallelism(), train, small)
    choice = tight.report["microbatch_choice"]
    # every size planned whole: the choice is the fastest that fits, and it is the
    # largest (on one stage a larger microbatch is no slower: the smaller were not
    # planned, `plan_resident_auto`)
    every = {size: plan_resident(get_preset("gpt-tiny"), Parallelism(), train, size, small)
             for size in (1, 2, 4, 8)}  # fmt: skip
    fitting = [size for size, p in every.items() if p.fits]
    assert not every[8].fits and fitting  # the whole batch cannot
    fastest = min(fitting, key=lambda size: (every[size].report["step_time_s"], size))
    assert tight.report["microbatch_size"] == fastest == max(fitting) and tight.fits
    # planned alone: 8's least bytes (nothing compiled) are over, the smaller are no faster
    assert set(choice["not_planned"]) == {"1", "2", "8"}
    assert "does not fit" in choice["not_planned"]["8"]
    assert choice["device_bytes"]["8"] <= every[8].report["memory_per_device"]["device"]["bytes"]
    assert tight.report["step_time_s"] == every[fastest].report["step_time_s"]
    # and with tensor parallelism, ZeRO 3 and selective recomputation, every size fitting
    zero3 = TrainConfig(batch=8, seq=128, zero=3)
    steps = [
        plan_resident(get_preset("gpt-tiny"), Parallelism(tensor=2, replica=2), zero3, size,
                      PROFILES["a100-80gb"], recompute="selective").report["step_time_s"]
        for size in (1, 2, 4)
    ]  # fmt: skip
    assert steps == sorted(steps, reverse=True), steps
    said = shardemu("plan", "--model", "gpt-tiny", "--batch", "8", "--seq", "128",
                    "--hardware", "a100-80gb")  # fmt: skip
    assert said.returncode == 0 and "--microbatch-size" not in said.stderr


def test_a_pipelined_plan_without_a_microbatch_size_picks_the_fastest(tmp_path, capsys):
    """`plan --mesh pipe=2` without --microbatch-size plans each power-of-two size of the
    batch per replica and takes the fastest that fits; it says so. The chosen plan is
    the one `--microbatch-size` gives, and its step the minimum of the candidates'."""
    from shardemu.cli import main
    from shardemu.models import get_preset
    from shardemu.predict.microbatch import microbatch_candidates
    from shardemu.predict.plan_phased import plan_phased
    from shardemu.predict.plan_resident import plan_resident, plan_resident_auto

    assert microbatch_candidates(24) == [1, 2, 4, 8, 24]
    argv = ["plan", "--model", "gpt-tiny", "--mesh", "pipe=2", "--hardware", "a100-80gb",
            "--batch", "4", "--seq", "16", "--out", str(tmp_path / "p"), "--json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    report, choice = json.loads(out.out), json.loads(out.out)["microbatch_choice"]
    assert list(choice["step_time_s"]) == ["1", "2", "4"]
    fastest = min(choice["step_time_s"], key=choice["step_time_s"].get)
    assert choice["chosen"] == report["microbatch_size"] == int(fastest)
    assert f"--microbatch-size {fastest} (not given: of 1, 2, 4 " in out.err
    train = TrainConfig(batch=4, seq=16)
    explicit = plan_resident(
        get_preset("gpt-tiny"), Parallelism(pipe=2), train, int(fastest), PROFILES["a100-80gb"]
    ).report
    assert explicit["step_time_s"] == report["step_time_s"]
    # a refusal every size shares is the user's to fix: it comes back, not "no size"
    with pytest.raises(ConfigError, match="4 layers do not split into pipe \\* virtual = 6"):
        plan_resident_auto(
            get_preset("gpt-tiny"), Parallelism(pipe=2),
            TrainConfig(batch=4, seq=16, schedule="interleaved", virtual=3), PROFILES["a100-80gb"],
        )  # fmt: skip
    with pytest.raises(ConfigError, match="give `hardware`"):
        plan_phased(get_preset("gpt-tiny"), Parallelism(pipe=2), TrainConfig(batch=4, seq=16),
                    PhasedConfig(), microbatch_size="auto")  # fmt: skip


def test_a_phased_choice_plans_fewer_sizes_and_chooses_as_planning_every_size_does():
    """`plan_phased(microbatch_size="auto")` screens each size by a dry run for memory
    alone and a least step, and plans only the sizes that could win: its choice is the
    fastest that fits of every size planned whole (on a device where all fit, and on
    one where only the smallest does), each screen's bytes are the plan's, and each
    least step is below the plan's step (a true bound)."""
    from shardemu.models import Model, get_preset
    from shardemu.predict.plan_phased import _screen, plan_phased

    gpt, par = Model(get_preset("gpt-tiny")), Parallelism(tensor=2)
    train, phased = TrainConfig(batch=2, seq=64), PhasedConfig(phases=2)
    roomy = PROFILES["ipu-pod16"]
    whole = {b: plan_phased(gpt, par, train, phased, None, roomy, b).report for b in (1, 2)}
    least = whole[1]["memory_per_device"]["device"]["bytes"]
    assert whole[2]["memory_per_device"]["device"]["bytes"] > least
    small = dataclasses.replace(roomy, name="small", device_memory_gb=(least + 0.5) / 1e9)
    for hw, fitting, passed_over in ((roomy, {1, 2}, "least step"), (small, {1}, "fit")):
        for b, report in whole.items():
            screen = _screen(gpt, par, train, phased, None, hw, b)
            assert screen.device_bytes == report["memory_per_device"]["device"]["bytes"]
            assert screen.fits == (b in fitting)
            assert screen.least_step_s <= report["step_time_s"]
        auto = plan_phased(gpt, par, train, phased, None, hw, "auto").report
        choice = auto["microbatch_choice"]
        assert choice["chosen"] == min(fitting, key=lambda b: (whole[b]["step_time_s"], b))
        assert auto["step_time_s"] == whole[choice["chosen"]]["step_time_s"]
        assert len(choice["step_time_s"]) == 1 and set(choice["device_bytes"]) == {"1", "2"}
        assert all(passed_over in why for why in choice["not_planned"].values())
    # where none fits, the least memory (every size planned: the smallest), and no larger
    # size screened, since it keeps at least the smaller's bytes (whole[2] > whole[1])
    none = dataclasses.replace(roomy, name="none", device_memory_gb=(least - 1) / 1e9)
    choice = plan_phased(gpt, par, train, phased, None, none, "auto").report["microbatch_choice"]
    assert choice["chosen"] == 1 and set(choice["device_bytes"]) == {"1"}
    assert choice["not_planned"] == {"2": "not screened: larger than 1, which does not fit"}


@pytest.mark.slow
def test_phased_passes_accumulate_one_counted_pass():
    """A batch of 8 as 4 pipelined passes of 1 sequence per replica: 4 times one pass's
    model FLOPs and gradient bytes, about half a batch of 16's FLOPs, and a step shorter
    than 4 passes back to back (the pipeline overlaps them)."""
    from shardemu.models import get_preset
    from shardemu.predict.plan_phased import plan_phased

    par, cfg = Parallelism(pipe=2, tensor=2, replica=2), PhasedConfig(phases=2)
    hw, model = PROFILES["ipu-pod16"], get_preset("gpt-tiny")
    whole = plan_phased(model, par, TrainConfig(batch=16, seq=16, seed=0), cfg, hardware=hw).report
    one = plan_phased(model, par, TrainConfig(batch=2, seq=16, seed=0), cfg, hardware=hw).report
    passes = plan_phased(
        model, par, TrainConfig(batch=8, seq=16, seed=0), cfg, hardware=hw, microbatch_size=1
    ).report
    assert passes["passes"] == 4
    assert passes["model_flops"] == pytest.approx(4 * one["model_flops"], rel=1e-9)
    # per-pass work that does not scale with the batch (gradient norms, the tied
    # embedding's gradient sum) makes 4 small passes cost a little more than one big one
    assert passes["model_flops"] == pytest.approx(whole["model_flops"] / 2, rel=0.1)
    assert passes["bytes_d2h_gradients"] == 4 * one["bytes_d2h_gradients"]
    assert passes["step_time_s"] < 4 * one["step_time_s"]


def spans_timeline(intervals, kinds=("forward",)):
    """A timeline of compute spans (start, end) on stage 0, one phase kind per span in
    turn."""
    spans = [
        Span(i, 0, "compute", Phase(kinds[i % len(kinds)]), a, b, compute(F(0), b - a))
        for i, (a, b) in enumerate(intervals)
    ]
    return Timeline(spans, max((b for _, b in intervals), default=0.0))


def test_timeline_bars_merge_spans_that_touch():
    """Back-to-back and overlapping spans of one kind become one bar; a gap or another
    kind starts a new one; empty spans are dropped."""
    tl = spans_timeline(
        [(0, 1), (1, 2), (1.5, 3), (4, 5), (5, 5), (6, 7)], ("forward",) * 5 + ("backward",)
    )
    assert merged_bars(tl) == {
        (0, "compute", "forward"): [(0, 3), (4, 5)],
        (0, "compute", "backward"): [(6, 7)],
    }


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), min_size=1, max_size=40))
def test_timeline_bars_cover_exactly_the_spans(raw):
    """Every span lies inside one bar; bars are separated by gaps; every point of a bar
    is covered by a span (checked on the integer grid the spans live on)."""
    intervals = [(float(a), float(a + w)) for a, w in raw]
    (bars,) = merged_bars(spans_timeline(intervals)).values()
    assert all(b[1] < c[0] for b, c in zip(bars, bars[1:], strict=False))
    assert all(any(s >= a and e <= b for a, b in bars) for s, e in intervals)
    covered = {t for s, e in intervals for t in range(int(s), int(e))}
    assert covered == {t for a, b in bars for t in range(int(a), int(b))}


def test_a_timeline_too_large_for_a_trace_keeps_its_picture_and_its_critical_stage(
    tmp_path, monkeypatch
):
    """Past the span limit (made 3 here) timeline.png is still drawn, and trace.json
    holds the critical stage's spans only, which the views say (it once wrote neither,
    without a word)."""
    import shardemu.report.views as views

    spans = [
        Span(i, stage, "compute", F(0), i, i + 1.0, compute(F(0), 1.0))
        for i, stage in enumerate((0, 1, 1, 0, 1))
    ]
    timeline = Timeline(spans, 5.0, critical_stage=1)
    monkeypatch.setattr(views, "MAX_TRACE_SPANS", 3)
    written = views.write_views(timeline, tmp_path, "five spans")
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert "critical stage 1 alone: 3 of the step's 5 spans" in written["trace_window"]
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["ts"] for e in events if e.get("ph") == "X"} == {1e6, 2e6, 4e6}


def test_a_profile_override_that_fp32_plans_ignore_is_said(tmp_path, caplog):
    """`peak_tflops` over a base with its own FP32 peak changes the 16-bit plans only:
    loading it says so (it was silent); giving `fp32_tflops` too says nothing."""
    only = tmp_path / "fast.toml"
    only.write_text('base = "a100-80gb"\npeak_tflops = 500\n')
    both = tmp_path / "both.toml"
    both.write_text('base = "a100-80gb"\npeak_tflops = 500\nfp32_tflops = 250\n')
    with caplog.at_level("WARNING", logger="shardemu"):
        assert load_profile(only).at_precision("fp32").peak_tflops == 156
        assert load_profile(both).at_precision("fp32").peak_tflops == 250
    (record,) = caplog.records
    assert "peak_tflops sets the 16-bit peak only" in record.getMessage()
    assert "fp32_tflops = 156" in record.getMessage() and "fast.toml" in record.getMessage()


def test_an_expert_group_spans_its_tensor_groups():
    """The mesh is (pipe, replica, expert, tensor): an all-to-all over `expert` on
    expert 2 x tensor 8 spans 16 devices, past an 8-GPU node: inter-node; over `tensor`
    alone it stays inside."""
    from shardemu.predict.durations import duration

    hw, par = PROFILES["h100-sxm"], Parallelism(tensor=8, replica=2, expert=2)
    a2a = Event(0, Phase("step"), "collective", "", bytes=8e9, axis="expert", devices=8)
    inside = dataclasses.replace(a2a, axis="tensor")
    assert duration(a2a, hw, par) == pytest.approx(1 / hw.inter_node_gbps)
    assert duration(inside, hw, par) == pytest.approx(1 / hw.intra_node_gbps)


def test_a_ring_across_nodes_moves_its_bytes_over_its_devices_links_in_each_node():
    """On DGX A100 nodes (a 25 GB/s NIC a GPU, NVLink at 300 GB/s between them), an
    all-gather of 64 GPUs at tensor 1 (FSDP: all 8 of each node in the group) moves each
    device's bytes at 8 x 25 GB/s; at tensor 2, 4 of the group a node, 100 GB/s; at
    tensor 8 (Megatron's data parallelism: one a node), 25 GB/s. Inside a node: NVLink.
    An all-to-all sends each device's share over its own NIC: 25 GB/s. A profile
    without a NIC a device (an IPU-M2000's gateway) keeps its one link's figure."""
    from shardemu.predict.durations import duration

    hw = PROFILES["a100-80gb"]

    def seconds(op: str, tensor: int, replica: int, group: int, profile=hw) -> float:
        par = Parallelism(tensor=tensor, replica=replica)
        event = Event(0, Phase("step"), "collective", "", bytes=int(1e9) * par.num_devices,
                      axis="replica", devices=par.num_devices, op=op, group=group)  # fmt: skip
        return duration(event, profile, par)

    assert seconds("all-gather", 1, 64, 64) == pytest.approx(1 / 200)
    assert seconds("reduce-scatter", 2, 32, 32) == pytest.approx(1 / 100)
    assert seconds("all-reduce", 8, 8, 8) == pytest.approx(1 / 25)
    assert seconds("all-gather", 1, 8, 8) == pytest.approx(1 / 300)  # one node: NVLink
    assert seconds("all-to-all", 1, 64, 64) == pytest.approx(1 / 25)
    shared = dataclasses.replace(hw, nic_per_device=False)
    assert seconds("all-gather", 1, 64, 64, shared) == pytest.approx(1 / 25)
    with pytest.raises(HardwareError, match="nic_per_device must be true or false, got 1"):
        dataclasses.replace(hw, nic_per_device=1)


def test_a_bar_colours_every_pixel_column_it_touches():
    """timeline.png's columns (10 over a 10 s step): a bar covers the columns from its
    start's through its end's, one where it is shorter than a column; a bar ending at
    the step's end stays in the last column."""
    covered = bar_columns([(0.0, 2.5), (4.2, 4.3), (7.0, 10.0)], 10.0, 10)
    assert covered.tolist() == [c in (0, 1, 2, 4, 7, 8, 9) for c in range(10)]
    assert not bar_columns([], 10.0, 10).any()


def test_timeline_png_paints_each_lanes_bars_in_its_kinds_colour(tmp_path):
    """Read back from the PNG: stage 0's forward bar over the step's first half lies
    left of and above stage 1's backward bar over the second half (sharing the pixel
    column of 1 s), each solid and as wide as the other within a column."""
    from PIL import Image

    spans = [
        Span(0, 0, "compute", Phase("forward"), 0.0, 1.0, compute(F(0), 1.0)),
        Span(1, 1, "compute", Phase("backward"), 1.0, 2.0, compute(F(0), 1.0)),
    ]
    plot_timeline(Timeline(spans, 2.0), tmp_path / "timeline.png", "two bars")
    pixels = np.asarray(Image.open(tmp_path / "timeline.png").convert("RGB")).astype(int)

    def bar(colour):  # the rows with a bar's run of this colour (a swatch is short)
        mask = np.abs(pixels - colour).sum(axis=2) == 0
        rows = np.flatnonzero(mask.sum(axis=1) > pixels.shape[1] * 0.2)
        cols = np.flatnonzero(mask[rows].all(axis=0))  # a swatch is shorter, too
        return rows, cols

    (fr, fc), (br, bc) = bar((0x4C, 0x72, 0xB0)), bar((0xDD, 0x84, 0x52))
    assert len(fr) > 5 and len(br) > 5
    assert fc.max() <= bc.min() and fr.max() < br.min()  # the two touch at 1 s
    width_f, width_b = np.ptp(fc) + 1, np.ptp(bc) + 1
    assert len(fc) == width_f and len(bc) == width_b  # solid
    assert abs(width_f - width_b) <= 1 and width_f > pixels.shape[1] * 0.3


def test_a_timeline_of_many_lanes_labels_each_stage_and_says_its_lanes_once():
    """Past 64 lanes, stages whose lanes are alike get a label each and the axis names
    their lanes in order; where one stage's lanes differ, every lane keeps its label."""
    from matplotlib.figure import Figure

    streams = ("compute", "collective:pipe", "collective:tensor", "h2d")
    rows = [(s, stream) for s in range(17) for stream in streams]
    ax = Figure().subplots()
    label_lanes(ax, rows)
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"stage {s}" for s in range(17)]
    assert list(ax.get_yticks()) == list(range(0, 68, 4))
    assert ax.get_ylabel().endswith(": compute, collective:pipe, collective:tensor, h2d")
    ax = Figure().subplots()
    label_lanes(ax, rows[:-1])  # the last stage has no h2d lane
    assert [t.get_text() for t in ax.get_yticklabels()][-3:] == [
        "stage 16 compute", "stage 16 collective:pipe", "stage 16 collective:tensor"
    ]  # fmt: skip
    assert ax.get_ylabel() == ""
