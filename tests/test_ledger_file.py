"""ledger.json's compact form against the events it was written from: every schedule's
step, a run's repeating steps, the earlier one-dict-per-event form, and files that are
not ledgers."""

import json

import pytest

from shardemu.accounting.assemble import repeat_passes
from shardemu.accounting.ledger import Event, Matmul, Phase
from shardemu.accounting.ledger_file import (
    LedgerFileError,
    encode,
    event_json,
    read_events,
    write_ledger,
)
from shardemu.config import SCHEDULES
from shardemu.parallel.schedules import make_schedule


def one_pass(stages: int) -> list[Event]:
    """A pass over `stages` stages with every field of an event set somewhere."""
    events = [Event(0, Phase("shared"), "h2d", "weights", bytes=100, axis="pipe", on="host")]
    for s in range(stages):
        layers = (2 * s, 2 * s + 2)
        events += [
            Event(0, Phase("forward", s, layers), "compute", "", flops=3.5, stage=s,
                  run_flops=1.5, matmuls=(Matmul(1.0, 8), Matmul(0.5, 4, True, True, 0.53125)),
                  memory_bytes=12),
            Event(0, Phase("forward", s, layers), "collective", "activations", bytes=7,
                  axis="tensor", devices=2, op="all-reduce", group=2, stage=s),
            Event(0, Phase("backward", s, layers), "compute", "", flops=7.0,
                  recompute_flops=3.5, stage=s),
            Event(0, Phase("update", s, layers), "compute", "optimizer_state", flops=1.0,
                  stage=s),
        ]  # fmt: skip
    return events


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_step_of_every_schedule_reads_back_equal_and_small(name, tmp_path):
    virtual = 2 if name == "interleaved" else 1
    schedule = make_schedule(name, 2, 4, virtual)
    step = repeat_passes(one_pass(2 * virtual), schedule)
    step += [Event(1, e.phase, e.kind, e.carries, e.bytes, e.flops, stage=e.stage)
             for e in step]  # fmt: skip
    write_ledger(tmp_path / "ledger.json", step)
    assert read_events(tmp_path / "ledger.json") == step
    doc = encode(step)
    assert len(doc["pieces"]) < len(step) / 3  # each placed piece once


def test_a_run_whose_steps_repeat_stores_each_event_once(tmp_path):
    steps = [Event(s, Phase("step"), "compute", "", flops=2.0) for s in range(1000)]
    steps += [Event(s, Phase("update"), "compute", "optimizer_state") for s in range(1000)]
    doc = encode(sorted(steps, key=lambda e: e.step))
    assert len(doc["pieces"]) == 2 and len(doc["runs"]) == 1000
    write_ledger(tmp_path / "ledger.json", steps)
    assert read_events(tmp_path / "ledger.json") == steps


def test_the_earlier_form_still_reads(tmp_path):
    step = repeat_passes(one_pass(2), make_schedule("1f1b", 2, 2))
    (tmp_path / "ledger.json").write_text(json.dumps([event_json(e) for e in step]))
    assert read_events(tmp_path / "ledger.json") == step


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "shardemu-ledger", "version": 9}', "version 9"),
        ('{"traceEvents": []}', "not a shardemu ledger"),
        ('[{"step": 0}]', "not a shardemu ledger (KeyError"),
        ("{", "not a shardemu ledger (JSONDecodeError"),
    ],
)
def test_a_file_that_is_not_a_ledger_is_one_clear_error(text, message, tmp_path):
    (tmp_path / "ledger.json").write_text(text)
    with pytest.raises(LedgerFileError, match=message.replace("(", r"\(")):
        read_events(tmp_path / "ledger.json")
    assert read_events(tmp_path / "missing.json") == []
