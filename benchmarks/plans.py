"""How long a plan takes, as a user waits for it: each row of `validation.py` and each
`shardemu plan` example of the README, in a fresh process (imports and compilation
included, nothing cached from another plan: the command's compilation cache off),
timed on this machine.

Targets (issue 37): a validation row under 5 s; GPT-3 175B phased with `--hardware` and
the 1T resident interleaved plan under 10 s. The README's examples are read from the
README itself, so the table follows it.

    python benchmarks/plans.py [--out benchmarks/results/plans.json] [--only README]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
ROW_TARGET_S, LARGE_TARGET_S = 5.0, 10.0


def readme_plans() -> list[list[str]]:
    """The README's `shardemu plan` command lines (continuations joined), as argv."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    lines = [line.split("#")[0].split() for line in text.splitlines()]
    return [line[1:] for line in lines if line[:2] == ["shardemu", "plan"]]


def _out_in(argv: list[str], folder: str) -> list[str]:
    """`argv` writing its plan into `folder` (never where the README says)."""
    if "--out" in argv:
        i = argv.index("--out")
        argv = argv[:i] + argv[i + 2 :]
    return [*argv, "--out", f"{folder}/plan"]


def timed(argv: list[str]) -> tuple[float, int, str]:
    """Wall seconds, exit status and last stderr line of `python argv` from the repo,
    the command's compilation cache off (`cli/compile_cache.py`): every plan compiles
    its pieces, as a first plan does."""
    env = {**os.environ, "SHARDEMU_CACHE": "off"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env
    )
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return time.perf_counter() - start, done.returncode, last


def validation_rows() -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from validation import CASES  # noqa: PLC0415 (benchmarks/ is on the path only here)

    rows = []
    for i, case in enumerate(CASES):
        code = (
            "import sys; sys.path.insert(0, 'benchmarks'); import validation; "
            f"validation.run(validation.CASES[{i}])"
        )
        wall, rc, last = timed(["-c", code])
        # the 1T resident interleaved plan, which this row is: 10 s
        target = LARGE_TARGET_S if "GPT 1T" in case.name else ROW_TARGET_S
        rows.append(_row(f"validation: {case.name}", wall, rc, last, target))
    return rows


def readme_rows() -> list[dict]:
    rows = []
    for argv in readme_plans():
        large = ("gpt3-175b" in argv and "--hardware" in argv) or "25600" in argv
        with tempfile.TemporaryDirectory() as tmp:
            wall, rc, last = timed(["-m", "shardemu", *_out_in(argv, tmp)])
        target = LARGE_TARGET_S if large else ROW_TARGET_S
        rows.append(_row("shardemu " + " ".join(argv), wall, rc, last, target))
    return rows


def _row(name: str, wall: float, rc: int, last: str, target: float) -> dict:
    # exit 4: planned, but the layout does not fit (the plan is still whole)
    error = "" if rc in (0, 4) else last
    return {"plan": name, "wall_s": wall, "exit": rc, "target_s": target, "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/plans.json")
    parser.add_argument("--only", choices=("README", "validation"))
    args = parser.parse_args()
    rows = [] if args.only == "validation" else readme_rows()
    rows += [] if args.only == "README" else validation_rows()
    table = Table(title="shardemu plan: seconds in a fresh process")
    for col in ("plan", "wall s", "target s", "exit", "within"):
        table.add_column(col, justify="right" if col != "plan" else "left")
    for r in rows:
        within = "yes" if r["wall_s"] <= r["target_s"] and not r["error"] else "NO"
        name = re.sub(r"\s+", " ", r["plan"])
        table.add_row(name, f"{r['wall_s']:.1f}", f"{r['target_s']:.0f}", str(r["exit"]), within)
    Console(width=200).print(table)
    failed = [r for r in rows if r["error"]]
    for r in failed:
        print(f"failed: {r['plan']}: {r['error']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
