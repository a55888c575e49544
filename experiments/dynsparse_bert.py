"""Dynamic sparse pre-training of BERT at laptop scale (MISSION.md, "Dynamic sparse
pre-training of BERT"; Dietrich et al. 2021).

BERT models of two widths (4 layers and 4 heads; d = 64 and 128)
are trained for real on one device on `--data stdlib` (the standard library's source as
bytes, one file in ten held out):

- dense;
- static sparse and dynamic sparse at sparsity 0.9 with blocks of 1, 4, 8 and 16
  (dynamic: `--sparse-updates` pattern updates, prune ratio 0.5 cosine-decayed, random
  regrowth, as in the source).

Each run's training cost is its model FLOPs over all steps, counted the sparse way
(`model_flops_sparse`: a zero weight costs nothing); its quality is the held-out MLM
loss after the last step. The Pareto plot (validation MLM loss against training FLOPs)
shows whether, at matched FLOPs, sparse beats dense, dynamic beats static, and small
blocks beat large ones, as the source found; the table and `verdict` say so in numbers.

    python experiments/dynsparse_bert.py [--out DIR] [--steps 200]

18 runs; about 11 minutes on a 2-core laptop (each run compiles for about 18 s).

Writes DIR (one run directory per model, results.json, dynsparse_bert.png; default
runs/dynsparse_bert-<time>) and copies the plot to docs/figures/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shardemu import use_virtual_devices

use_virtual_devices(1)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.config import Parallelism, SparsityConfig, TrainConfig  # noqa: E402
from shardemu.models import custom_model  # noqa: E402
from shardemu.report.rundir import default_run_dir, read_metrics  # noqa: E402
from shardemu.report.views import save_figure  # noqa: E402
from shardemu.run.runner import train  # noqa: E402

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"
WIDTHS = (64, 128)
BLOCKS = (1, 4, 8, 16)
SPARSITY = 0.9
BATCH, SEQ, LR = 16, 64, 2e-3


def variants(steps: int) -> list[tuple[str, SparsityConfig | None]]:
    """(name, sparsity) of every training recipe: dense, then static and dynamic at
    each block size."""
    out: list[tuple[str, SparsityConfig | None]] = [("dense", None)]
    for mode in ("static", "dynamic"):
        for block in BLOCKS:
            cfg = SparsityConfig(SPARSITY, block=block, mode=mode, updates=max(1, steps // 10))
            out.append((f"{mode}-b{block}", cfg))
    return out


def run_one(width: int, name: str, sparse: SparsityConfig | None, steps: int, out: Path) -> dict:
    model = custom_model("bert", 4, width, 4, 264, SEQ)  # 256 bytes + 4 special, padded
    cfg = TrainConfig(
        steps=steps, batch=BATCH, seq=SEQ, seed=0, learning_rate=LR, warmup_steps=steps // 10,
        data="stdlib", sparsity=sparse,
    )  # fmt: skip
    run_dir = out / f"d{width}-{name}"
    t0 = time.perf_counter()
    train(model, Parallelism(), cfg, out=run_dir, eval_every=steps)
    records = read_metrics(run_dir)
    key = "model_flops_sparse" if sparse else "model_flops"
    return {
        "width": width,
        "recipe": name,
        "train_flops": sum(r[key] for r in records),
        "density": records[-1].get("density", 1.0),
        "val_mlm_loss": records[-1]["val_mlm_loss"],
        "val_loss": records[-1]["val_loss"],
        "train_loss": records[-1]["loss"],
        "seconds": time.perf_counter() - t0,
        "run_dir": str(run_dir),
    }


def verdict(rows: list[dict]) -> dict[str, str]:
    """The source's three findings, checked on these runs. At one width, a sparse
    model costs about a tenth of the dense one's layer FLOPs, so "matched FLOPs" pairs a
    sparse run with the dense run of the next smaller width when its FLOPs are within
    a factor of 2."""
    by = {(r["width"], r["recipe"]): r for r in rows}
    dyn_wins = [
        by[(w, f"dynamic-b{b}")]["val_mlm_loss"] < by[(w, f"static-b{b}")]["val_mlm_loss"]
        for w in WIDTHS for b in BLOCKS
    ]  # fmt: skip
    small_first = [
        by[(w, "dynamic-b1")]["val_mlm_loss"] <= by[(w, "dynamic-b16")]["val_mlm_loss"]
        for w in WIDTHS
    ]
    matched = []
    for small, large in zip(WIDTHS, WIDTHS[1:], strict=False):
        dense, sparse = by[(small, "dense")], by[(large, "dynamic-b1")]
        if 0.5 < sparse["train_flops"] / dense["train_flops"] < 2:
            matched.append((small, large, sparse["val_mlm_loss"] < dense["val_mlm_loss"]))
    return {
        "dynamic beats static": f"{sum(dyn_wins)} of {len(dyn_wins)} (width, block) pairs",
        "block 1 beats block 16 (dynamic)": f"{sum(small_first)} of {len(small_first)} widths",
        "sparse (wider) beats dense at matched FLOPs": ", ".join(
            f"d{large} dynamic-b1 vs d{small} dense: {'yes' if win else 'no'}"
            for small, large, win in matched
        )
        or "no pair within 2x FLOPs",
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    for recipe in recipes:
        pts = sorted((r["train_flops"], r["val_mlm_loss"]) for r in rows if r["recipe"] == recipe)
        style = "k-o" if recipe == "dense" else ("-s" if recipe.startswith("dynamic") else "--^")
        ax.plot(*zip(*pts, strict=True), style, label=recipe, ms=4)
    widths = "/".join(map(str, WIDTHS))
    ax.set(xscale="log", xlabel="training FLOPs (model FLOPs, zeros not counted)",
           ylabel="validation MLM loss (nats)",
           title=f"BERT, 4 layers, d={widths}, sparsity {SPARSITY}, stdlib bytes")  # fmt: skip
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path, FIGURES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out or default_run_dir("dynsparse_bert"))
    console = Console(width=150)
    rows = []
    for width in WIDTHS:
        for name, sparse in variants(args.steps):
            rows.append(run_one(width, name, sparse, args.steps, out))
            r = rows[-1]
            console.print(
                f"d{width} {name}: val MLM {r['val_mlm_loss']:.4f}, FLOPs {r['train_flops']:.3g}, "
                f"{r['seconds']:.0f} s"
            )
    table = Table(title=f"dynamic sparse BERT on stdlib bytes, {args.steps} steps")
    for col in ("width", "recipe", "density", "train FLOPs", "val MLM loss", "train loss"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["width"]), r["recipe"], f"{r['density']:.3f}",
                      f"{r['train_flops']:.3g}", f"{r['val_mlm_loss']:.4f}",
                      f"{r['train_loss']:.4f}")  # fmt: skip
    console.print(table)
    found = verdict(rows)
    for claim, result in found.items():
        console.print(f"{claim}: {result}")
    (out / "results.json").write_text(json.dumps({"rows": rows, "verdict": found}, indent=2) + "\n")
    plot(rows, out / "dynsparse_bert.png")
    print(f"wrote {out}/results.json, {out}/dynsparse_bert.png, docs/figures/")


if __name__ == "__main__":
    main()
