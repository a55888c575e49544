"""The roofline against a real accelerator: GPT layers predicted vs measured.

`benchmarks/gpu_calibration.py` timed GPT layers (forward and backward, one device,
sequence 2048, widths 768 to 8192, batch 1 and 4, bfloat16 and float32) with XLA on a
GPU. `benchmarks/measured/` holds two runs with JAX 0.11.2 (2026-11-26): on an NVIDIA
H100 80GB HBM3 (`gpu_calibration_h100.json`, the default; widths 768 to 4096, the
device time ran out before 8192) and on an NVIDIA H200 (`gpu_calibration_h200.json`,
all widths). This script compiles the same layers here on the CPU, reads their matmuls and
memory traffic as the planner does (`accounting/matmuls.py`), times them with the
roofline (`predict/roofline.py`) of the profile of the measured device (`h200-sxm` for
an H200, `h100-sxm` for an H100) and prints each prediction's error twice: with the
other kernels' bytes as the CPU emitted them (`kernel_fusion = "emitted"`, the
default) and fused as an accelerator fuses them (`"fused"`, `accounting/fusion.py`).
No roofline parameter was fitted to these layers: the profiles' efficiency, matmul
latency and memory efficiency are the H100 matmul and bandwidth calibration's (the H200
borrows them).

    python benchmarks/roofline_check.py [--measured FILE] [--profile NAME]
        [--out benchmarks/results/roofline_check.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.accounting.matmuls import Kernels  # noqa: E402
from shardemu.models import custom_model  # noqa: E402
from shardemu.models.gpt import GPTBlock  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402
from shardemu.predict.roofline import run_seconds  # noqa: E402

PROFILE_OF = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H200": "h200-sxm"}


def predicted(row: dict[str, Any], profile: str) -> dict[str, Any]:
    """`profile`'s roofline of one measured layer, counted from its CPU compilation,
    with the other kernels' bytes as emitted and as fused."""
    cfg = custom_model("gpt", 1, row["hidden"], row["heads"], None, row["seq"])
    block = GPTBlock(cfg.replace(param_dtype=row["dtype"]))
    dtype = jnp.dtype(row["dtype"])
    x = jax.ShapeDtypeStruct((row["batch"], row["seq"], row["hidden"]), dtype)
    mask = jax.ShapeDtypeStruct((1, row["seq"], row["seq"]), jnp.bool_)
    params = jax.eval_shape(block.init, jax.random.key(0), x, mask)

    def fwd_bwd(params: Any, x: jax.Array, mask: jax.Array) -> Any:
        (y, _), vjp = jax.vjp(lambda p, x: block.apply(p, x, mask), params, x)
        return vjp((jnp.ones_like(y), None))

    compiled = jax.jit(fwd_bwd).lower(params, x, mask).compile()
    text, flops = compiled.as_text(), compiled.cost_analysis()["flops"]
    counted = Kernels(text, dtype.itemsize)
    matmuls, emitted = counted.read()
    precision = "fp32" if row["dtype"] == "float32" else "bf16"
    hw = PROFILES[profile].at_precision(precision)
    out = dict(row)
    for fusion, moved in (("emitted", emitted), ("fused", counted.memory(target=True))):
        seconds = run_seconds(flops, matmuls, moved, hw)
        out[fusion] = {"predicted_s": seconds, "other_bytes": moved,
                       "error": seconds / row["seconds"] - 1}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", default="benchmarks/measured/gpu_calibration_h100.json")
    parser.add_argument("--profile", help="the profile to time with (default: the device's)")
    parser.add_argument("--out", default="benchmarks/results/roofline_check.json")
    args = parser.parse_args()
    measured = json.loads(Path(args.measured).read_text())
    profile = args.profile or PROFILE_OF.get(measured["device"])
    if profile not in PROFILES:
        parser.error(f"no profile for {measured['device']!r}; name one with --profile")
    rows = [predicted(r, profile) for r in measured["layers"]]
    title = f"GPT layer, forward + backward: {profile} roofline vs {measured['device']}"
    table = Table(title=title)
    for col in ("hidden", "batch", "dtype", "measured ms", "emitted ms", "error",
                "fused ms", "error"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["hidden"]), str(r["batch"]), r["dtype"], f"{r['seconds'] * 1e3:.2f}",
            f"{r['emitted']['predicted_s'] * 1e3:.2f}", f"{r['emitted']['error']:+.0%}",
            f"{r['fused']['predicted_s'] * 1e3:.2f}", f"{r['fused']['error']:+.0%}",
        )  # fmt: skip
    Console().print(table)
    summary = {}
    for fusion in ("emitted", "fused"):
        errors = [abs(r[fusion]["error"]) for r in rows]
        summary[fusion] = {"median_abs_error": statistics.median(errors),
                           "worst_abs_error": max(errors)}  # fmt: skip
        median, worst = summary[fusion]["median_abs_error"], summary[fusion]["worst_abs_error"]
        print(f"{fusion}: median |error| {median:.1%}, worst {worst:.1%}")
    out = {"device": measured["device"], "profile": profile, **summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
