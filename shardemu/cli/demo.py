"""`shardemu demo`: the whole story in under a minute, from three runs of gpt-tiny.

1. *sharded*: tensor=2 x replica=4 on 8 virtual devices, predicted on an IPU-POD16;
2. *one-device*: the same steps on one device, which it must equal;
3. *phased*: the same model with its weights in the host tier, streamed in two phases
   and sharded over the replicas (replicated tensor sharding, rts=4).
"""

from __future__ import annotations

from pathlib import Path

from rich.panel import Panel

from shardemu.report.rundir import default_run_dir, read_metrics

MESH, HARDWARE = "tensor=2,replica=4", "ipu-pod16"
PHASED_STEPS = 3  # enough to see a phased step's bytes, and its losses against the others
EARLY = 5  # steps compared before rounding differences have grown (tests use as many)


def demo_runs(steps: int, out: str | None) -> dict[str, list[str]]:
    """The `shardemu run` command lines of the demo, by name; each ends with its --out."""
    root = Path(out or default_run_dir("demo"))
    common = ["--model", "gpt-tiny", "--batch", "16", "--seq", "64", "--seed", "0"]
    return {
        "sharded": [
            "run",
            *common,
            "--mesh",
            MESH,
            "--devices",
            "8",
            "--steps",
            str(steps),
            "--hardware",
            HARDWARE,
            "--out",
            str(root / "sharded"),
        ],
        "one-device": [
            "run",
            *common,
            "--devices",
            "1",
            "--steps",
            str(steps),
            "--out",
            str(root / "one-device"),
        ],
        "phased": [
            "run",
            *common,
            "--mesh",
            MESH,
            "--devices",
            "8",
            "--phased",
            "--phases",
            "2",
            "--rts",
            "4",
            "--steps",
            str(min(steps, PHASED_STEPS)),
            "--hardware",
            HARDWARE,
            "--out",
            str(root / "phased"),
        ],
    }


def story(dirs: dict[str, Path]) -> Panel:
    """What the three runs show, read back from their run directories."""
    sharded, single, phased = (read_metrics(dirs[n]) for n in ("sharded", "one-device", "phased"))
    early = _worst(sharded[:EARLY], single)
    rel_phased = _worst(phased, sharded)
    last, streamed = sharded[-1], phased[-1]
    root = dirs["sharded"].parent
    lines = [
        f"[bold]1. Sharded = one device.[/] On {MESH} (8 virtual devices) against one "
        f"device, the first {min(EARLY, len(single))} losses differ by at most {early:.1e} "
        f"(relative); over all {len(single)} steps by {_worst(sharded, single):.1e}, as float32 "
        f"sums taken in another order drift apart step by step. The phased run's "
        f"{len(phased)} steps against the sharded ones: {rel_phased:.1e}.",
        f"[bold]2. Streamed bytes.[/] Each phased step brought "
        f"{streamed['bytes_h2d_weights']:,} bytes of weights in from the host tier and "
        f"sent {streamed['bytes_d2h_gradients']:,} bytes of gradients back; its device "
        f"tier peaked at {streamed['device_high_water_bytes']:,} bytes per device, "
        f"against {last['device_high_water_bytes']:,} for the resident step.",
        f"[bold]3. On an IPU-POD16.[/] The sharded step, from its own ledger, is predicted "
        f"at {last['predicted_step_s'] * 1e3:.3g} ms "
        f"({last['tokens'] / last['predicted_step_s']:,.0f} tokens/s); here it took "
        f"{last['step_time_s'] * 1e3:.3g} ms on the CPU.",
        f"[bold]4. Files.[/] Trace (open in ui.perfetto.dev): {dirs['sharded'] / 'trace.json'}; "
        f"plot: {dirs['sharded'] / 'timeline.png'}; every step: metrics.jsonl in each of "
        f"{root}/{{sharded,one-device,phased}}.",
        "",
        "[bold]Next, try:[/]",
        f"  shardemu compare {root}",
        "  shardemu plan --model bert-large --mesh pipe=4,replica=4 --phased --rts 4 "
        "--batch 512 --seq 128 --microbatch-size 8 --hardware ipu-pod16",
        "  shardemu sweep experiments/sweep_lr.toml",
    ]
    return Panel("\n".join(lines), title="what the demo showed", expand=False)


def _worst(runs: list[dict], reference: list[dict]) -> float:
    """The largest relative loss difference over the steps both have."""
    return max(
        abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(runs, reference, strict=False)
    )
