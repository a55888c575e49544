"""Emulation overhead: step time on 8-device meshes relative to one device.

For a small GPT and a small BERT at the same global batch, every mesh runs the same
training step (same losses, as tests/test_engine.py and tests/test_pipeline.py show);
this measures what sharding over virtual CPU devices costs in wall time, tensor and
replica meshes and pipelined (GPipe) ones. `flops ratio` is XLA's executed FLOPs summed
over devices divided by the single-device step's: it shows repeated work. All meshes
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

from shardemu import Model, ModelConfig, SyntheticCorpus, TrainConfig, Trainer, make_mesh  # noqa: E402
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
# (pipe, tensor, replica, microbatches); the first is the single-device baseline
MESHES = [
    (1, 1, 1, 1),
    (1, 1, 8, 1),
    (1, 2, 4, 1),
    (1, 4, 2, 1),
    (1, 8, 1, 1),
    (2, 2, 2, 4),
    (2, 1, 4, 2),
    (4, 1, 2, 4),
    (4, 2, 1, 4),
]


def time_steps(model: Model, mesh: tuple[int, int, int], train: TrainConfig, steps: int) -> dict:
    devices = jax.devices()[: mesh[0] * mesh[1] * mesh[2]]
    trainer = Trainer(model, make_mesh(*mesh, devices=devices), train)
    t0 = time.perf_counter()
    compiled = trainer.compiled()
    compile_s = time.perf_counter() - t0
    flops_per_device = compiled.cost_analysis()["flops"]
    params, opt_state = trainer.init(train.seed)
    corpus = SyntheticCorpus(model.cfg.vocab_size, seed=train.seed)
    times, losses = [], []
    for step in range(steps + 2):  # two warm-up steps are not timed
        batch = trainer.put_batch(model.batch(corpus, step, train.batch, train.seq))
        t0 = time.perf_counter()
        result = trainer.step(params, opt_state, batch)
        losses.append(float(result.loss))
        if step >= 2:
            times.append(time.perf_counter() - t0)
        params, opt_state = result.params, result.opt_state
    return {
        "median_step_s": statistics.median(times),
        "compile_s": compile_s,
        "losses": losses,
        "flops_per_device": flops_per_device,
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
        for pipe, tensor, replica, micro in MESHES:
            train = dataclasses.replace(train, microbatches=micro)
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
                    "devices": devices,
                    "median_step_s": r["median_step_s"],
                    "ratio_to_single_device": r["median_step_s"] / base["median_step_s"],
                    # executed FLOPs, all devices, over the single-device step's: > 1 is
                    # work the mesh repeats (bubble iterations, replicated embedding/head)
                    "flops_ratio": r["flops_per_device"] * devices / base["flops_per_device"],
                    "compile_s": r["compile_s"],
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
        "step s",
        "ratio",
        "flops ratio",
        "compile s",
        "loss rel diff",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            row["model"],
            f"{row['pipe']} x {row['tensor']} x {row['replica']}",
            str(row["microbatches"]),
            f"{row['median_step_s']:.4f}",
            f"{row['ratio_to_single_device']:.2f}",
            f"{row['flops_ratio']:.2f}",
            f"{row['compile_s']:.1f}",
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
