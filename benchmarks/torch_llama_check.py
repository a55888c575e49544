"""The roofline against Llama layers measured in PyTorch on an H100.

`benchmarks/torch_llama_layers.py` timed TorchTitan's Llama 3 8B layer (forward and
backward, BF16, one H100 80GB HBM3 at 700 W, PyTorch 2.11) at local batch 2 x
sequence 8192 and 1 x 32768, eager and compiled, with the attention kernel PyTorch
picks (cuDNN's on an H100) and with FlashAttention-2 or cuDNN's forced
(`benchmarks/measured/torch_llama_layers.json`). This script counts the same layer here
(`resident_count.layer_seconds`: XLA's count of shardemu's Llama layer, attention
fused, no recomputation, its forward and backward pieces on the `h100-sxm` roofline),
the attention core at the measured rate of the kernel the row ran
(`hardware.MEASURED_KERNELS_H100`, `FLASH_ATTENTION_2_H100`), and prints each row's
error with the other kernels' bytes as the CPU emitted them and fused.

Nothing was fitted to these layers: the rates come from kernel benchmarks
(`benchmarks/kernel_rates.py`, the GEMM calibration), so the rows are validation.

    python benchmarks/torch_llama_check.py [--measured FILE] [--out FILE]

`--measured benchmarks/measured/torch_llama_layers_h200.json` checks the same layers
timed on an H200 against the `h200-sxm` profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from shardemu.devices import use_virtual_devices

use_virtual_devices(1)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.models import as_model, get_preset  # noqa: E402
from shardemu.predict.hardware import FLASH_ATTENTION_2_H100, MEASURED_KERNELS_H100  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402
from shardemu.predict.resident_count import layer_seconds  # noqa: E402

MEASURED = Path(__file__).parent / "measured" / "torch_llama_layers.json"
PROFILE = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H200": "h200-sxm"}  # the device's
KERNEL = {"CUDNN_ATTENTION": MEASURED_KERNELS_H100["attention_efficiency"],
          "FLASH_ATTENTION": FLASH_ATTENTION_2_H100}  # fmt: skip
FORCED = {"cudnn": "CUDNN_ATTENTION", "flash2": "FLASH_ATTENTION"}
LLAMA = as_model(get_preset("llama3-8b"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/torch_llama_check.json")
    parser.add_argument("--measured", default=str(MEASURED))
    args = parser.parse_args()
    measured = json.loads(Path(args.measured).read_text())
    profile = PROFILES[PROFILE[measured["device"]]]
    rows = []
    for r in measured["rows"]:
        kernel = r["default_sdpa"] if r["sdpa"] == "default" else FORCED[r["sdpa"]]
        layer = r["fwd_bwd_seconds"] / r["layers"]
        row = {**r, "kernel": kernel, "measured_layer_s": layer}
        for fusion in ("emitted", "fused"):
            hw = dataclasses.replace(
                profile, kernel_fusion=fusion, attention_efficiency=KERNEL[kernel]
            )
            seconds = layer_seconds(LLAMA, r["batch"], r["seq"], hw, "bf16", "fused")
            row[fusion] = {"predicted_layer_s": seconds, "error": seconds / layer - 1}
        rows.append(row)
    title = f"Llama 3 8B layer, {measured['device']} ({profile.name}), PyTorch {measured['torch']}"
    table = Table(title=title)
    for col in ("batch x seq", "torch", "attention kernel", "measured ms", "emitted ms",
                "error", "fused ms", "error"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        e, f = r["emitted"], r["fused"]
        table.add_row(
            f"{r['batch']} x {r['seq']}", "compiled" if r["compiled"] else "eager", r["kernel"],
            f"{r['measured_layer_s'] * 1e3:.1f}", f"{e['predicted_layer_s'] * 1e3:.1f}",
            f"{e['error']:+.1%}", f"{f['predicted_layer_s'] * 1e3:.1f}", f"{f['error']:+.1%}",
        )  # fmt: skip
    Console(width=140).print(table)
    worst = {k: max(abs(r[k]["error"]) for r in rows) for k in ("emitted", "fused")}
    print(f"worst |error|: emitted {worst['emitted']:.1%}, fused {worst['fused']:.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "worst_abs_error": worst}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
