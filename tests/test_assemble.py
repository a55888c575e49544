"""The assembler on a hand-built schedule, and ledger totals on hand-built events."""

import pytest

from shardemu.accounting.assemble import assemble, repeat_passes, split_by_part
from shardemu.accounting.ledger import Event, Ledger, Phase, totals
from shardemu.accounting.ledger_file import event_json
from shardemu.parallel.schedules import Schedule, Slot

# two stages, two microbatches, GPipe by hand: F0 F1 on stage 0, then stage 1, then back
SLOTS = (
    Slot(0, 0, 0, "F"), Slot(1, 0, 1, "F"), Slot(1, 1, 0, "F"), Slot(2, 1, 1, "F"),
    Slot(3, 1, 1, "B"), Slot(4, 1, 0, "B"), Slot(4, 0, 1, "B"), Slot(5, 0, 0, "B"),
)  # fmt: skip
SCHED = Schedule("hand", 2, 2, 1, SLOTS)


def compute(phase: Phase, flops: float = 1.0, stage: int = 0) -> Event:
    return Event(0, phase, "compute", "", flops=flops, stage=stage)


def test_slots_in_time_order_tagged_with_microbatch_and_stage():
    fetch = Event(0, Phase("shared"), "h2d", "weights", bytes=10)
    update = compute(Phase("update", 0))

    def slot_events(slot):
        return [compute(Phase("forward" if slot.kind == "F" else "backward", 0, (0, 1)))]

    step = assemble(SCHED, slot_events, before=[fetch], after=[update])
    assert step[0] is fetch and step[-1] is update
    body = [(e.stage, e.phase.kind, e.phase.micro) for e in step[1:-1]]
    assert body == [
        (0, "forward", 0), (0, "forward", 1), (1, "forward", 0), (1, "forward", 1),
        (1, "backward", 1), (0, "backward", 1), (1, "backward", 0), (0, "backward", 0),
    ]  # fmt: skip
    assert str(step[1].phase) == "fwd0@0" and str(step[-2].phase) == "bwd0@0"


def test_a_pass_repeats_per_microbatch_and_the_once_parts_do_not():
    one_pass = [
        Event(0, Phase("shared"), "h2d", "weights", bytes=100, stage=0),
        compute(Phase("embed"), 1, 0),
        compute(Phase("forward", 0, (0, 1)), 2, 0),
        compute(Phase("forward", 1, (1, 2)), 2, 1),
        compute(Phase("head"), 1, 1),
        compute(Phase("backward", 1, (1, 2)), 4, 1),
        compute(Phase("backward", 0, (0, 1)), 4, 0),
        compute(Phase("embed-backward"), 1, 0),
        Event(0, Phase("update", 0), "compute", "optimizer_state", flops=7, stage=0),
    ]
    parts = split_by_part(one_pass)
    assert {k: len(v) for k, v in parts.items()} == {
        ("once", 0): 1, ("F", 0): 2, ("F", 1): 2, ("B", 1): 1, ("B", 0): 2, ("update", 0): 1,
    }  # fmt: skip
    step = repeat_passes(one_pass, SCHED)
    t = totals(step)
    assert t["flops"] == 2 * (1 + 2 + 2 + 1 + 4 + 4 + 1) + 7  # two passes, one update
    assert t["model_flops"] == 2 * 15  # the optimizer is not model work
    assert t["bytes_h2d_weights"] == t["bytes_h2d"] == 100  # shared weights come in once
    assert [e.phase.micro for e in step if e.phase.kind == "embed"] == [0, 1]


def test_step_totals_by_kind_carries_and_axis():
    ledger = Ledger(
        [
            Event(0, Phase("forward", 0), "h2d", "weights", bytes=8),
            Event(0, Phase("forward", 0), "h2d", "activations", bytes=3),
            Event(0, Phase("backward", 0), "d2h", "gradients", bytes=5),
            Event(0, Phase("backward", 0), "d2h", "activations", bytes=2),
            Event(0, Phase("forward", 0), "collective", "", bytes=7, axis="tensor"),
            Event(0, Phase("forward", 0), "collective", "", bytes=1, axis="tensor"),
            Event(0, Phase("backward", 0), "collective", "", bytes=4, axis="replica"),
            Event(0, Phase("backward", 0), "compute", "", flops=30.0, recompute_flops=10.0),
            Event(1, Phase("forward", 0), "h2d", "weights", bytes=1000),  # another step
        ]
    )
    assert ledger.step_totals(0) == {
        "flops": 30.0,
        "model_flops": 20.0,
        "bytes_h2d": 11,
        "bytes_d2h": 7,
        "bytes_h2d_weights": 8,
        "bytes_d2h_gradients": 5,
        "bytes_collective": {"tensor": 8, "replica": 4},
    }
    assert ledger.step_totals(1)["bytes_h2d"] == 1000


def test_ledger_json_keeps_phase_fields_and_a_readable_name():
    row = event_json(compute(Phase("update")))
    assert row["phase"] == {"name": "update-shared", "kind": "update", "index": None,
                            "layers": None, "micro": None}  # fmt: skip
    assert Phase("backward", 3, (6, 8), micro=2).part == "B"
    assert str(Phase("embed-backward")) == "bwd-embed"
    with pytest.raises(KeyError):
        Phase("nonsense").part  # type: ignore[arg-type]  # noqa: B018
