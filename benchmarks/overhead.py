"""Emulation overhead: step time on 8-device meshes relative to one device.

For a small GPT and a small BERT at the same global batch, every mesh runs the same
training step (same losses, as tests/test_engine.py and tests/test_pipeline.py show);
this measures what sharding over virtual CPU devices costs in wall time, tensor and
replica meshes and pipelined ones under every schedule (GPipe, 1F1B, interleaved 1F1B
where the stages' layers split into two chunks). `flops ratio` is the step's forward
and backward FLOPs from its ledger (XLA's counts, summed over devices; the optimizer,
which every replica repeats by design, left out) divided by the single-device step's:
above 1 is work the mesh repeats. All meshes
are measured in one process, so ratios compare like with like; absolute times depend on
this machine and its load.

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

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

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
# (pipe, tensor, replica, microbatches, schedule); the first is the single-device baseline
MESHES = [
    (1, 1, 1, 1, None),
    (1, 1, 8, 1, None),
    (1, 2, 4, 1, None),
    (1, 4, 2, 1, None),
    (1, 8, 1, 1, None),
    *(
        (p, t, r, m, schedule)
        for p, t, r, m in ((2, 2, 2, 4), (2, 1, 4, 2), (4, 1, 2, 4), (4, 2, 1, 4))
        for schedule in ("gpipe", "1f1b", "interleaved")
        if schedule != "interleaved" or p == 2  # 4 layers on 4 stages: no second chunk
    ),
]


def time_steps(model: Model, mesh: tuple[int, int, int], train: TrainConfig, steps: int) -> dict:
    devices = jax.devices()[: mesh[0] * mesh[1] * mesh[2]]
    grid = make_mesh(*mesh, devices=devices)
    pipelined = mesh[0] > 1 or train.microbatches > 1
    engine = (
        PipelinedEngine(PipelinedTrainer(model, grid, train))
        if pipelined
        else ResidentEngine(Trainer(model, grid, train))
    )
    state = engine.init(train.seed)
    corpus = SyntheticCorpus(model.cfg.vocab_size, seed=train.seed)
    times, losses, counts = [], [], {}
    for step in range(steps + 2):  # two warm-up steps (compilation) are not timed
        batch = model.batch(corpus, step, train.batch, train.seq)
        t0 = time.perf_counter()
        result = engine.step(state, batch)
        if step >= 2:
            times.append(time.perf_counter() - t0)
        losses.append(result.loss)
        state, counts = result.state, result.counts
    return {
        "median_step_s": statistics.median(times),
        "losses": losses,
        "flops": counts["model_flops"],
    }


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
        base = None
        for pipe, tensor, replica, micro, schedule in MESHES:
            train = dataclasses.replace(
                train,
                microbatches=micro,
                schedule=schedule or "1f1b",
                virtual=2 if schedule == "interleaved" else 1,
            )
            r = time_steps(model, (pipe, tensor, replica), train, args.steps)
            base = base or r
            devices = pipe * tensor * replica
            rows.append(
                {
                    "model": cfg.name,
                    "pipe": pipe,
                    "tensor": tensor,
                    "replica": replica,
                    "microbatches": micro,
                    "schedule": schedule,
                    "devices": devices,
                    "median_step_s": r["median_step_s"],
                    "ratio_to_single_device": r["median_step_s"] / base["median_step_s"],
                    # forward and backward FLOPs, all devices, over the single-device
                    # step's: > 1 is work the mesh repeats
                    "flops_ratio": r["flops"] / base["flops"],
                    "max_loss_rel_diff": max(
                        abs(a - b) / abs(b)
                        for a, b in zip(r["losses"], base["losses"], strict=True)
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
            row["schedule"] or "-",
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
