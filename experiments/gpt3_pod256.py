"""GPT-3 175B on an IPU-POD256 with p=8, t=8, r=4 (MISSION.md: "using phased execution
because the weights do not fit"), in abstract mode: nothing is allocated.

1. Resident: the weights and Adam state per IPU (the rules table's shards) against the
   GC200's 900 MB of in-processor memory.
2. Phased, float16 weights (the IPU has no bfloat16), one layer a phase: the global batch
   of 1536 as 384 passes of one sequence (2048 tokens) per replica, pipelined over the 8
   stages (1F1B; one pass counted, the step assembled: `accounting/assemble.py`), each pass
   streaming its phases' weights again. The device-tier peak per IPU, the bytes streamed,
   and the predicted step time on the `ipu-pod256` profile, for replicated tensor sharding,
   activation policies and prefetch.

    python experiments/gpt3_pod256.py [--out DIR]

Prints two tables, writes DIR/results.json and DIR/gpt3_pod256.png (default
runs/gpt3_pod256-<time>) and copies the plot to docs/figures/.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardemu import use_virtual_devices

use_virtual_devices(32)  # one pipeline stage's devices: t * r; the 8 stages are identical

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.config import Parallelism, PhasedConfig, TrainConfig  # noqa: E402
from shardemu.models import Model, get_preset  # noqa: E402
from shardemu.predict.plan_phased import padded_for, plan_phased  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402
from shardemu.report.describe import describe  # noqa: E402
from shardemu.report.rundir import default_run_dir  # noqa: E402
from shardemu.report.views import save_figure  # noqa: E402

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"

PAR = Parallelism(pipe=8, tensor=8, replica=4)
HW = PROFILES["ipu-pod256"]
GLOBAL_BATCH, SEQ = 1536, 2048
MICROBATCH = 1  # sequences per replica per pass
SETTINGS = {
    "rts=1, recompute": PhasedConfig(phases=96, rts=1),
    "rts=4, recompute": PhasedConfig(phases=96, rts=4),
    "rts=4, offload": PhasedConfig(phases=96, rts=4, activations="offload"),
    "rts=4, offload, no prefetch": PhasedConfig(
        phases=96, rts=4, activations="offload", prefetch=False
    ),
}


def resident() -> dict:
    """Weights and Adam state per IPU if everything stayed on chip (float32 as described,
    and bfloat16 weights with float32 Adam moments)."""
    model = padded_for(Model(get_preset("gpt3-175b")), PAR)
    report = describe(model, PAR)
    weights32 = report["bytes_per_device"]
    return {
        "param_count": report["param_count"],
        "weights_fp32_per_ipu": weights32,
        "weights_bf16_per_ipu": weights32 // 2,
        "adam_state_fp32_per_ipu": 2 * weights32,
        "ipu_memory": HW.device_memory_bytes,
    }


def phased(name: str, cfg: PhasedConfig) -> dict:
    model = padded_for(Model(get_preset("gpt3-175b")), PAR).replace(param_dtype="float16")
    train = TrainConfig(batch=GLOBAL_BATCH, seq=SEQ)
    r = plan_phased(model, PAR, train, cfg, hardware=HW, microbatch_size=MICROBATCH).report
    return {
        "setting": name,
        "passes": r["passes"],
        "device_peak_bytes": r["memory_per_device"]["device"]["bytes"],
        "fits": r["memory_per_device"]["device"]["fits"],
        "host_bytes_per_ipu": r["memory_per_device"]["host"]["bytes"],
        "bytes_h2d": r["bytes_h2d"],
        "bytes_collective": r["bytes_collective"],
        "step_time_s": r["step_time_s"],
        "breakdown": r["breakdown"],
        "model_flops_rel_err": r["model_flops_rel_err"],
        "utilisation": r["utilisation"],
        "tokens_per_s": r["tokens_per_s"],
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    names = [r["setting"] for r in rows]
    left.barh(names, [r["device_peak_bytes"] / 1e6 for r in rows], color="#4c72b0")
    left.axvline(HW.device_memory_gb * 1e3, color="k", lw=1, label="GC200 in-processor memory")
    left.set(xlabel="device-tier peak per IPU (MB)", title="memory per IPU")
    left.legend(fontsize=8)
    keys = [k for k in rows[0]["breakdown"] if k != "compute_s"]
    base = [r["breakdown"]["compute_s"] for r in rows]
    right.barh(names, base, label="compute_s")
    for key in keys:
        values = [r["breakdown"][key] for r in rows]
        right.barh(names, values, left=base, label=key)
        base = [b + v for b, v in zip(base, values, strict=True)]
    right.set(xlabel="seconds per step (busiest stage)", title="where a step's time goes")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(
        f"GPT-3 175B on {HW.name}, {PAR}, float16, batch {GLOBAL_BATCH} x {SEQ} as "
        f"{GLOBAL_BATCH // (MICROBATCH * PAR.replica)} pipelined passes"
    )
    save_figure(fig, path, FIGURES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or default_run_dir("gpt3_pod256"))
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=150)

    res = resident()
    table = Table(title="resident: GPT-3 175B per IPU, p=8 t=8 r=4", show_header=False)
    for key, value in res.items():
        table.add_row(key, f"{value:,}")
    table.add_row("fits", "no" if res["weights_bf16_per_ipu"] > res["ipu_memory"] else "yes")
    console.print(table)

    rows = [phased(name, cfg) for name, cfg in SETTINGS.items()]
    table = Table(title=f"phased: batch {GLOBAL_BATCH} x {SEQ} as {rows[0]['passes']} passes")
    for col in ("setting", "device peak MB", "fits 900 MB", "h2d TB/step", "step s",
                "compute s", "exposed streaming s", "exposed comm s", "bubble s",
                "utilisation"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        b = r["breakdown"]
        table.add_row(
            r["setting"], f"{r['device_peak_bytes'] / 1e6:,.0f}", "yes" if r["fits"] else "no",
            f"{r['bytes_h2d'] / 1e12:,.1f}", f"{r['step_time_s']:,.0f}",
            f"{b['compute_s']:,.0f}", f"{b['exposed_transfer_s']:,.0f}",
            f"{b['exposed_communication_s']:,.0f}", f"{b['pipeline_bubble_s']:,.0f}",
            f"{r['utilisation']:.1%}",
        )  # fmt: skip
    console.print(table)
    (out / "results.json").write_text(json.dumps({"resident": res, "phased": rows}, indent=2))
    plot(rows, out / "gpt3_pod256.png")
    print(f"wrote {out}/results.json, {out}/gpt3_pod256.png and docs/figures/gpt3_pod256.png")


if __name__ == "__main__":
    main()
