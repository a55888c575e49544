"""The roofline against transformer layers measured in PyTorch on an H100 and an H200.

`benchmarks/torch_layers.py` timed layers forward and backward in PyTorch 2.11 on one
GPU at 700 W (`benchmarks/measured/`): TorchTitan's Llama 3 8B layer in BF16 at local
batch 2 x 8192 and 1 x 32768 (`torch_llama_layers.json`, on an H100 80GB HBM3;
`torch_llama_layers_h200.json`, on an H200), and BERT-Large's in FP16 at 256 x 128
(`torch_bert_layers.json`, H100), eager and compiled, with the attention kernel PyTorch
picks (cuDNN's on both GPUs) and with FlashAttention-2 or cuDNN's forced. This script
counts the same layer here (`layer_check.layer_seconds`: XLA's count of shardemu's
layer, attention fused, no recomputation, its forward and backward pieces on the
device's profile's roofline), the attention core at the measured rate of the kernel
the row ran (`hardware.MEASURED_KERNELS_H100`, `FLASH_ATTENTION_2_H100`), and prints
each row's error with the other kernels' bytes as the CPU emitted them and fused.
Dropout (BERT's rows at 0.1) is not in shardemu's layers: those rows say how much it
costs.

Nothing was fitted to these layers: the rates come from kernel benchmarks
(`benchmarks/kernel_rates.py`, the GEMM calibration), so the rows are validation.

    python benchmarks/torch_layers_check.py [--measured FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from shardemu.devices import use_virtual_devices

use_virtual_devices(8)  # a tensor-parallel shard (SHARDS) is counted on its mesh

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.models import as_model, get_preset  # noqa: E402
from shardemu.predict.hardware import FLASH_ATTENTION_2_H100, MEASURED_KERNELS_H100  # noqa: E402
from shardemu.predict.layer_check import layer_seconds  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402

MEASURED = Path(__file__).parent / "measured" / "torch_llama_layers.json"
PROFILE = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H200": "h200-sxm"}  # the device's
KERNEL = {"CUDNN_ATTENTION": MEASURED_KERNELS_H100["attention_efficiency"],
          "FLASH_ATTENTION": FLASH_ATTENTION_2_H100}  # fmt: skip
FORCED = {"cudnn": "CUDNN_ATTENTION", "flash2": "FLASH_ATTENTION"}
PRECISION = {"llama3-8b": "bf16", "llama3-405b-tp8": "bf16", "bert-large": "fp16-mixed"}
# a tensor-parallel shard's measured layer (`torch_layers.py`): its model and TP degree
SHARDS = {"llama3-405b-tp8": ("llama3-405b", 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/torch_layers_check.json")
    parser.add_argument("--measured", default=str(MEASURED))
    args = parser.parse_args()
    measured = json.loads(Path(args.measured).read_text())
    profile = PROFILES[PROFILE[measured["device"]]]
    name = measured.get("model", "llama3-8b")  # the first files held Llama's alone
    preset, tensor = SHARDS.get(name, (name, 1))
    model = as_model(get_preset(preset))
    rows = []
    for r in measured["rows"]:
        kernel = r["default_sdpa"] if r["sdpa"] == "default" else FORCED[r["sdpa"]]
        layer = r["fwd_bwd_seconds"] / r["layers"]
        row = {**r, "kernel": kernel, "measured_layer_s": layer}
        for fusion in ("emitted", "fused"):
            hw = dataclasses.replace(
                profile, kernel_fusion=fusion, attention_efficiency=KERNEL[kernel]
            )
            seconds = layer_seconds(
                model, r["batch"], r["seq"], hw, PRECISION[name], "fused", tensor
            )
            row[fusion] = {"predicted_layer_s": seconds, "error": seconds / layer - 1}
        rows.append(row)
    title = f"{name} layer, {measured['device']} ({profile.name}), PyTorch {measured['torch']}"
    table = Table(title=title)
    for col in ("batch x seq", "torch", "attention kernel", "dropout", "measured ms", "emitted ms",
                "error", "fused ms", "error"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        e, f = r["emitted"], r["fused"]
        table.add_row(
            f"{r['batch']} x {r['seq']}", "compiled" if r["compiled"] else "eager", r["kernel"],
            str(r.get("dropout", 0.0)), f"{r['measured_layer_s'] * 1e3:.1f}",
            f"{e['predicted_layer_s'] * 1e3:.1f}",
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
