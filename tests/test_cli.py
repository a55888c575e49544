"""The `shardemu` command as a user types it, called in process (`cli.main(argv)`; the
session's 8 virtual devices serve every device count up to 8), and once in a fresh
process: sharded and single-device loss curves agree, runs write their directories, bad
input gives one clear line and exit status 2, never a traceback."""

import json

import pytest
from cli_helpers import shardemu

from shardemu import Parallelism, describe, get_preset
from shardemu.report.rundir import read_metrics
from shardemu.run.record import read_ledger

DEMO_STEPS = 5


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`shardemu demo --steps 5`: the README's first command (in this process; a fresh
    process setting up its own virtual devices is the SIGINT test's in
    test_checkpoint.py). Its sharded, one-device and phased runs are the runs the tests
    below compare."""
    root = tmp_path_factory.mktemp("demo") / "d"
    return shardemu("demo", "--steps", str(DEMO_STEPS), "--out", str(root)), root


@pytest.mark.slow
def test_demo_makes_its_three_runs_and_tells_what_they_show(demo):
    out, root = demo
    assert out.returncode == 0, out.stderr
    assert "final_loss" in out.stdout and "tensor=2,replica=4" in out.stdout
    assert "what the demo showed" in out.stdout and f"shardemu compare {root}" in out.stdout
    for name, steps in (("sharded", DEMO_STEPS), ("one-device", DEMO_STEPS), ("phased", 3)):
        records = read_metrics(root / name)
        assert [r["step"] for r in records] == list(range(steps))
        assert records[-1]["loss"] < records[0]["loss"]
    assert (root / "sharded" / "trace.json").exists()


@pytest.mark.slow
def test_sharded_and_single_device_runs_agree(demo):
    """(GPT: BERT's sharded steps are compared with one device in test_engine.py; the
    command's pipelined run in test_checkpoint.py.)"""
    root = demo[1]
    a, b = read_metrics(root / "sharded"), read_metrics(root / "one-device")
    assert [r["step"] for r in a] == list(range(DEMO_STEPS))
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-4 * abs(rb["loss"])
    assert a[-1]["loss"] < a[0]["loss"] - 0.2  # it learns

    config = json.loads((root / "sharded" / "config.json").read_text())
    assert config["device_count"] == 8 and config["parallelism"] == {
        "pipe": 1,
        "tensor": 2,
        "replica": 4,
        "expert": 1,
        "context": 1,
    }
    assert config["param_count"] > 0 and config["param_bytes"] == 4 * config["param_count"]
    assert {"jax", "flax", "optax"} <= set(config["versions"])
    assert config["train"]["batch"] == 16 and config["model"]["name"] == "gpt-tiny"
    # bytes per device: JAX's NamedSharding.shard_shape (run) vs our rules table (describe)
    described = describe(get_preset("gpt-tiny"), Parallelism(tensor=2, replica=4))
    assert config["param_bytes_per_device"] == described["bytes_per_device"]
    assert (root / "sharded" / "summary.md").read_text().startswith("# shardemu run")


@pytest.mark.slow
def test_phased_run_agrees_with_resident_and_records_the_ledger(demo):
    root = demo[1]
    phased = root / "phased"
    a, b = read_metrics(phased), read_metrics(root / "sharded")
    for ra, rb in zip(a, b, strict=False):  # the demo's phased run is 3 steps
        assert abs(ra["loss"] - rb["loss"]) <= 1e-4 * abs(rb["loss"])
    fields = {
        "flops",
        "model_flops",
        "bytes_h2d",
        "bytes_d2h",
        "bytes_collective",
        "bytes_h2d_weights",
    }
    assert fields <= set(a[0])
    assert a[0]["flops"] > a[0]["model_flops"] > 0  # each phase's backward recomputes it
    assert {"replica", "tensor"} <= set(a[0]["bytes_collective"])  # rts gathers, Megatron
    plan = json.loads((phased / "config.json").read_text())["phase_plan"]
    assert plan["phases"] == 2 and plan["rts"] == 4
    assert plan["step_totals"]["bytes_h2d"] == a[0]["bytes_h2d"]  # abstract = real
    trace = json.loads((phased / "trace.json").read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["cat"] == "h2d" for e in trace)
    assert "predicted_step_s" in (phased / "summary.md").read_text()
    ledger = read_ledger(phased)
    h2d = sum(e.bytes for e in ledger if e.step == 0 and e.kind == "h2d")
    assert h2d == a[0]["bytes_h2d"] > 0


@pytest.mark.slow
def test_plan_search_and_describe_take_a_runs_config(demo, tmp_path, caplog):
    """`plan --config RUN/config.json` plans the run's layout: the demo's phased run's
    counted step, as its own config.json records it (the engine's abstract plan), with
    one notice naming the run's settings a plan has no flag for; `describe` lays out its
    parameters as the run placed them, and `search` takes its model and shapes (its
    mesh left out, named). What a plan would count otherwise is refused."""
    from shardemu.cli import parse

    phased = demo[1] / "phased" / "config.json"
    out = shardemu("plan", "--config", str(phased), "--json")
    assert out.returncode == 0, out.stderr
    (notice,) = out.stderr.strip().splitlines()
    assert "left out: steps=3, seed=0" in notice and "learning_rate=" in notice
    assert notice.endswith("microbatches=1, grad_accum=1 as --microbatch-size 4")
    planned, ran = json.loads(out.stdout), json.loads(phased.read_text())["phase_plan"]
    for key in ("flops", "model_flops", "bytes_h2d", "bytes_d2h", "bytes_collective"):
        assert planned[key] == ran["step_totals"][key], key
    assert planned["plan"]["per_phase"] == ran["per_phase"]

    sharded = demo[1] / "sharded" / "config.json"
    out = shardemu("describe", "--config", str(sharded), "--json")
    assert out.returncode == 0, out.stderr
    run = json.loads(sharded.read_text())
    assert json.loads(out.stdout)["bytes_per_device"] == run["param_bytes_per_device"]
    # a search takes the run's model and shapes, and lays them out itself
    args = parse(["search", "--config", str(sharded), "--hardware", "a100-80gb", "--devices", "8"])
    assert (args.model, args.batch, args.seq) == ("gpt-tiny", run["train"]["batch"],
                                                  run["train"]["seq"])  # fmt: skip
    assert "`shardemu search` has no flag for, left out: mesh=" in caplog.text

    for change, message in (
        ({"optimizer": "lamb"}, "trained with lamb, and `shardemu plan` counts AdamW's"),
        ({"microbatches": 2, "grad_accum": 2}, "accumulates 2 pipelined passes of 2"),
    ):
        edited = json.loads(sharded.read_text())
        edited["train"] |= change
        edited["parallelism"] |= {"pipe": 2, "replica": 2} if "grad_accum" in change else {}
        (tmp_path / "config.json").write_text(json.dumps(edited))
        out = shardemu("plan", "--config", str(tmp_path / "config.json"))
        assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("model", "count"),
    [("gpt2-small", 124439808), ("bert-base", 110106428), ("bert-large", 336226108)],
)
def test_describe_json_reports_reference_counts(model, count):
    out = shardemu("describe", "--model", model, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["param_count"] == count
    assert report["bytes_per_device"] == report["param_bytes"] == 4 * count


@pytest.mark.slow
def test_plan_and_describe_phased_count_without_weights():
    common = ["--model", "gpt-tiny", "--mesh", "pipe=2,tensor=2,replica=2", "--phased"]
    common += ["--rts", "2", "--batch", "8", "--seq", "16", "--json"]
    plan = shardemu("plan", *common)
    assert plan.returncode == 0, plan.stderr
    report = json.loads(plan.stdout)
    assert report["param_count"] == 241_024 and report["plan"]["phases"] == 4
    assert report["model_flops"] > 0 and set(report["memory_per_device"]) == {"device", "host"}
    assert {"pipe", "replica", "tensor"} <= set(report["bytes_collective"])
    described = shardemu("describe", *common)
    assert described.returncode == 0, described.stderr
    assert json.loads(described.stdout)["phase_plan"]["per_phase"] == report["plan"]["per_phase"]


# flags whose default is not their field's, each for a reason
DERIVED_DEFAULTS = {
    ("run", "sparsity"), ("plan", "sparsity"),  # None: dense; SparsityConfig's is 0.9
    ("search", "precision"),  # None: every precision the hardware profile has
    ("search", "zero_stages"),  # "0": the text of Space.zero_stages's (0,)
    ("search", "context_sizes"),  # "1": the text of Space.context_sizes's (1,)
    ("demo", "steps"),  # the demo's own length
}  # fmt: skip


def test_every_flag_defaults_to_its_config_fields_default():
    """A flag named after a config field starts where the library does, so `shardemu run`
    and `shardemu.train()` train alike (TrainConfig.schedule once drifted from
    --schedule); the exceptions are listed with their reasons."""
    import argparse
    import dataclasses

    from shardemu.cli.parser import build_parser
    from shardemu.config import PhasedConfig, SparsityConfig, TrainConfig
    from shardemu.predict.layouts import Space
    from shardemu.predict.overlap import Overlap
    from shardemu.report.trackers import TrackingConfig

    fields = {}
    for cls in (TrainConfig, PhasedConfig, SparsityConfig, Overlap, Space, TrackingConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                fields.setdefault(f.name, []).append(f.default)
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    differ, compared = set(), 0
    for command, parser in commands.choices.items():
        for action in parser._actions:
            for default in fields.get(action.dest, ()):
                compared += 1
                if action.default != default:
                    differ.add((command, action.dest))
    assert compared > 60  # the flags of run, plan, describe, demo and search are compared
    assert differ == DERIVED_DEFAULTS


def test_a_bare_command_line_builds_the_library_default_configs():
    """The configs a command line without settings builds equal the ones Python gets
    with no arguments: the parsed flags go through the CLI's own builders, so a default
    lost between a flag and its field (a None that a builder resolves another way, a
    renamed destination) shows here."""
    from shardemu.cli import parse
    from shardemu.cli.settings import (
        overlap_config,
        phased_config,
        search_space,
        sparsity_config,
        tracking_config,
        train_config,
    )
    from shardemu.config import PhasedConfig, SparsityConfig, TrainConfig
    from shardemu.predict.layouts import Space
    from shardemu.predict.overlap import Overlap

    run = parse(["run", "--model", "gpt-tiny"])
    assert train_config(run) == TrainConfig()
    assert (phased_config(run), sparsity_config(run), tracking_config(run)) == (None,) * 3
    phased = parse(["run", "--model", "gpt-tiny", "--phased", "--sparsity", "0.9"])
    assert phased_config(phased) == PhasedConfig()
    assert sparsity_config(phased) == SparsityConfig()
    streaming = parse(["plan", "--model", "gpt-tiny", "--weight-streaming"])
    assert phased_config(streaming) == PhasedConfig(weight_streaming=True)
    assert phased_config(streaming).activations == "keep-activations"
    interleaved = parse(["plan", "--model", "gpt-tiny", "--schedule", "interleaved"])
    assert train_config(interleaved) == TrainConfig(schedule="interleaved")
    assert train_config(interleaved).virtual == 2
    plan = parse(["plan", "--model", "gpt-tiny"])
    assert overlap_config(plan) == Overlap()
    search = parse(["search", "--model", "gpt-tiny", "--hardware", "a100-80gb", "--devices", "2"])
    assert search_space(search, ("bf16",)) == Space(precisions=("bf16",))
