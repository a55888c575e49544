"""Drawing a large plan's timeline: `timeline.png` and `trace.json` of ~100k spans.

The plan is the 1T-class GPT of issue 15 (105 layers, d=20480, pipe 35 x tensor 8,
microbatches of one sequence) on A100s: hundreds of microbatches through 35 stages, one
span per piece, send and collective. The plan itself is counted first (not timed here);
then the two views are timed. `timeline.png` merges spans that touch into bars and paints
them into the figure's pixels (`report/views.py`).

    python benchmarks/views.py [--batch 360] [--out benchmarks/results/views.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from shardemu.devices import use_virtual_devices

use_virtual_devices(8)

from shardemu.config import Parallelism, TrainConfig  # noqa: E402
from shardemu.models import custom_model  # noqa: E402
from shardemu.predict.plan_resident import plan_resident  # noqa: E402
from shardemu.predict.profiles import get_hardware  # noqa: E402
from shardemu.report.rundir import write_measurement  # noqa: E402
from shardemu.report.views import merged_bars, plot_timeline, write_trace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=360)
    parser.add_argument("--out", default="benchmarks/results/views.json")
    args = parser.parse_args()
    model = custom_model("gpt", 105, 20480, 128, 51200, 2048)
    par = Parallelism(pipe=35, tensor=8)
    t0 = time.perf_counter()
    train = TrainConfig(batch=args.batch, seq=2048)
    timeline = plan_resident(model, par, train, 1, get_hardware("a100-80gb")).timeline
    plan_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        bars = sum(len(b) for b in merged_bars(timeline).values())
        merge_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        plot_timeline(timeline, Path(tmp) / "timeline.png", "benchmark")
        png_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        write_trace(timeline, Path(tmp) / "trace.json")
        trace_s = time.perf_counter() - t0
    row = {
        "batch": args.batch,
        "spans": len(timeline.spans),
        "bars": bars,
        "plan_s": plan_s,
        "merge_s": merge_s,
        "timeline_png_s": png_s,
        "trace_json_s": trace_s,
    }
    print(
        f"{row['spans']:,} spans -> {bars:,} bars | plan {plan_s:.1f} s | merge "
        f"{merge_s:.2f} s | timeline.png {png_s:.2f} s | trace.json {trace_s:.2f} s"
    )
    out = write_measurement(args.out, {"row": row})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
