"""BERT-Large on an IPU-POD16 (MISSION.md: p=4, t=1, r=4; "a pipeline depth of 8 holds
the whole model and optimizer state on chip").

1. Real: a few training steps of BERT-Large's layers (d=1024, 16 heads; 4 of the 24
   layers, one a stage, so that 16 virtual devices fit a 2-core laptop), pipelined over 4
   stages and replicated 4 times, at sequence length 32 (GPipe, 4 microbatches).
2. Predicted: the resident pipelined step on the `ipu-pod16` profile at sequence length
   128 (phase-1 pre-training), float16 (the IPU has no bfloat16), for pipeline depth 4
   (p=4, r=4) and 8 (p=8, r=2): step time, its breakdown, and memory per IPU (weights,
   gradients, two Adam moments and the activations a stage holds) against the GC200's
   900 MB.

    python experiments/bert_large_pod16.py [--out DIR] [--steps 3]

Prints the tables, writes DIR (the real run's directory, with prediction.json and
bert_large_pod16.png; default runs/bert_large_pod16-<time>), and copies the plot to
docs/figures/.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardemu import use_virtual_devices

use_virtual_devices(16)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.config import Parallelism, TrainConfig  # noqa: E402
from shardemu.models import get_preset  # noqa: E402
from shardemu.predict.plan_resident import plan_resident  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402
from shardemu.report.rundir import default_run_dir  # noqa: E402
from shardemu.report.views import save_figure  # noqa: E402
from shardemu.run.runner import train  # noqa: E402

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"

HW = PROFILES["ipu-pod16"]
GLOBAL_BATCH, SEQ, MICROBATCH = 512, 128, 4
DEPTHS = {4: Parallelism(pipe=4, replica=4), 8: Parallelism(pipe=8, replica=2)}


def predict(depth: int, par: Parallelism) -> dict:
    model = get_preset("bert-large").replace(param_dtype="float16")
    train = TrainConfig(batch=GLOBAL_BATCH, seq=SEQ, schedule="1f1b")
    r = plan_resident(model, par, train, MICROBATCH, HW).report
    mem = r["memory_per_device"]["device"]
    return {
        "depth": depth,
        "mesh": str(par),
        "microbatches": r["microbatches"],
        "step_time_s": r["step_time_s"],
        "sequences_per_s": GLOBAL_BATCH / r["step_time_s"],
        "bubble_fraction": r["bubble_fraction"],
        "breakdown": r["breakdown"],
        "memory_per_ipu": mem["bytes"],
        "fits": mem["fits"],
        "utilisation": r["utilisation"],
    }


def plot(rows: list[dict], losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.6))
    a.plot(range(len(losses)), losses, "o-")
    a.set(xlabel="step", ylabel="loss", title="real steps, 16 virtual devices")
    names = [f"depth {r['depth']}" for r in rows]
    b.bar(names, [r["memory_per_ipu"] / 1e6 for r in rows], color="#4c72b0")
    b.axhline(HW.device_memory_gb * 1e3, color="k", lw=1, label="GC200 memory")
    b.set(ylabel="MB per IPU", title="memory per IPU (predicted)")
    b.legend(fontsize=8)
    c.bar(names, [r["sequences_per_s"] for r in rows], color="#55a868")
    c.set(ylabel="sequences / s", title=f"throughput on {HW.name} (predicted)")
    fig.suptitle(f"BERT-Large, seq {SEQ}, global batch {GLOBAL_BATCH}, microbatch {MICROBATCH}")
    save_figure(fig, path, FIGURES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out or default_run_dir("bert_large_pod16"))
    console = Console(width=150)

    # BERT-Large's width with 4 of its 24 layers (one a stage): 24 layers on 16 virtual
    # devices overrun this 2-core machine (XLA's CPU collectives time out after 40 s)
    real_model = get_preset("bert-large").replace(name="bert-large-4-layers", num_layers=4)
    real = train(
        real_model,
        DEPTHS[4],
        TrainConfig(steps=args.steps, batch=16, seq=32, microbatches=4, seed=0, learning_rate=1e-4),
        out=out,
    )
    console.print(f"real run: losses {[round(x, 4) for x in real.losses]} -> {out}")

    rows = [predict(depth, par) for depth, par in DEPTHS.items()]
    table = Table(title=f"BERT-Large on {HW.name}: seq {SEQ}, global batch {GLOBAL_BATCH}")
    for col in ("depth", "mesh", "microbatches", "step s", "seq/s", "bubble", "exposed comm s",
                "MB per IPU", "fits 900 MB", "utilisation"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["depth"]), r["mesh"], str(r["microbatches"]), f"{r['step_time_s']:.3f}",
            f"{r['sequences_per_s']:,.0f}", f"{r['bubble_fraction']:.0%}",
            f"{r['breakdown']['exposed_communication_s']:.3f}",
            f"{r['memory_per_ipu'] / 1e6:,.0f}", "yes" if r["fits"] else "no",
            f"{r['utilisation']:.1%}",
        )  # fmt: skip
    console.print(table)
    (out / "prediction.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, real.losses, out / "bert_large_pod16.png")
    print(f"wrote {out}/prediction.json, {out}/bert_large_pod16.png, docs/figures/")


if __name__ == "__main__":
    main()
