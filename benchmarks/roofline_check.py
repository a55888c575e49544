"""The roofline against a real accelerator: GPT layers predicted vs measured on an H100.

`benchmarks/gpu_calibration.py` timed GPT layers (forward and backward, one device,
sequence 2048, widths 768 to 8192, batch 1 and 4, bfloat16 and float32) with XLA on an
H100. This script compiles the same layers here on the CPU, reads their matmuls and
memory traffic as the planner does (`accounting/matmuls.py`), times them with the
`h100-sxm` profile's roofline (`predict/roofline.py`) and prints each prediction's
error. No roofline parameter was fitted to these layers: the profile's efficiency,
matmul latency and memory efficiency come from the matmul and bandwidth measurements
of the same run.

    python benchmarks/roofline_check.py [--measured benchmarks/results/gpu_calibration_h100.json]
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

from shardemu.accounting.matmuls import kernels  # noqa: E402
from shardemu.models import custom_model  # noqa: E402
from shardemu.models.gpt import GPTBlock  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402
from shardemu.predict.roofline import run_seconds  # noqa: E402


def predicted(row: dict[str, Any]) -> dict[str, Any]:
    """The h100-sxm roofline of one measured layer, counted from its CPU compilation."""
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
    matmuls, moved = kernels(text, dtype.itemsize)
    precision = "fp32" if row["dtype"] == "float32" else "bf16"
    hw = PROFILES["h100-sxm"].at_precision(precision)
    seconds = run_seconds(flops, tuple((m.flops, m.bytes) for m in matmuls), moved, hw)
    return {**row, "predicted_s": seconds, "error": seconds / row["seconds"] - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", default="benchmarks/results/gpu_calibration_h100.json")
    parser.add_argument("--out", default="benchmarks/results/roofline_check.json")
    args = parser.parse_args()
    measured = json.loads(Path(args.measured).read_text())
    rows = [predicted(r) for r in measured["layers"]]
    table = Table(title=f"GPT layer, forward + backward: roofline vs {measured['device']}")
    for col in ("hidden", "batch", "dtype", "measured ms", "predicted ms", "error"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["hidden"]), str(r["batch"]), r["dtype"], f"{r['seconds'] * 1e3:.2f}",
            f"{r['predicted_s'] * 1e3:.2f}", f"{r['error']:+.0%}",
        )  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    summary = {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}
    Console().print(table)
    median, worst = summary["median_abs_error"], summary["worst_abs_error"]
    print(f"median |error| {median:.1%}, worst {worst:.1%}")
    out = {"device": measured["device"], **summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
