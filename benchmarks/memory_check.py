"""Activation memory per GPT layer: the analytic model against what three stacks keep.

For a GPT layer in BF16 at sequence 2048 (widths 1024 to 4096, batch 1 and 4), the bytes
one layer keeps for its backward:

- `analytic`: `shardemu/predict/activations.py` (Korthikanti et al. 2022's tensors);
- `pytorch`: measured on an NVIDIA H200 by `benchmarks/torch_layer_memory.py` (a
  Megatron-style layer with dropout, the attention core unfused and as FlashAttention),
  from `benchmarks/measured/torch_layer_memory.json`;
- `xla gpu`: XLA's buffer assignment for shardemu's own `GPTBlock` (no dropout, softmax
  in float32) compiled for the H200 by `benchmarks/gpu_calibration.py` (its `memory`
  section, `benchmarks/measured/gpu_calibration_h200.json`);
- `xla cpu`: the same program compiled here on the CPU, as a resident plan counts it.

Every figure is per layer: a step of 4 layers less a step of 2, halved. The CPU
compiles take about 4 minutes (XLA folds the backward of the constant cotangent).

    python benchmarks/memory_check.py [--out benchmarks/results/memory_check.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_platforms", "cpu")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.models import Model, custom_model  # noqa: E402
from shardemu.predict.activations import layer_bytes  # noqa: E402

HERE = Path(__file__).parent


def _calibration() -> Any:
    """`gpu_calibration.py`, whose `memory` section compiles the layers here too."""
    spec = importlib.util.spec_from_file_location("gpu_calibration", HERE / "gpu_calibration.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def rows() -> list[dict[str, Any]]:
    """One row per width and batch: each witness's bytes per layer."""
    torch = json.loads((HERE / "measured" / "torch_layer_memory.json").read_text())["rows"]
    gpu = json.loads((HERE / "measured" / "gpu_calibration_h200.json").read_text())["memory"]
    cpu = _calibration().memory()
    out = []
    for g, c in zip(gpu, cpu, strict=True):
        key = (g["hidden"], g["batch"], g["seq"])
        model = Model(custom_model("gpt", 1, g["hidden"], g["heads"], None, g["seq"]))
        kept = {"xla gpu": g["kept_per_layer"], "xla cpu": c["kept_per_layer"]}
        for flash in (False, True):
            core, name = ("sdpa", "flash") if flash else ("plain", "plain")
            (measured,) = (
                t for t in torch if (t["hidden"], t["batch"], t["seq"]) == key and t["core"] == core
            )
            kept[f"pytorch {name}"] = measured["per_layer"]["allocated"]
            kept[f"analytic {name}"] = layer_bytes(
                model, g["batch"], g["seq"], 2, dropout=True, fused_attention=flash
            )
        kept["analytic bare"] = layer_bytes(model, g["batch"], g["seq"], 2)
        out.append({"hidden": key[0], "batch": key[1], "seq": key[2], "bytes": kept})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/memory_check.json")
    args = parser.parse_args()
    title = "Activation memory per GPT layer, MB (BF16, sequence 2048; bare: no dropout)"
    table = Table(title=title)
    measured = rows()
    columns = list(measured[0]["bytes"])
    for col in ("hidden", "batch", *columns):
        table.add_column(col, justify="right")
    for r in measured:
        cells = [f"{r['bytes'][c] / 1e6:.0f}" for c in columns]
        table.add_row(str(r["hidden"]), str(r["batch"]), *cells)
    Console().print(table)
    for a, b in (("pytorch plain", "analytic plain"), ("pytorch flash", "analytic flash"),
                 ("xla gpu", "analytic bare"), ("xla cpu", "xla gpu")):  # fmt: skip
        ratios = [r["bytes"][a] / r["bytes"][b] for r in measured]
        print(f"{a} / {b}: {min(ratios):.3f} to {max(ratios):.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(measured, indent=1))


if __name__ == "__main__":
    main()
