"""The command line under random input (issue 38, item 7): random flag combinations of
`plan` and `describe`, and random bytes as a settings file, a hardware profile or a
sweep file. Every outcome is exit 0, or exit 2, 3 or 4 with one line on stderr and no
traceback (an exception escaping `main` fails the test), and nothing outside `--out`
is written. Hypothesis draws the cases; the example counts keep the suite's budget
(a valid plan of a tiny model compiles in about a second)."""

import os
from pathlib import Path

from cli_helpers import shardemu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FLAGS = {  # flag -> values to draw from: valid ones, and ones that must be refused
    "--mesh": ["tensor=2", "replica=2", "pipe=2", "tensor=3", "tensor=0", "pipe=2,tensor=2",
               "replica=-1", "bogus", "tensor=2,replica=2", "context=2", "pipe=3"],
    "--batch": ["8", "4", "0", "-1", "x", "3", "1e9"],
    "--seq": ["16", "0", "17", "nan", "8"],
    "--precision": ["fp32", "bf16", "fp8", "fp64", "fp16-mixed"],
    "--hardware": ["a100-80gb", "h100-sxm", "ipu-pod16", "cs2", "nope"],
    "--microbatch-size": ["1", "2", "0", "auto"],
    "--recompute": ["none", "selective", "full", "some"],
    "--tp-overlap": ["none", "chunked", "always"],
    "--zero": ["0", "1", "2", "3", "5"],
    "--phases": ["1", "2", "0"],
}  # fmt: skip
SWITCHES = ["--sequence-parallel", "--phased", "--json", "--allow-overflow", "--weight-streaming",
            "--account-for-loss-in-pipeline-split"]  # fmt: skip
MODELS = ["gpt-tiny", "bert-tiny", "llama-tiny", "nope"]


def files_outside(root: Path, out: Path) -> dict[str, int]:
    """Every file under `root` but `out`, with its modification time."""
    return {
        str(p): p.stat().st_mtime_ns
        for p in root.rglob("*")
        if p.is_file() and out not in p.parents
    }


def answered(done, root: Path, out: Path, before: dict[str, int]) -> None:
    assert done.returncode in (0, 2, 3, 4), (done.returncode, done.stderr)
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
        assert "Traceback" not in done.stderr
    assert files_outside(root, out) == before


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    command=st.sampled_from(["plan", "describe"]),
    model=st.sampled_from(MODELS),
    flags=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.integers(0, 8), max_size=5),
    switches=st.sets(st.sampled_from(SWITCHES), max_size=2),
)
def test_random_flags_are_planned_or_one_clear_error(tmp_path, command, model, flags, switches):
    out = tmp_path / f"out-{os.urandom(4).hex()}"
    argv = [command, "--model", model]
    for flag, pick in flags.items():
        argv += [flag, FLAGS[flag][pick % len(FLAGS[flag])]]
    argv += sorted(switches)
    if command == "plan":
        argv += ["--out", str(out)]
    before = files_outside(tmp_path, out)
    answered(shardemu(*argv), tmp_path, out, before)


@settings(
    max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    content=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
    role=st.sampled_from(["config", "hardware", "sweep"]),
    suffix=st.sampled_from([".toml", ".json"]),
)
def test_random_file_contents_are_one_clear_error(tmp_path, content, role, suffix):
    """Bytes that happen to be a valid file would run; 200 random bytes never are a
    complete settings file of a known model, so each is refused before anything runs."""
    path = tmp_path / f"{role}-{os.urandom(4).hex()}{suffix}"
    path.write_bytes(content)
    out = tmp_path / f"out-{os.urandom(4).hex()}"
    argv = {
        "config": ["plan", "--config", str(path), "--out", str(out)],
        "hardware": ["plan", "--model", "gpt-tiny", "--hardware", str(path), "--out", str(out)],
        "sweep": ["sweep", str(path), "--out", str(out)],
    }[role]
    before = files_outside(tmp_path, out)
    done = shardemu(*argv)
    assert done.returncode != 0, content
    answered(done, tmp_path, out, before)
