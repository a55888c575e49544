"""Emulation overhead: step time on 8-device meshes relative to one device.

For a small GPT and a small BERT at the same global batch, every mesh runs the same
training step (same losses, as tests/test_engine.py and tests/test_pipeline.py show);
this measures what sharding over virtual CPU devices costs in wall time, tensor and
replica meshes and pipelined ones under every schedule (GPipe, 1F1B, interleaved 1F1B
where the stages' layers split into two chunks). `flops ratio` is the step's forward
and backward FLOPs from its ledger (XLA's counts, summed over devices; the optimizer,
which every replica repeats by design, left out) divided by the single-device step's:
above 1 is work the mesh repeats. All meshes are measured in one process, stepping
in turn (one step of each mesh per round), so ratios compare like with like even on a
machine whose load changes; absolute times depend on this machine and its load. Rows
marked `sp` run with sequence parallelism (`TrainConfig.sequence_parallel`).

    python benchmarks/overhead.py [--steps 10] [--out benchmarks/results/overhead.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

from shardemu.devices import use_virtual_devices

use_virtual_devices(8, reuse_memory=True)  # these time steps

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu import (  # noqa: E402
    Model,
    ModelConfig,
    PipelinedEngine,
    PipelinedTrainer,
    ResidentEngine,
    SyntheticCorpus,
    TrainConfig,
    Trainer,
    make_mesh,
)
from shardemu.report.rundir import versions  # noqa: E402

MODELS = [
    ModelConfig("gpt-small-bench", "gpt", 4096, 4, 256, 8, 1024, 128),
    ModelConfig(
        "bert-small-bench",
        "bert",
        4096,
        4,
        256,
        8,
        1024,
        128,
        layer_norm_eps=1e-12,
        gelu_approximate=False,
    ),
]
# (pipe, tensor, replica, microbatches, schedule, sequence parallel); the first is the
# single-device baseline
MESHES = [
    (1, 1, 1, 1, None, False),
    (1, 1, 8, 1, None, False),
    *((1, t, r, 1, None, sp) for t, r in ((2, 4), (4, 2), (8, 1)) for sp in (False, True)),
    *(
        (p, t, r, m, schedule, False)
        for p, t, r, m in ((2, 2, 2, 4), (2, 1, 4, 2), (4, 1, 2, 4), (4, 2, 1, 4))
        for schedule in ("gpipe", "1f1b", "interleaved")
        if schedule != "interleaved" or p == 2  # 4 layers on 4 stages: no second chunk
    ),
]


class Timed:
    """One mesh's engine, stepped through the same batches as every other mesh."""

    def __init__(self, model: Model, mesh: tuple[int, int, int], train: TrainConfig) -> None:
        grid = make_mesh(*mesh, devices=jax.devices()[: mesh[0] * mesh[1] * mesh[2]])
        pipelined = mesh[0] > 1 or train.microbatches > 1
        self.engine = (
            PipelinedEngine(PipelinedTrainer(model, grid, train))
            if pipelined
            else ResidentEngine(Trainer(model, grid, train))
        )
        self.state = self.engine.init(train.seed)
        self.times: list[float] = []
        self.losses: list[float] = []
        self.flops = 0.0

    def step(self, batch: dict, timed: bool) -> None:
        t0 = time.perf_counter()
        result = self.engine.step(self.state, batch)
        if timed:
            self.times.append(time.perf_counter() - t0)
        self.losses.append(result.loss)
        self.state, self.flops = result.state, result.counts["model_flops"]


def time_meshes(model: Model, trains: list[tuple[tuple[int, int, int], TrainConfig]], steps: int):
    """Every mesh steps once per round, in turn, so that a change in the machine's load
    falls on all of them alike; two warm-up rounds (compilation) are not timed."""
    timed = [Timed(model, mesh, train) for mesh, train in trains]
    first = trains[0][1]
    corpus = SyntheticCorpus(model.cfg.vocab_size, seed=first.seed)
    for step in range(steps + 2):
        batch = model.batch(corpus, step, first.batch, first.seq)
        for t in timed:
            t.step(batch, timed=step >= 2)
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/overhead.json")
    args = parser.parse_args()
    train = TrainConfig(batch=args.batch, seq=args.seq)

    rows = []
    for cfg in MODELS:
        model = Model(cfg)
        trains = [
            (
                (pipe, tensor, replica),
                dataclasses.replace(
                    train,
                    sequence_parallel=sequence_parallel,
                    microbatches=micro,
                    schedule=schedule or "1f1b",
                    virtual=2 if schedule == "interleaved" else 1,
                ),
            )
            for pipe, tensor, replica, micro, schedule, sequence_parallel in MESHES
        ]
        timed = time_meshes(model, trains, args.steps)
        base = timed[0]
        base_s = statistics.median(base.times)
        for (pipe, tensor, replica, micro, schedule, sequence_parallel), r in zip(
            MESHES, timed, strict=True
        ):
            rows.append(
                {
                    "model": cfg.name,
                    "pipe": pipe,
                    "tensor": tensor,
                    "replica": replica,
                    "microbatches": micro,
                    "schedule": schedule,
                    "sequence_parallel": sequence_parallel,
                    "devices": pipe * tensor * replica,
                    "median_step_s": statistics.median(r.times),
                    "ratio_to_single_device": statistics.median(r.times) / base_s,
                    # forward and backward FLOPs, all devices, over the single-device
                    # step's: > 1 is work the mesh repeats
                    "flops_ratio": r.flops / base.flops,
                    "max_loss_rel_diff": max(
                        abs(a - b) / abs(b) for a, b in zip(r.losses, base.losses, strict=True)
                    ),
                }
            )

    table = Table(
        title=f"step time relative to 1 device (global batch {args.batch}, seq {args.seq})"
    )
    cols = (
        "model",
        "p x t x r",
        "M",
        "schedule",
        "step s",
        "ratio",
        "flops ratio",
        "loss rel diff",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            row["model"],
            f"{row['pipe']} x {row['tensor']} x {row['replica']}",
            str(row["microbatches"]),
            (row["schedule"] or "-") + (" sp" if row["sequence_parallel"] else ""),
            f"{row['median_step_s']:.4f}",
            f"{row['ratio_to_single_device']:.2f}",
            f"{row['flops_ratio']:.2f}",
            f"{row['max_loss_rel_diff']:.1e}",
        )
    Console().print(table)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "overhead",
        "batch": args.batch,
        "seq": args.seq,
        "steps_timed": args.steps,
        "machine": {"cpus": platform.machine(), "python": platform.python_version()},
        "versions": versions(),
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
