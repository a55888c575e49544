"""The roofline's matmul parameters fitted again from the stored matmul sweep.

`benchmarks/gpu_calibration.py` timed 248 matmuls on a lent H100 (m, k, n each of 64,
256, 1024, 4096 and 16384, those that fit in 2 GiB; bfloat16 and float32, which JAX
runs as TF32 on the tensor cores; 8 chained pairs in one executable, the median of 5
calls: `benchmarks/measured/gpu_calibration_h100_matmuls.json`, JAX 0.11.2, 700 W). This
script times each of them with the planner's own roofline (`layer_check.matmul_log_errors`:
2 m k n FLOPs and its operands' and output's bytes, on the measured device's profile,
`h100-sxm` or `h200-sxm`, at the row's precision) over a grid of large-matmul
efficiencies and per-kernel latencies, and prints the pair that minimises the squared log
errors beside the profile's own (`hardware.MEASURED_ON_H100`): the calibration the GPU
profiles rest on, reproducible from stored data. The same sweep on a lent H200
(`--measured benchmarks/measured/gpu_calibration_h200_matmuls.json`) checks whether the
H200 may keep the H100's figures.

    python benchmarks/matmul_fit.py [--measured FILE] [--out benchmarks/results/matmul_fit.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardemu.predict.hardware import MEASURED_ON_H100  # noqa: E402
from shardemu.predict.layer_check import MATMUL_DTYPES, matmul_log_errors  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402

MEASURED = Path(__file__).parent / "measured" / "gpu_calibration_h100_matmuls.json"
EFFICIENCIES = np.round(np.arange(0.50, 0.951, 0.01), 2)
LATENCIES_US = np.arange(0.0, 30.01, 0.5)


def log_errors(rows: list[dict], profile: str, efficiency: float, latency_us: float) -> list[float]:
    """log(predicted / measured) of each row on `profile` with these two figures."""
    hw = dataclasses.replace(PROFILES[profile], efficiency=efficiency, matmul_latency_us=latency_us)
    return matmul_log_errors(rows, hw)


def summary(errors: list[float]) -> dict[str, float]:
    magnitudes = [abs(e) for e in errors]
    return {
        "median_abs_log_error": statistics.median(magnitudes),
        "worst_abs_log_error": max(magnitudes),
        "mean_log_error": statistics.fmean(errors),
    }


def least_squares(rows: list[dict], profile: str) -> tuple[float, float]:
    """The (efficiency, latency) of the grid whose log errors on `rows` square to least."""
    best = min(
        ((e, t) for e in EFFICIENCIES for t in LATENCIES_US),
        key=lambda p: sum(x * x for x in log_errors(rows, profile, float(p[0]), float(p[1]))),
    )
    return float(best[0]), float(best[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", default=str(MEASURED))
    parser.add_argument("--out", default="benchmarks/results/matmul_fit.json")
    args = parser.parse_args()
    measured = json.loads(Path(args.measured).read_text())
    rows = measured["matmuls"]
    profile = "h200-sxm" if "H200" in measured["device"] else "h100-sxm"
    fits = {
        "profile": (MEASURED_ON_H100["efficiency"], MEASURED_ON_H100["matmul_latency_us"]),
        "fitted": least_squares(rows, profile),
        # the training dtype's rows alone: TF32 may run at another fraction of its peak
        "fitted to bfloat16": least_squares([r for r in rows if r["dtype"] == "bfloat16"], profile),
    }
    table = Table(title=f"{len(rows)} matmuls on {measured['device']} against `{profile}`")
    for col in ("figures", "efficiency", "latency (us)", "rows", "median |log err|", "worst",
                "mean log err"):  # fmt: skip
        table.add_column(col, justify="right")
    out = {"device": measured["device"], "profile": profile, "rows": len(rows), "fits": {}}
    for name, (efficiency, latency) in fits.items():
        errors = log_errors(rows, profile, efficiency, latency)
        groups = {"all": errors}
        for dtype in MATMUL_DTYPES:
            groups[dtype] = [e for e, r in zip(errors, rows, strict=True) if r["dtype"] == dtype]
        big = [e for e, r in zip(errors, rows, strict=True) if 2 * r["m"] * r["k"] * r["n"] >= 1e10]
        groups["2mkn >= 1e10"] = big
        out["fits"][name] = {"efficiency": efficiency, "matmul_latency_us": latency}
        for group, values in groups.items():
            s = summary(values)
            out["fits"][name][group] = {"rows": len(values), **s}
            table.add_row(name, f"{efficiency:.2f}", f"{latency:.1f}", f"{group} ({len(values)})",
                          f"{s['median_abs_log_error']:.3f}", f"{s['worst_abs_log_error']:.2f}",
                          f"{s['mean_log_error']:+.3f}")  # fmt: skip
    Console(width=110).print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
