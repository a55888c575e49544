"""Checkpoints, resume and faults, through the command line: the runs equal one device;
a run cut after 2 steps and resumed equals, bit for bit, the run that was never cut
(resident and pipelined; a phased run's checkpoints are resumed in test_launch.py, from
two processes into one, and held to one device there); a checkpoint restores onto
another mesh; SIGINT stops a real process cleanly; a diverging run stops with exit
status 3 and valid metrics."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest
from cli_helpers import shardemu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardemu as api
from shardemu.config import Parallelism, TrainConfig
from shardemu.errors import CheckpointError, RunDirError
from shardemu.models import Model, get_preset
from shardemu.report.rundir import RunDir, read_metrics
from shardemu.run.checkpoint import Checkpoints
from shardemu.run.record import read_ledger

TINY = ["--model", "gpt-tiny", "--batch", "8", "--seq", "16"]
ENGINES = {
    "resident": ["--mesh", "tensor=2,replica=2"],
    "pipelined": ["--mesh", "pipe=2,replica=2", "--microbatches", "2"],
}
TRAIN = TrainConfig(batch=8, seq=16, seed=0)  # TINY's settings, the rest as the CLI's defaults


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per engine: an uninterrupted 3-step run with checkpoints after steps 2 and 3."""
    cache = {}

    def get(engine):
        if engine not in cache:
            out = tmp_path_factory.mktemp(engine) / "full"
            args = ["run", *TINY, *ENGINES[engine], "--steps", "3", "--seed", "0"]
            args += ["--out", str(out)]
            outcome = shardemu(*args, "--checkpoint-every", "2")
            assert outcome.returncode == 0, outcome.stderr
            cache[engine] = out
        return cache[engine]

    return get


def cut_after_two_steps(full, path):
    """A copy of the run `full` as if it had died after writing step 2's metrics but
    before its last checkpoint, while writing a later one: checkpoint 3 gone, and a
    temporary directory (orbax writes into one, then renames it) left behind."""
    shutil.copytree(full, path)
    shutil.rmtree(path / "checkpoints" / "3")
    (path / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000").mkdir()
    return path


def tear_the_last_line(run_dir):
    """metrics.jsonl as if the process died halfway through writing its last line."""
    metrics = run_dir / "metrics.jsonl"
    text = metrics.read_text()
    last = text.rstrip("\n").rsplit("\n", 1)[-1]
    metrics.write_text(text[: len(text) - len(last) - 1] + last[: len(last) // 2])


@pytest.mark.slow
def test_the_runs_equal_one_device_and_a_pipeline_records_its_stages(runs, single_device_reference):
    """The command's runs, each loss as plain `jax.jit` on one device (the witness of
    test_engine.py and test_pipeline.py); the pipelined run's metrics carry its bubble
    ((p - 1) / (m + p - 1)) and the bytes sent over `pipe`, its config.json the stages'
    layers and shared weights (the embedding on the first, the tied head on the last),
    its ledger compute on every stage."""
    want = single_device_reference(Model(get_preset("gpt-tiny")), TRAIN, 3)["losses"]
    for engine in ENGINES:
        got = losses(runs(engine))
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, want, strict=True))
    piped, pipe, microbatches = runs("pipelined"), 2, 2
    first = read_metrics(piped)[0]
    assert first["bubble_fraction"] == pytest.approx((pipe - 1) / (microbatches + pipe - 1))
    plan = json.loads((piped / "config.json").read_text())["stage_plan"]
    assert [s["layers"] for s in plan] == [[[0, 2]], [[2, 4]]]
    assert [s["shared_params"] > 0 for s in plan] == [True, True]
    ledger = read_ledger(piped)
    assert {e.stage for e in ledger if e.kind == "compute"} == set(range(pipe))
    sent = sum(e.bytes for e in ledger if e.step == 0 and e.axis == "pipe")
    assert sent == first["pipe_bytes"] == first["bytes_collective"]["pipe"] > 0
    assert read_metrics(runs("resident"))[0]["bubble_fraction"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_resume_is_bit_identical(engine, runs, tmp_path):
    """(The resident run is also cut halfway through step 2's metrics line, which a
    kill can leave: the resumed run writes that step whole.)"""
    full = runs(engine)
    resumed = cut_after_two_steps(full, tmp_path / "resumed")
    if engine == "resident":
        tear_the_last_line(resumed)
        assert [r["step"] for r in read_metrics(resumed)] == [0, 1]
    out = shardemu("run", "--resume", str(resumed), "--steps", "3")
    assert out.returncode == 0, out.stderr
    assert losses(resumed) == losses(full)  # exactly: the same state and batches
    assert [r["step"] for r in read_metrics(resumed)] == [0, 1, 2]  # step 2 once
    assert read_ledger(resumed) == read_ledger(full)  # every step's events
    config = json.loads((resumed / "config.json").read_text())
    assert config["resumed_from"] == {"run_dir": str(resumed), "steps_done": 2}
    assert config["engine"] == engine
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2",
        "3",
    ]


@pytest.mark.slow
def test_restore_onto_another_mesh_reshards(runs, tmp_path):
    """tensor=2,replica=2 written, one device restored: the third step equals the
    uninterrupted run's within the tolerance of a different mesh."""
    full = runs("resident")
    cut = cut_after_two_steps(full, tmp_path / "cut")
    new = tmp_path / "one-device"
    args = ["run", "--resume", str(cut), "--steps", "3", "--mesh", "tensor=1", "--devices", "1"]
    out = shardemu(*args, "--out", str(new))
    assert out.returncode == 0, out.stderr
    assert losses(new)[:2] == losses(full)[:2]  # the kept steps are carried over
    assert math.isclose(losses(new)[2], losses(full)[2], rel_tol=1e-5)
    assert json.loads((new / "config.json").read_text())["device_count"] == 1
    assert losses(cut) == losses(full)  # the source directory is untouched


def test_a_metrics_line_that_is_not_json_is_one_clear_error(tmp_path):
    """Only a torn last line is left out; a bad line before it is named, not skipped."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl line 2 is not a JSON record"):
        read_metrics(tmp_path)


@pytest.mark.slow
def test_a_resume_that_cannot_restore_its_state_changes_no_file(runs, tmp_path, monkeypatch):
    """The checkpoint's restore fails (made to raise here, as it does for a state that
    is not this model's): metrics.jsonl, config.json and summary.md are as they were."""
    cut = cut_after_two_steps(runs("resident"), tmp_path / "cut")
    before = {p.name: p.read_bytes() for p in cut.iterdir() if p.is_file()}

    def fails(self, steps_done, template):
        raise CheckpointError(f"the state after {steps_done} steps cannot be restored (test)")

    monkeypatch.setattr(Checkpoints, "restore", fails)
    out = shardemu("run", "--resume", str(cut), "--steps", "3")
    assert out.returncode == 2 and "cannot be restored (test)" in out.stderr, out.stderr
    assert {p.name: p.read_bytes() for p in cut.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_resume_refuses_what_it_cannot_restore(runs, tmp_path):
    cut = runs("pipelined")
    other = shardemu("run", "--resume", str(cut), "--steps", "4", "--mesh", "replica=2")
    assert other.returncode == 2
    assert "cannot be restored as" in other.stderr and "Traceback" not in other.stderr
    changed = shardemu("run", "--resume", str(cut), "--lr", "0.1")
    assert changed.returncode == 2 and "--lr cannot change when resuming" in changed.stderr
    done = shardemu("run", "--resume", str(cut), "--steps", "3")
    assert done.returncode == 2 and "give --steps more than 3" in done.stderr
    missing = shardemu("run", "--resume", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "config.json" in missing.stderr


@pytest.mark.slow
def test_sigint_stops_after_the_step_and_resume_goes_on(tmp_path):
    out = tmp_path / "run"
    argv = ["run", *TINY, "--steps", "10000", "--checkpoint-every", "1", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardemu", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert f"resume with: shardemu run --resume {out}" in " ".join(stderr.split())
    records = read_metrics(out)  # every line is valid JSON
    done = len(records)
    assert [r["step"] for r in records] == list(range(done))
    assert f"interrupted at step {done}" in (out / "summary.md").read_text()
    resumed = shardemu("run", "--resume", str(out), "--steps", str(done + 1))
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in read_metrics(out)] == list(range(done + 1))


def test_a_second_sigterm_while_compiling_exits_143_with_one_line(tmp_path):
    """Two SIGTERMs as soon as the run directory exists (its step still compiling): the
    first asks the run to stop after the compile, the second stops it at once, exit 143
    with one line and no traceback; the directory, which holds no step, is removed and
    leaves no lock behind. (It used to end in a segmentation fault.)"""
    out = tmp_path / "run"
    argv = ["run", *TINY, "--steps", "10000", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardemu", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not (out / ".lock").exists():
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().startswith("error: second SIGTERM: stopped at once")
    assert len(stderr.strip().splitlines()) == 1
    assert not (out / ".lock").exists()
    if out.exists():  # the compile outran the signals: steps were logged, and are kept
        assert read_metrics(out)


def test_a_signal_just_after_the_run_directory_is_claimed_stops_the_run_cleanly(
    tmp_path, monkeypatch
):
    """SIGINT the moment `.lock` is written (in this process: `RunDir._claim` raises it)
    is a stop request like any other: the run stops before its first step, exit 130,
    one line, and nothing left behind (no lock). The handlers used to be installed only
    after the directory was claimed, so a signal in between killed the process and left
    the directory locked (test_a_second_sigterm_while_compiling's SIGTERMs, now and then)."""
    from shardemu.report.rundir import RunDir

    claim = RunDir._claim

    def claim_and_signal(self):
        claim(self)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(RunDir, "_claim", claim_and_signal)
    out = tmp_path / "run"
    result = shardemu("run", *TINY, "--steps", "3", "--out", str(out))
    assert result.returncode == 130, result.stderr
    assert (
        result.stderr.strip() == "error: SIGINT before the first step finished: nothing was written"
    )
    assert not (out / ".lock").exists()


def test_divergence_stops_with_exit_3_and_valid_metrics(tmp_path):
    out = tmp_path / "diverged"
    result = shardemu("run", *TINY, "--steps", "4", "--lr", "1e30", "--out", str(out))
    assert result.returncode == 3, result.stderr
    message = " ".join(result.stderr.split())
    assert "training diverged at step" in message and "--lr 1e+30" in message
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]  # no NaN
    assert records[-1]["loss"] is None or records[-1]["grad_norm"] is None
    assert "stopped: training diverged" in (out / "summary.md").read_text()


@pytest.mark.slow
@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 2),
    every=st.sampled_from([None, 1, 2]),
)
def test_a_valid_command_line_runs(seed, steps, every, runs, tmp_path_factory):
    """The valid half of the command-line search (test_bad_input.py has the broken
    half): tiny runs with any seed, step count and checkpoint interval run to the end.
    They share the resident runs' settings, so they share its compiled step."""
    runs("resident")
    out_dir = tmp_path_factory.mktemp("valid") / "run"
    extra = [] if every is None else ["--checkpoint-every", str(every)]
    args = ["run", *TINY, *ENGINES["resident"], "--seed", str(seed), "--steps", str(steps)]
    out = shardemu(*args, *extra, "--out", str(out_dir))
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in read_metrics(out_dir)] == list(range(steps))
    assert (out_dir / "checkpoints").exists() == (every is not None)


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_passed_over_for_the_one_before(runs, tmp_path):
    """Checkpoint 3 with a data file cut short (a disk that filled, a bad copy): the
    resume says so in one line, keeps it as `3.damaged`, goes on from checkpoint 2, and
    its losses are the uninterrupted run's, bit for bit."""
    full = runs("resident")
    run = tmp_path / "damaged"
    shutil.copytree(full, run)
    data = sorted((run / "checkpoints" / "3" / "state").rglob("d/*"))[0]
    data.write_bytes(data.read_bytes()[:10])
    out = shardemu("run", "--resume", str(run), "--steps", "4")
    assert out.returncode == 0, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("warning: the checkpoint after 3 steps does not read back whole")
    assert "written as" in line and "resuming from the one after 2 steps" in line
    assert losses(run)[:3] == losses(full)
    assert (run / "checkpoints" / "3.damaged").is_dir()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "3.damaged", "4"]


def test_arrays_of_no_elements_are_saved_as_nothing_and_restored_as_they_were(tmp_path):
    """A model chunk without layers (the embedding's or the loss's alone:
    `--account-for-embedding-in-pipeline-split`) holds parameters of no elements, which
    orbax refuses to save: a checkpoint leaves them out and a restore puts back the
    template's, the other arrays read back bit for bit."""
    import numpy as np

    mesh = api.make_mesh(replica=2, devices=jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
    state = {
        "chunks": [{"w": jax.device_put(np.zeros((0, 3), np.float32), sharding)},
                   {"w": jax.device_put(np.arange(6.0, dtype=np.float32).reshape(2, 3), sharding)}],
        "step": jax.device_put(np.int32(7)),
    }  # fmt: skip
    checkpoints = Checkpoints(tmp_path / "run")
    checkpoints.save(1, state, {"engine": "pipelined"})
    template = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), state)
    restored = checkpoints.restore(1, template)
    checkpoints.close()
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.shape == want.shape and got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class Crash(Exception):
    """A process dying mid-run: nothing after it runs, no summary, no final ledger."""


@pytest.mark.slow
def test_the_ledger_after_a_crash_and_resume_holds_every_step(runs, tmp_path):
    """A run that dies after its second step (its checkpoint after one step written, the
    end-of-run ledger never): the ledger written with each checkpoint holds step 0, and
    after the resume ledger.json has every step's events, equal to the uninterrupted
    run's, as metrics.jsonl has every step's record."""
    out = tmp_path / "crashed"
    train = TrainConfig(batch=8, seq=16, steps=3, seed=0)

    def crash(record):
        if record["step"] == 1:
            raise Crash

    with pytest.raises(Crash):
        api.train(get_preset("gpt-tiny"), Parallelism(tensor=2, replica=2), train, out,
                  jax.devices()[:4], checkpoint_every=1, on_step=crash)  # fmt: skip
    assert {e.step for e in read_ledger(out)} == {0}
    resumed = shardemu("run", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    full = runs("resident")
    assert read_ledger(out) == read_ledger(full)
    assert losses(out) == losses(full)


def test_a_run_directory_has_one_writer(tmp_path):
    """A second writer of a run directory (two `--resume` at once) is refused, naming
    the live one; a dead writer's lock is reported, not broken behind the user's back;
    a finished writer leaves no lock."""
    first = RunDir(tmp_path / "run")
    with pytest.raises(RunDirError, match=rf"being written by process {os.getpid()} "):
        RunDir(tmp_path / "run", reopen=True)
    first.finish()
    assert not (tmp_path / "run" / ".lock").exists()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "run" / ".lock").write_text(f"{gone.pid}\n")
    with pytest.raises(RunDirError, match=rf"process {gone.pid}, which is no longer running"):
        RunDir(tmp_path / "run", reopen=True)
    (tmp_path / "run" / ".lock").unlink()
    RunDir(tmp_path / "run", reopen=True).finish()  # broken by hand: the run goes on
