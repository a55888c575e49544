"""Two processes, one mesh (`run --processes 2`): jax.distributed with gloo CPU
collectives, four virtual devices each, the same losses as one device; and a process
that dies takes the run down with one clear line, instead of a hang."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import shardemu

from shardemu.config import TrainConfig
from shardemu.models import Model, get_preset
from shardemu.report.rundir import read_metrics

ARGS = ["run", "--model", "gpt-tiny", "--mesh", "tensor=2,replica=4", "--batch", "8"]
ARGS += ["--seq", "16", "--seed", "0"]
TRAIN = TrainConfig(batch=8, seq=16, seed=0)  # ARGS's settings, the rest as the CLI's defaults


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def environ(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


def as_one_device(records: list[dict], single_device_reference) -> None:
    """Every step's loss of a run of ARGS as one device's (plain `jax.jit`)."""
    assert [r["step"] for r in records] == list(range(len(records)))
    model = Model(get_preset("gpt-tiny"))
    want = single_device_reference(model, TRAIN, len(records))["losses"]
    for a, b in zip(records, want, strict=True):
        assert math.isclose(a["loss"], b, rel_tol=1e-5), (a["loss"], b)


@pytest.mark.slow
def test_phased_stages_on_two_processes_checkpoint_as_one_device_and_a_lost_process_stops_them(
    tmp_path, single_device_reference
):
    """Two processes of four devices run phased stages (pipe=2: each process one stage,
    streaming its own two phases from its host tier with rts 2, the activations and
    gradients crossing between the processes, `stages/crossing.py`) from nothing, and
    save their shards of each checkpoint into process 0's run directory
    (`run/spanning.py`). Then one process is killed: the launcher stops the other,
    removes the killed one's scratch copy of the run and says so in one line, instead of
    a hang. The checkpoints restore in one process, which goes on: every loss as one
    device's (plain `jax.jit`, the witness of test_phased.py). Before programs were
    issued one at a time across processes (`devices.settled`), phased runs hung in gloo
    all-reduces, now and then in steps and every time in saves. (One launch covers the
    phased engine, the stages and the launcher: each further launch costs the suite 15
    to 20 CPU-seconds.)"""
    out = tmp_path / "stages"
    layout = ["--mesh", "pipe=2,tensor=2,replica=2", "--phased", "--phases", "2", "--rts", "2"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardemu", *ARGS, *layout, "--steps", "100000",
         "--checkpoint-every", "2", "--out", str(out), "--processes", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        if (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 4:
            break
        time.sleep(0.2)
    assert launcher.poll() is None, launcher.stderr.read()
    assert json.loads((out / "config.json").read_text())["device_count"] == 8

    pids = children(launcher.pid)
    assert len(pids) == 2
    second = next(p for p in pids if b"SHARDEMU_PROCESS_ID=1\0" in environ(p))
    variables = dict(v.split(b"=", 1) for v in environ(second).split(b"\0") if b"=" in v)
    scratch = Path(variables[b"SHARDEMU_SCRATCH"].decode())
    assert (scratch / "metrics.jsonl").exists()  # process 1's copy of the run directory
    killed_at = time.monotonic()
    subprocess.run(["kill", "-9", str(second)], check=True)
    _, stderr = launcher.communicate(timeout=60)
    assert time.monotonic() - killed_at < 60
    assert launcher.returncode == 128 + signal.SIGKILL
    assert "process 1 of 2 ended with signal 9; the others were stopped" in stderr
    assert not any(p in children(launcher.pid) for p in pids)
    assert not scratch.exists()  # removed by the launcher, though its process was killed

    steps = read_metrics(out)[-1]["step"] + 2  # past every checkpoint the run saved
    resumed = shardemu("run", "--resume", str(out), "--steps", str(steps))
    assert resumed.returncode == 0, resumed.stderr
    records = read_metrics(out)
    assert len(records) == steps
    as_one_device(records, single_device_reference)


# a launcher's process as `launch` starts it, without JAX's distributed system: it
# watches its launcher and stops at SIGTERM as a run does (`run/faults.py`: exits)
WATCHER = """
import signal, sys, time
from shardemu.launch import watch_launcher
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
watch_launcher()
print("watching", flush=True)
time.sleep(60)
"""
# the launcher's stand-in: starts the process with the launcher's variables, then waits
LAUNCHER = """
import os, subprocess, sys, time
from shardemu.launch import ENV_ID, ENV_LAUNCHER, ENV_SCRATCH
env = {**os.environ, ENV_LAUNCHER: str(os.getpid()), ENV_ID: "1", ENV_SCRATCH: sys.argv[1]}
child = subprocess.Popen([sys.executable, "-c", sys.argv[2]], env=env)
print(child.pid, flush=True)
time.sleep(60)
"""


def ended(pid: int) -> bool:
    """Whether `pid` has exited (gone, or a zombie its new parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_launcher_killed_outright_leaves_no_process_running(tmp_path):
    """SIGKILL to the launcher (which it cannot forward): its process sees it gone,
    stops as at a scheduler's SIGTERM, and removes its copy of the run directory
    (process 1's scratch folder), instead of training on for ever. (A run launched so
    and its launcher killed kept both its processes stepping until they were killed by
    hand.)"""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "metrics.jsonl").write_text("{}\n")
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(scratch), WATCHER], stdout=subprocess.PIPE, text=True
    )
    child = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline() == "watching\n"
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while not ended(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ended(child)
        assert not scratch.exists()
    finally:
        launcher.kill()
        if not ended(child):
            subprocess.run(["kill", "-9", str(child)], check=False)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--processes", "3"], "--processes 3 must be positive and divide the 8 devices"),
        (["--processes", "0"], "--processes 0 must be positive"),
        # checked before any process starts, so said once, not by every process
        (["--processes", "2", "--phased", "--microbatches", "2"], "--microbatches and"),
    ],
)
def test_what_processes_cannot_do_is_refused(extra, message):
    out = shardemu(*ARGS, *extra)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_only_process_0_says_how_to_resume(monkeypatch):
    """Ctrl-C reaches every process; a process other than 0 keeps its copy of the run in a
    scratch folder, so its resume hint would point there: it exits 130 and says nothing,
    and process 0 prints the hint."""
    import shardemu.cli as cli
    from shardemu.errors import RunInterrupted

    def interrupted(args):
        raise RunInterrupted(f"stopped; resume with: shardemu run --resume {args.out}", 2)

    monkeypatch.setitem(cli.COMMANDS, "run", interrupted)
    for index, says in (("1", False), ("0", True)):
        monkeypatch.setenv("SHARDEMU_PROCESS_ID", index)
        out = shardemu("run", "--model", "gpt-tiny", "--out", "scratch")
        assert out.returncode == 130 and ("resume with" in out.stderr) == says, out.stderr
