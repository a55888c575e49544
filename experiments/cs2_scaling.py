"""Cerebras weight streaming: how training throughput scales with the number of CS-2
systems (MISSION.md, "Weight streaming": SwarmX "data-parallel scaling to 192 systems,
claimed near-linear"; Andromeda: 16 CS-2, "near-perfect linear" scaling for GPT-class
models).

GPT models of 1.3B, 6.7B, 13B and 20B parameters at sequence 2048 are planned in
abstract mode (`shardemu plan --weight-streaming --systems N --hardware cs2`, nothing
allocated) on 1, 2, 4, 8 and 16 systems:

- **weak scaling** (the sequences per system fixed, as Cerebras-GPT trained:
  `Cerebras/modelzoo`, Cerebras_GPT/README.md, sequence 2048: 1.3B batch 528 on 4 CS-2
  = 132 per system; 6.7B 1040 on 8 = 130; 13B 720 on 8 = 90 (and 1080 on 12, also 90).
  Cerebras-GPT has no 20B model: the 20B row uses GPT-NeoX-20B's shape (44 layers,
  d 6144, 64 heads; Black et al. 2022) and 13B's 90 sequences per system);
- **strong scaling** of the 1.3B model (its global batch of 528 fixed, split over N,
  up to 132 systems), to find where scaling stops being linear and which stream
  saturates.

Each system streams `--microbatch-size` sequences through the layers at a time (the
largest divisor of its batch whose activations fit the CS-2's 40 GB; Cerebras runs
micro-batches the same way), and every pass streams the weights in again. Parameters,
activations and gradients are float32 (shardemu has no precision flag yet), so
streamed bytes and activation memory are twice the FP16 figures. With float32 the
attention scores alone at sequence 2048 do not fit one sequence of the 6.7B model on a
CS-2, so the backward recomputes each layer from its input (`--activations recompute`)
instead of keeping its activations.

Memory: the device tier's peak against the CS-2's 40 GB, the host tier (weights and
Adam state) against MemoryX's 2.4 PB, beside the A100-80GB GPUs the same model needs
in tensor x pipeline parallelism just to hold its float32 weights, gradients and Adam
moments (16 bytes a parameter; activations not counted).

Finally a real run: gpt-tiny on 4 virtual systems for 3 steps, whose losses equal a
one-device run's.

    python experiments/cs2_scaling.py [--out DIR] [--quick]

Prints tables, writes DIR/results.json and DIR/cs2_scaling.png (default
runs/cs2_scaling-<time>), and copies the plot to docs/figures/.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from shardemu import use_virtual_devices

use_virtual_devices(132)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.config import Parallelism, PhasedConfig, TrainConfig  # noqa: E402
from shardemu.errors import CapacityError  # noqa: E402
from shardemu.models import custom_model, get_preset  # noqa: E402
from shardemu.predict.plan_phased import plan_phased  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402
from shardemu.report.rundir import default_run_dir  # noqa: E402
from shardemu.report.views import save_figure  # noqa: E402
from shardemu.run.runner import train  # noqa: E402

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"
CS2 = PROFILES["cs2"]
A100 = PROFILES["a100-80gb"]
SEQ = 2048
VOCAB = 50257
# name: (layers, hidden, heads, sequences per system)
MODELS = {
    "1.3B": (24, 2048, 16, 132),
    "6.7B": (32, 4096, 32, 130),
    "13B": (40, 5120, 40, 90),
    "20B": (44, 6144, 64, 90),
}
SYSTEMS = (1, 2, 4, 8, 16)
STRONG = ("1.3B", 528, (1, 2, 4, 8, 16, 48, 132))  # model, global batch, systems
POLICY = PhasedConfig(weight_streaming=True, activations="recompute")
BYTES_PER_PARAM_GPU = 16  # float32 weights, gradients and Adam's two moments


def plan(name: str, systems: int, per_system: int, micro: int) -> dict:
    layers, hidden, heads, _ = MODELS[name]
    model = custom_model("gpt", layers, hidden, heads, VOCAB, SEQ)
    train_cfg = TrainConfig(batch=per_system * systems, seq=SEQ)
    return plan_phased(
        model, Parallelism(replica=systems), train_cfg, POLICY, hardware=CS2,
        microbatch_size=micro,
    ).report  # fmt: skip


def divisors(n: int, at_most: int) -> list[int]:
    """The divisors of `n` up to `at_most`, largest first."""
    return [d for d in range(min(n, at_most), 0, -1) if n % d == 0]


def largest_fitting_micro(name: str, per_system: int) -> int:
    """The most sequences a system streams through at a time: the largest divisor of
    its batch whose plan fits the CS-2's device memory (tried on one system; the
    activations of fewer sequences take less)."""
    for micro in divisors(per_system, per_system):
        try:
            plan(name, 1, micro, micro)
            return micro
        except CapacityError:
            continue
    raise CapacityError(f"{name}: not even one sequence of {SEQ} fits a CS-2")


def row(name: str, systems: int, per_system: int, micro: int, mode: str) -> dict:
    report = plan(name, systems, per_system, micro)
    busy = report["stream_busy_s"]
    step = report["step_time_s"]
    return {
        "model": name,
        "mode": mode,
        "systems": systems,
        "batch": per_system * systems,
        "sequences_per_system": per_system,
        "microbatch_size": micro,
        "passes": report["passes"],
        "param_count": report["param_count"],
        "step_time_s": step,
        "tokens_per_s": report["tokens_per_s"],
        "utilisation": report["utilisation"],
        "compute_s": report["breakdown"]["compute_s"],
        "broadcast_busy_s": busy.get("stage0/broadcast", 0.0),
        "reduce_busy_s": busy.get("stage0/reduce", 0.0),
        "host_update_s": busy.get("stage0/host", 0.0),
        "exposed_transfer_s": report["breakdown"]["exposed_transfer_s"],
        "bytes_broadcast": report["bytes_broadcast"],
        "bytes_reduce": report["bytes_reduce"],
        "device_bytes": report["memory_per_device"]["device"]["bytes"],
        "host_bytes": report["memory_per_device"]["host"]["bytes"],
    }


def bound_by(r: dict) -> str:
    """The busiest stream of a system: the one that sets the step time."""
    streams = {
        "compute": r["compute_s"],
        "SwarmX broadcast": r["broadcast_busy_s"],
        "SwarmX reduce": r["reduce_busy_s"],
    }
    return max(streams, key=streams.get)


def gpus_needed(params: int) -> int:
    """A100-80GB GPUs (a power of two, t x p) that hold the model's float32 weights,
    gradients and Adam moments, activations not counted."""
    need = math.ceil(BYTES_PER_PARAM_GPU * params / A100.device_memory_bytes)
    return 1 << max(0, need - 1).bit_length() if need > 1 else 1


def speedups(rows: list[dict]) -> None:
    """Speed-up and efficiency against the same model and mode on one system."""
    base = {(r["model"], r["mode"]): r["tokens_per_s"] for r in rows if r["systems"] == 1}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[(r["model"], r["mode"])]
        r["efficiency"] = r["speedup"] / r["systems"]
        r["bound_by"] = bound_by(r)


def real_run(out: Path) -> dict:
    """gpt-tiny on 4 virtual systems against one device, three steps each."""
    model = get_preset("gpt-tiny")
    cfg = TrainConfig(steps=3, batch=8, seq=16)
    streamed = train(
        model, Parallelism(replica=4), cfg, out=out / "gpt-tiny-4-systems",
        devices=jax.devices()[:4],
        phased=PhasedConfig(weight_streaming=True, activations="keep-activations"),
        hardware=CS2,
    )  # fmt: skip
    one = train(model, Parallelism(), cfg, out=out / "gpt-tiny-1-device", devices=jax.devices()[:1])
    worst = max(abs(a / b - 1) for a, b in zip(streamed.losses, one.losses, strict=True))
    return {"losses_4_systems": streamed.losses, "losses_1_device": one.losses,
            "max_rel_diff": worst}  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strong_rows = [r for r in rows if r["mode"] == "strong"]
    fig, axes = plt.subplots(1, 2 if strong_rows else 1, figsize=(11 if strong_rows else 6, 4.2))
    weak, strong = axes if strong_rows else (axes, None)
    for name in MODELS:
        sel = [r for r in rows if r["model"] == name and r["mode"] == "weak"]
        weak.plot([r["systems"] for r in sel], [r["speedup"] for r in sel], "o-", label=name)
    weak.plot(SYSTEMS, SYSTEMS, "k:", lw=0.8, label="linear")
    weak.set(xscale="log", yscale="log", xlabel="CS-2 systems", ylabel="speed-up",
             title="weak scaling (Cerebras-GPT sequences per system)")  # fmt: skip
    weak.legend(fontsize=8)
    if strong_rows:
        xs = [r["systems"] for r in strong_rows]
        speed = [r["speedup"] for r in strong_rows]
        strong.plot(xs, speed, "o-", label=f"{STRONG[0]}, batch {STRONG[1]}")
        strong.plot(xs, xs, "k:", lw=0.8, label="linear")
        for r in strong_rows:
            strong.annotate(f"{r['microbatch_size']}/pass", (r["systems"], r["speedup"]),
                            fontsize=7, textcoords="offset points", xytext=(4, -10))  # fmt: skip
        strong.set(xscale="log", yscale="log", xlabel="CS-2 systems", ylabel="speed-up",
                   title="strong scaling (global batch fixed)")  # fmt: skip
        strong.legend(fontsize=8)
    fig.suptitle("Weight streaming on CS-2 (SwarmX, MemoryX), GPT at sequence 2048, float32")
    save_figure(fig, path, FIGURES)


def print_tables(rows: list[dict], real: dict) -> None:
    console = Console(width=170)
    table = Table(title="weight streaming on N CS-2 systems (predicted, float32)")
    cols = ("model", "mode", "N", "seq/system", "micro", "passes", "step s", "tokens/s",
            "speed-up", "eff.", "compute s", "broadcast s", "reduce s", "update s",
            "bound by", "device GB", "host GB", "A100s (t x p)")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(
            r["model"], r["mode"], str(r["systems"]), str(r["sequences_per_system"]),
            str(r["microbatch_size"]), str(r["passes"]), f"{r['step_time_s']:.2f}",
            f"{r['tokens_per_s']:,.0f}", f"{r['speedup']:.2f}", f"{r['efficiency']:.0%}",
            f"{r['compute_s']:.2f}", f"{r['broadcast_busy_s']:.2f}",
            f"{r['reduce_busy_s']:.2f}", f"{r['host_update_s']:.3f}", r["bound_by"],
            f"{r['device_bytes'] / 1e9:.1f}", f"{r['host_bytes'] / 1e9:.0f}",
            str(gpus_needed(r["param_count"])),
        )  # fmt: skip
    console.print(table)
    console.print(
        f"real run, gpt-tiny on 4 virtual systems vs one device: losses "
        f"{[round(x, 5) for x in real['losses_4_systems']]}, largest relative difference "
        f"{real['max_rel_diff']:.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--quick", action="store_true", help="1.3B only, weak scaling (for a smoke test)"
    )
    args = parser.parse_args()
    out = Path(args.out or default_run_dir("cs2_scaling"))
    out.mkdir(parents=True, exist_ok=True)
    names = ["1.3B"] if args.quick else list(MODELS)
    rows = []
    for name in names:
        per_system = MODELS[name][3]
        micro = largest_fitting_micro(name, per_system)
        rows += [row(name, n, per_system, micro, "weak") for n in SYSTEMS]
    if not args.quick:
        name, batch, systems = STRONG
        fits = largest_fitting_micro(name, MODELS[name][3])
        for n in systems:
            per_system = batch // n
            micro = divisors(per_system, fits)[0]
            rows.append(row(name, n, per_system, micro, "strong"))
    speedups(rows)
    real = real_run(out)
    print_tables(rows, real)
    (out / "results.json").write_text(json.dumps({"rows": rows, "real_run": real}, indent=2))
    plot(rows, out / "cs2_scaling.png")
    print(f"wrote {out}/results.json, {out}/cs2_scaling.png and docs/figures/cs2_scaling.png")


if __name__ == "__main__":
    main()
