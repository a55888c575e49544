"""Phased vs resident step time, real mode, for a small GPT on 8 virtual devices.

The resident engine keeps weights and optimizer state on the devices and runs one
compiled step; the phased engine streams every phase's weights in from the host tier
(pinned_host), recomputes or keeps activations, streams gradients out and updates in the
host tier (or on the device). Both train the same model on the same batches (the losses
are compared), in one process, so the ratio compares like with like; absolute times
depend on this machine and its load. Step 0 (compilation) is excluded.

    python benchmarks/phased.py [--steps 6] [--out benchmarks/results/phased.json]
"""

from __future__ import annotations

import argparse
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

from shardemu import Model, ModelConfig, SyntheticCorpus, TrainConfig, Trainer, make_mesh  # noqa: E402
from shardemu.config import PhasedConfig  # noqa: E402
from shardemu.phased.trainer import PhasedTrainer  # noqa: E402
from shardemu.report.rundir import versions  # noqa: E402

MODEL = ModelConfig("gpt-small-bench", "gpt", 4096, 4, 256, 8, 1024, 128)
TRAIN = TrainConfig(batch=16, seq=128, seed=0)
MESH = dict(tensor=2, replica=4)
VARIANTS = {  # name: PhasedConfig
    "phases=1": PhasedConfig(phases=1),
    "phases=4": PhasedConfig(phases=4),
    "phases=4 rts=4": PhasedConfig(phases=4, rts=4),
    "phases=4 keep": PhasedConfig(phases=4, activations="keep"),
    "phases=4 offload": PhasedConfig(phases=4, activations="offload"),
    "phases=4 optimizer on device": PhasedConfig(phases=4, optimizer_on="device"),
}


def timed(step, steps: int) -> tuple[list[float], list[float]]:
    """Losses and wall times of `steps` calls of step(i) -> loss (a float: waits)."""
    losses, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    return losses, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results/phased.json")
    args = parser.parse_args()

    model, mesh = Model(MODEL), make_mesh(**MESH)
    corpus = SyntheticCorpus(MODEL.vocab_size, seed=TRAIN.seed)
    batches = [model.batch(corpus, s, TRAIN.batch, TRAIN.seq) for s in range(args.steps)]

    resident = Trainer(model, mesh, TRAIN)
    state = list(resident.init(TRAIN.seed))

    def resident_step(i: int) -> float:
        result = resident.step(*state, batches[i])
        state[:] = [result.params, result.opt_state]
        return float(result.loss)

    base_losses, base_times = timed(resident_step, args.steps)
    base = statistics.median(base_times[1:])
    init = jax.jit(model.init_params)(jax.random.key(TRAIN.seed))
    rows = [{"engine": "resident", "median_step_s": base, "ratio": 1.0, "max_loss_rel_diff": 0.0}]
    for name, cfg in VARIANTS.items():
        trainer = PhasedTrainer(model, mesh, TRAIN, cfg)
        pstate = [trainer.init(init)]

        def phased_step(i: int, trainer=trainer, pstate=pstate) -> float:
            result = trainer.step(pstate[0], batches[i])
            pstate[0] = result.state
            return result.loss

        losses, times = timed(phased_step, args.steps)
        median = statistics.median(times[1:])
        totals = trainer.ledger.step_totals(1)
        rows.append(
            {
                "engine": f"phased {name}",
                "median_step_s": median,
                "ratio": median / base,
                "max_loss_rel_diff": max(
                    abs(a - b) / abs(b) for a, b in zip(losses, base_losses, strict=True)
                ),
                "bytes_h2d": totals["bytes_h2d"],
                "flops_ratio": totals["flops"] / totals["model_flops"],
                "device_high_water": max(t.high_water for t in trainer.tiers),
            }
        )

    table = Table(
        title=f"phased vs resident: {MODEL.name}, mesh {MESH}, batch {TRAIN.batch}x{TRAIN.seq}"
    )
    for col in (
        "engine",
        "median step s",
        "ratio",
        "max loss rel diff",
        "bytes h2d",
        "flops/model",
        "device peak B",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["engine"], f"{r['median_step_s']:.3f}", f"{r['ratio']:.2f}",
            f"{r['max_loss_rel_diff']:.1e}", f"{r.get('bytes_h2d', 0):,}",
            f"{r.get('flops_ratio', 1.0):.2f}", f"{r.get('device_high_water', 0):,}",
        )  # fmt: skip
    Console(width=150).print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "cpus": jax.device_count(), "versions": versions()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
