"""Overlap options (`predict/overlap.py`): hand-built timelines, and resident plans whose
ledgers move the same bytes whichever option is chosen while their step times differ as
the options say they should.

The toy hardware is test_costmodel's: 1 TFLOP/s, 2 GB/s inside a 2-device node, 1 GB/s
across nodes; every event is on one device."""

import dataclasses

import pytest

from shardemu.accounting.ledger import Event, Matmul, Phase
from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.models import get_preset
from shardemu.predict.costmodel import build_timeline
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import MAX_BUCKETS, Overlap
from shardemu.predict.profiles import PROFILES

HW = Hardware(
    name="toy", peak_tflops=1.0, device_memory_gb=1.0, host_memory_gb=10.0,
    host_link_gbps=1.0, intra_node_gbps=2.0, inter_node_gbps=1.0, devices_per_node=2,
    efficiency=1.0, host_tflops=1.0,
)  # fmt: skip
GB = 10**9
B0, UPDATE = Phase("backward", 0), Phase("update", 0)
F0, F1 = Phase("forward", 0), Phase("forward", 1)


def compute(phase, seconds, stage=0):
    return Event(0, phase, "compute", "", flops=seconds * 1e12, stage=stage)


def reduction(seconds):  # replica groups of tensor=2, replica=2 span 4 devices: 1 GB/s
    return Event(0, B0, "collective", "gradients", bytes=int(seconds * GB), axis="replica")


def test_bucket_reductions_hide_behind_the_backward_and_hold_the_update():
    """bwd (1 s) | reduce (0.5 s) | bwd (1 s) | reduce (0.5 s) | update (0.25 s): the second
    half of the backward does not wait for the first bucket; the update waits for the
    last. Reduced at the end instead, all 1 s of the reduction is exposed."""
    par = Parallelism(tensor=2, replica=2)
    bucketed = [compute(B0, 1), reduction(0.5), compute(B0, 1), reduction(0.5),
                compute(UPDATE, 0.25)]  # fmt: skip
    t = build_timeline(bucketed, HW, par)
    assert [s.start for s in t.spans] == pytest.approx([0, 1, 1, 2, 2.5])
    assert t.step_time_s == pytest.approx(2.75)
    assert t.breakdown["exposed_communication_s"] == pytest.approx(0.5)
    end = build_timeline([compute(B0, 1), compute(B0, 1), reduction(1), compute(UPDATE, 0.25)],
                         HW, par)  # fmt: skip
    assert end.step_time_s == pytest.approx(3.25)
    assert end.breakdown["exposed_communication_s"] == pytest.approx(1)


def test_a_blocking_pipe_send_holds_the_senders_next_computation():
    """Stage 0 computes microbatch 0 (1 s), sends it (0.5 s over pipe=4, across nodes),
    then computes microbatch 1: at 1 s if the send is asynchronous, at 1.5 s if it blocks."""
    send = Event(0, F1, "collective", "activations", bytes=GB // 2, axis="pipe")
    events = [compute(F0, 1), send, compute(F0.at(1), 1), compute(F1, 1, stage=1)]
    par = Parallelism(pipe=4)
    starts = {
        mode: [s.start for s in build_timeline(events, HW, par, Overlap(pipe_sends=mode)).spans]
        for mode in ("async", "blocking")
    }
    assert starts["async"] == pytest.approx([0, 1, 1, 1.5])
    assert starts["blocking"] == pytest.approx([0, 1, 1.5, 1.5])


def test_a_scattered_pipe_send_is_a_share_over_pipe_then_a_gather_over_tensor():
    """Stage 0 computes (1 s) and sends 1 GB that each of its 4 tensor ranks holds
    (`copies` 4) across nodes (1 GB/s); stage 1 then computes. Whole, each rank sends
    all of it: 1 s. Megatron-LM's scatter/gather: a quarter over pipe (0.25 s), then the
    ring all-gather of the other three quarters over tensor inside the node (0.75 GB at
    2 GB/s: 0.375 s). Split over tensor already (copies 1, sequence parallel), a rank
    sends its quarter either way. A bound that does not know the option takes the
    shorter (`least_seconds`)."""
    from shardemu.predict.durations import least_seconds

    par, hw = Parallelism(pipe=2, tensor=4), dataclasses.replace(HW, devices_per_node=4)

    def stage_1_starts(copies: int, scatter_gather: bool) -> float:
        held = GB if copies == 4 else GB // 4  # a rank's bytes: all of it, or its quarter
        send = Event(0, F1, "collective", "activations", bytes=4 * held, axis="pipe",
                     devices=4, op="collective-permute", group=2, copies=copies)  # fmt: skip
        events = [compute(F0, 1), send, compute(F1, 1, stage=1)]
        overlap = Overlap(pipe_scatter_gather=scatter_gather)
        return build_timeline(events, hw, par, overlap).spans[-1].start

    assert stage_1_starts(4, False) == pytest.approx(2.0)
    assert stage_1_starts(4, True) == pytest.approx(1.625)
    assert stage_1_starts(1, False) == stage_1_starts(1, True) == pytest.approx(1.25)
    replicated = Event(0, F1, "collective", "activations", bytes=4 * GB, axis="pipe",
                       devices=4, op="collective-permute", group=2, copies=4)  # fmt: skip
    assert least_seconds(replicated, hw, par) == pytest.approx(0.625)


def test_bucket_count():
    assert Overlap(bucket_mb=1).buckets(2.5 * 2**20) == 3
    assert Overlap().buckets(10) == 1
    assert Overlap(bucket_mb=1).buckets(1e12) == MAX_BUCKETS


@pytest.fixture(scope="module")
def plans():
    """gpt-tiny on pipe 2 x tensor 2 x replica 2, 4 microbatches, with each option: one
    stage's counted pieces shared by all of them."""
    from shardemu.predict.plan_resident import plan_resident

    par, hw = Parallelism(pipe=2, tensor=2, replica=2), PROFILES["a100-80gb"]

    def plan(**overlap):
        return plan_resident(
            get_preset("gpt-tiny"),
            par,
            TrainConfig(batch=16, seq=16),
            2,
            hw,
            overlap=Overlap(**overlap),
        )

    return {
        "end": plan(grad_reduce="end"),
        "bucketed": plan(grad_reduce="bucketed", bucket_mb=0.01),
        "blocking": plan(grad_reduce="end", pipe_sends="blocking"),
        "scattered": plan(grad_reduce="end", pipe_sends="blocking", pipe_scatter_gather=True),
    }


def test_options_move_the_same_bytes_and_flops(plans):
    end = plans["end"].report
    for name in ("bucketed", "blocking", "scattered"):
        other = plans[name].report
        assert other["flops"] == pytest.approx(end["flops"], rel=1e-12)
        for axis, sent in end["bytes_collective"].items():
            assert other["bytes_collective"][axis] == pytest.approx(sent, rel=1e-9), axis


def test_bucketed_reduction_hides_all_but_its_tail(plans):
    """Each stage's layer gradients reduce in buckets during the last microbatch's
    backward: the step is shorter by at most the layers' whole reduction, and the
    buckets are where the options say (the last backward of each stage only)."""
    end, end_timeline = plans["end"].report, plans["end"].timeline
    bucketed, ledger = plans["bucketed"].report, plans["bucketed"].ledger
    reductions = [e for e in ledger.events if e.axis == "replica" and e.carries == "gradients"]
    assert {e.phase.micro for e in reductions} == {3}  # the last of 4 microbatches
    per_stage = [sum(e.stage == s for e in reductions) for s in (0, 1)]
    assert min(per_stage) > 2  # buckets, and the shared weights' reduction at the end
    hidden = sum(s.duration for s in end_timeline.spans if s.stream == "collective:replica")
    assert bucketed["step_time_s"] < end["step_time_s"]
    assert end["step_time_s"] - bucketed["step_time_s"] <= hidden * (1 + 1e-9)
    assert (
        bucketed["breakdown"]["exposed_communication_s"]
        < end["breakdown"]["exposed_communication_s"]
    )
    assert bucketed["overlap"] == {"grad_reduce": "bucketed", "bucket_mb": 0.01,
                                   "grad_reduce_in_fp32": False, "pipe_sends": "async",
                                   "pipe_scatter_gather": False, "tp_overlap": "none"}  # fmt: skip


def test_gradients_reduced_in_fp32_send_4_bytes_an_element():
    """A BF16 plan with `grad_reduce_in_fp32` (TorchTitan's and Megatron-LM's BF16
    default) reduces twice the gradient bytes over `replica`, in ZeRO 3's
    reduce-scatters as in the all-reduce, and every other event (ZeRO 3's weight
    gathers among them) moves what it did; an FP32 plan reduces 4-byte gradients either
    way: the same ledger."""
    from shardemu.predict.plan_resident import plan_resident

    hw, par = PROFILES["a100-80gb"], Parallelism(pipe=2, replica=2)

    def sent(precision: str, zero: int, fp32: bool) -> tuple[int, list, float]:
        train = TrainConfig(batch=8, seq=16, precision=precision, zero=zero)
        planned = plan_resident(get_preset("gpt-tiny"), par, train, 2, hw,
                                overlap=Overlap(grad_reduce_in_fp32=fp32))  # fmt: skip
        events = planned.ledger.events
        reduced = [e for e in events if e.axis == "replica" and e.carries == "gradients"]
        rest = [(e.op, e.axis, e.bytes) for e in events if e not in reduced]
        return sum(e.bytes for e in reduced), rest, planned.report["step_time_s"]

    for zero in (0, 3):
        (low, rest, step), (wide, same, slower) = (
            sent("bf16", zero, False),
            sent("bf16", zero, True),
        )
        assert wide == 2 * low > 0 and same == rest and slower >= step
    assert sent("fp32", 0, True) == sent("fp32", 0, False)


def test_blocking_sends_cost_time(plans):
    assert plans["blocking"].report["step_time_s"] > plans["end"].report["step_time_s"]


def test_scattered_sends_take_a_share_and_a_gather(plans):
    """The activations each of a stage's 2 tensor ranks holds whole go as Megatron-LM's
    scatter/gather sent them. Each send's seconds are the hand formula's: on the plan's
    A100s (8 a node, the 8 devices in one) half over NVLink and then a 2-rank
    all-gather over it, as long as the whole send, and the step is the same; with 4 a
    node, half over the stage's InfiniBand link, then the all-gather over NVLink:
    shorter than whole, and so is the step."""
    from shardemu.predict.durations import duration, pipe_send_seconds

    hw, par = PROFILES["a100-80gb"], Parallelism(pipe=2, tensor=2, replica=2)
    nodes_of_4 = dataclasses.replace(hw, devices_per_node=4)
    sends = [e for e in plans["scattered"].ledger.events if e.op == "collective-permute"]
    assert sends and {e.copies for e in sends} == {2}
    for e in sends[:4]:
        held = e.bytes / e.devices  # what a rank holds of the activation
        nvlink, ib = hw.intra_node_gbps * 1e9, hw.inter_node_gbps * 1e9
        assert pipe_send_seconds(e, hw, par) == pytest.approx(held / 2 / nvlink * 2, rel=1e-9)
        across = held / 2 / ib + held / 2 / nvlink
        assert pipe_send_seconds(e, nodes_of_4, par) == pytest.approx(across, rel=1e-9)
        assert pipe_send_seconds(e, nodes_of_4, par) < duration(e, nodes_of_4, par)
    same = plans["blocking"].report["step_time_s"]
    assert plans["scattered"].report["step_time_s"] == pytest.approx(same, rel=1e-12)
    ledger, blocking = plans["scattered"].ledger, Overlap(grad_reduce="end", pipe_sends="blocking")
    scattered = dataclasses.replace(blocking, pipe_scatter_gather=True)
    steps = [build_timeline(ledger, nodes_of_4, par, o).step_time_s for o in (blocking, scattered)]
    assert steps[1] < steps[0]


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"grad_reduce": "later"}, "Overlap.grad_reduce"),
        ({"pipe_sends": "never"}, "Overlap.pipe_sends"),
        ({"bucket_mb": 0}, "Overlap.bucket_mb"),
        ({"tp_overlap": "always"}, "Overlap.tp_overlap"),
        ({"pipe_scatter_gather": "yes"}, "Overlap.pipe_scatter_gather"),
        ({"grad_reduce_in_fp32": "yes"}, "Overlap.grad_reduce_in_fp32"),
    ],
)
def test_bad_overlap_settings(settings, names):
    with pytest.raises(ConfigError, match=names):
        Overlap(**settings)


def tensor_collective(op: str, seconds: float, n: int = 4) -> Event:
    """An all-gather or reduce-scatter of a forward piece over a 4-device tensor group
    inside one node (2 GB/s): `seconds` long, bytes summed over its n devices."""
    return Event(0, F0, "collective", "", bytes=int(seconds * 2 * GB * n), axis="tensor",
                 devices=n, op=op, group=n)  # fmt: skip


def test_chunked_tensor_collectives_hide_behind_their_pieces_projections():
    """A layer piece (a 1 s attention core and G s of projections), then its all-gather
    and reduce-scatter of 1.5 s each over tensor=4. Unhidden: 1 + G + 3 s. Chunked, each
    exposes max(0, C - G' 3/4) of the projections G' it still has, and uses up what it
    hid times 4/3:
    G = 2: the all-gather hides all (1.5 <= 1.5) and uses up 2 s; the reduce-scatter
    none: 3 + 1.5 = 4.5 s. G = 4: both hide (1.5 of 3, then 1.5 of the 1.5 left): 5 s.
    G = 1: the all-gather hides 0.75 s, the reduce-scatter none: 2 + 0.75 + 1.5 s."""
    par, hw = Parallelism(tensor=4), dataclasses.replace(HW, devices_per_node=4)
    for projections, chunked in ((2.0, 4.5), (4.0, 5.0), (1.0, 4.25)):
        core = 1.0
        layer = Event(0, F0, "compute", "", flops=(core + projections) * 1e12,
                      run_flops=(core + projections) * 1e12,
                      matmuls=(Matmul(projections * 1e12, 0),
                               Matmul(core * 1e12, 0, attention=True)))  # fmt: skip
        events = [layer, tensor_collective("all-gather", 1.5),
                  tensor_collective("reduce-scatter", 1.5)]  # fmt: skip
        plain = build_timeline(events, hw, par).step_time_s
        hidden = build_timeline(events, hw, par, Overlap(tp_overlap="chunked")).step_time_s
        assert plain == pytest.approx(core + projections + 3.0)
        assert hidden == pytest.approx(chunked)


def test_a_sequence_parallel_plan_hides_its_tensor_collectives_when_chunked():
    """gpt-tiny on tensor=2 with sequence parallelism: the same ledger either way, less
    exposed communication when chunked, and never less than nothing; without sequence
    parallelism, or in a phased plan, chunked is refused."""
    from shardemu.config import PhasedConfig
    from shardemu.predict.plan_phased import plan_phased
    from shardemu.predict.plan_resident import plan_resident

    par, hw = Parallelism(tensor=2), PROFILES["h100-sxm"]
    sp = TrainConfig(batch=4, seq=16, sequence_parallel=True)
    none, chunked = (
        plan_resident(get_preset("gpt-tiny"), par, sp, 2, hw, overlap=Overlap(tp_overlap=o))
        for o in ("none", "chunked")
    )
    assert none.report["bytes_collective"] == chunked.report["bytes_collective"]
    exposed = [p.report["breakdown"]["exposed_communication_s"] for p in (none, chunked)]
    assert 0 <= exposed[1] < exposed[0]
    assert chunked.report["step_time_s"] < none.report["step_time_s"]
    with pytest.raises(ConfigError, match="TrainConfig.sequence_parallel, or Overlap.tp_overlap"):
        plan_resident(get_preset("gpt-tiny"), par, TrainConfig(batch=4, seq=16), 2, hw,
                      overlap=Overlap(tp_overlap="chunked"))  # fmt: skip
    with pytest.raises(ConfigError, match="Overlap.tp_overlap chunked is for resident plans"):
        plan_phased(get_preset("gpt-tiny"), par, TrainConfig(batch=4, seq=16), PhasedConfig(),
                    hardware=hw, overlap=Overlap(tp_overlap="chunked"))  # fmt: skip
