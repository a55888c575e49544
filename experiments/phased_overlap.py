"""How much weight streaming phased execution hides behind compute (MISSION.md, "Phased
execution": the next phase's data is streamed in "in the background, hidden behind
compute").

GPT-3 XL (1.3B, 24 layers) on an IPU-POD16 mapped as tensor=4, replica=4, global batch
16 x 1024 tokens, planned in abstract mode (nothing allocated) for a sweep of phase
counts, with the next phase's weights prefetched (one phase ahead) and without prefetch.
For each plan the cost model gives the step time, the streaming time (busy time of the
host links on the device) and how much of it is exposed (the device waits for weights).

    python experiments/phased_overlap.py [--out DIR]

Prints a table, writes DIR/results.json and DIR/phased_overlap.png (default
runs/phased_overlap-<time>), and copies the plot to docs/figures/.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardemu import use_virtual_devices

use_virtual_devices(16)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.config import Parallelism, PhasedConfig, TrainConfig  # noqa: E402
from shardemu.models import get_preset  # noqa: E402
from shardemu.predict.plan_phased import plan_phased  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402
from shardemu.report.rundir import default_run_dir  # noqa: E402
from shardemu.report.views import save_figure  # noqa: E402

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"

MODEL = get_preset("gpt3-1.3b")
PAR = Parallelism(tensor=4, replica=4)
TRAIN = TrainConfig(batch=16, seq=1024)
HARDWARE = PROFILES["ipu-pod16"]
PHASES = (1, 2, 3, 4, 6, 8, 12, 24)


def run(phases: int, prefetch: bool) -> dict:
    cfg = PhasedConfig(phases=phases, prefetch=prefetch)
    report = plan_phased(MODEL, PAR, TRAIN, cfg, hardware=HARDWARE).report
    busy = report["stream_busy_s"]
    streaming = busy.get("stage0/h2d", 0.0) + busy.get("stage0/d2h", 0.0)
    exposed = report["breakdown"]["exposed_transfer_s"]
    return {
        "phases": phases,
        "prefetch": prefetch,
        "step_time_s": report["step_time_s"],
        "compute_s": report["breakdown"]["compute_s"],
        "streaming_s": streaming,
        "exposed_streaming_s": exposed,
        "hidden_fraction": 1 - exposed / streaming if streaming else 1.0,
        "device_peak_bytes": report["memory_per_device"]["device"]["bytes"],
        "fits": report["memory_per_device"]["device"]["fits"],
        "bytes_h2d": report["bytes_h2d"],
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for prefetch, style in ((True, "o-"), (False, "s--")):
        sel = [r for r in rows if r["prefetch"] == prefetch]
        label = "prefetch one phase ahead" if prefetch else "fetch when needed"
        xs = [r["phases"] for r in sel]
        left.plot(xs, [1e3 * r["exposed_streaming_s"] for r in sel], style, label=label)
        right.plot(xs, [r["device_peak_bytes"] / 1e6 for r in sel], style, label=label)
    left.set(xscale="log", xlabel="phases", ylabel="exposed streaming per step (ms)",
             title="streaming not hidden behind compute")  # fmt: skip
    right.axhline(HARDWARE.device_memory_gb * 1e3, color="k", lw=0.8, label="IPU memory")
    right.set(xscale="log", xlabel="phases", ylabel="device peak (MB)",
              title="device memory per IPU")  # fmt: skip
    for ax in (left, right):
        ax.set_xticks(PHASES, [str(p) for p in PHASES])
        ax.legend(fontsize=8)
    fig.suptitle(f"{MODEL.name} on {HARDWARE.name} ({PAR}), batch {TRAIN.batch}x{TRAIN.seq}")
    save_figure(fig, path, FIGURES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or default_run_dir("phased_overlap"))
    out.mkdir(parents=True, exist_ok=True)
    rows = [run(n, prefetch) for prefetch in (True, False) for n in PHASES]

    table = Table(title=f"phased overlap: {MODEL.name} on {HARDWARE.name}, {PAR}")
    for col in ("phases", "prefetch", "step ms", "compute ms", "streaming ms", "exposed ms",
                "hidden", "device peak MB", "fits"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["phases"]), "yes" if r["prefetch"] else "no", f"{1e3 * r['step_time_s']:.1f}",
            f"{1e3 * r['compute_s']:.1f}", f"{1e3 * r['streaming_s']:.1f}",
            f"{1e3 * r['exposed_streaming_s']:.1f}", f"{r['hidden_fraction']:.0%}",
            f"{r['device_peak_bytes'] / 1e6:,.0f}", "yes" if r["fits"] else "no",
        )  # fmt: skip
    Console(width=150).print(table)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, out / "phased_overlap.png")
    print(f"wrote {out}/results.json, {out}/phased_overlap.png and docs/figures/phased_overlap.png")


if __name__ == "__main__":
    main()
