"""Block sparsity in phased plans: weight bytes streamed and the predicted step.

BERT-Base phased (weights in the host tier, streamed per phase), dense and block-sparse,
on three kinds of hardware: an IPU-POD16 (pipe 4, tensor 4), one Cerebras CS-2 (weights
from MemoryX) and four A100s (tensor 4). The sparse host tier stores the non-zero blocks
and their coordinates (`shardemu/sparsity/storage.py`), so streamed bytes fall with
density on every profile; the step falls only where the profile runs block-sparse
matmuls faster than dense (`Hardware.block_sparse_speed`: a CS-2 at any block size; a
GC200 past break-even at density 0.1 with 16 x 16 blocks; the GPUs not at all). All plans
are abstract (nothing allocated) and counted in one process.

    python benchmarks/sparse_streaming.py [--out benchmarks/results/sparse_streaming.json]
"""

from __future__ import annotations

import argparse
import time

from shardemu.devices import use_virtual_devices

use_virtual_devices(8)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.config import Parallelism, PhasedConfig, SparsityConfig, TrainConfig  # noqa: E402
from shardemu.models import get_preset  # noqa: E402
from shardemu.predict.plan_phased import plan_phased  # noqa: E402
from shardemu.predict.profiles import get_hardware  # noqa: E402
from shardemu.report.rundir import write_measurement  # noqa: E402

SYSTEMS = (("ipu-pod16", "pipe=4,tensor=4"), ("cs2", ""), ("a100-80gb", "tensor=4"))
SPARSITY = (None, (0.9, 16), (0.9, 4), (0.95, 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/sparse_streaming.json")
    args = parser.parse_args()
    model = get_preset("bert-base")
    rows = []
    for hw_name, mesh in SYSTEMS:
        dense = None
        for setting in SPARSITY:
            sparse = None if setting is None else SparsityConfig(setting[0], block=setting[1])
            train = TrainConfig(batch=16, seq=128, sparsity=sparse)
            t0 = time.perf_counter()
            report = plan_phased(
                model,
                Parallelism.parse(mesh),
                train,
                PhasedConfig(),
                hardware=get_hardware(hw_name),
            ).report
            row = {
                "hardware": hw_name,
                "mesh": mesh or "1 device",
                "sparsity": 0.0 if sparse is None else sparse.sparsity,
                "block": None if sparse is None else sparse.block,
                "bytes_h2d_weights": report["bytes_h2d_weights"],
                "compute_s": report["breakdown"]["compute_s"],
                "step_time_s": report["step_time_s"],
                "sparse_matmul_time": report.get("sparse_matmul_time", 1.0),
                "plan_s": time.perf_counter() - t0,
            }
            dense = dense or row
            row["streamed_vs_dense"] = row["bytes_h2d_weights"] / dense["bytes_h2d_weights"]
            row["step_vs_dense"] = row["step_time_s"] / dense["step_time_s"]
            rows.append(row)
    table = Table(title="BERT-Base phased, batch 16 x 128: dense vs block-sparse")
    for col in ("hardware", "sparsity", "block", "weights in (MB)", "x dense", "matmul time",
                "compute (ms)", "step (ms)", "x dense"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["hardware"], f"{r['sparsity']:.2f}", str(r["block"] or "-"),
            f"{r['bytes_h2d_weights'] / 1e6:,.1f}", f"{r['streamed_vs_dense']:.3f}",
            f"{r['sparse_matmul_time']:.2f}", f"{r['compute_s'] * 1e3:.3f}",
            f"{r['step_time_s'] * 1e3:.3f}", f"{r['step_vs_dense']:.3f}",
        )  # fmt: skip
    Console(width=150).print(table)
    out = write_measurement(args.out, {"rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
