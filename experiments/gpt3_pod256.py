"""GPT-3 175B on an IPU-POD256 with p=8, t=8, r=4 (MISSION.md: "using phased execution
because the weights do not fit"), in abstract mode: nothing is allocated.

1. Resident: the weights and Adam state per IPU (the rules table's shards) against the
   GC200's 900 MB of in-processor memory.
2. Phased, bfloat16 weights, one layer a phase, one sequence (2048 tokens) per replica per
   pass: the device-tier peak per IPU, the bytes streamed, and the predicted pass time on
   the `ipu-pod256` profile, for replicated tensor sharding and activation policies.
   The global batch of 1536 is 384 such passes per replica (gradient accumulation, the
   weights streamed again for each pass: shardemu's phased engine runs the whole pass
   phase by phase, so this is what it predicts; it does not overlap passes across
   pipeline stages, so the pipeline bubble of a single pass is counted in full).

    python experiments/gpt3_pod256.py [--out DIR]

Prints two tables, writes DIR/results.json and DIR/gpt3_pod256.png (default
runs/gpt3_pod256-<time>), copies the plot to docs/figures/, and writes the trace and
timeline of the first phased setting into DIR/trace/.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from shardemu import use_virtual_devices

use_virtual_devices(32)  # one pipeline stage's devices: t * r; the 8 stages are identical

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardemu.config import Parallelism, PhasedConfig, TrainConfig, get_preset  # noqa: E402
from shardemu.describe import describe  # noqa: E402
from shardemu.hardware import PROFILES  # noqa: E402
from shardemu.plan import padded_for, plan_phased  # noqa: E402
from shardemu.tracking import default_run_dir  # noqa: E402

PAR = Parallelism(pipe=8, tensor=8, replica=4)
HW = PROFILES["ipu-pod256"]
GLOBAL_BATCH, SEQ = 1536, 2048
PASSES = GLOBAL_BATCH // PAR.replica  # one sequence per replica per pass
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
    model = padded_for(get_preset("gpt3-175b"), PAR)
    report = describe(model, PAR)
    weights32 = report["bytes_per_device"]
    return {
        "param_count": report["param_count"],
        "weights_fp32_per_ipu": weights32,
        "weights_bf16_per_ipu": weights32 // 2,
        "adam_state_fp32_per_ipu": 2 * weights32,
        "ipu_memory": HW.device_memory_bytes,
    }


def phased(name: str, cfg: PhasedConfig, out: Path | None) -> dict:
    model = padded_for(get_preset("gpt3-175b"), PAR).replace(param_dtype="bfloat16")
    train = TrainConfig(batch=PAR.replica, seq=SEQ)
    r = plan_phased(model, PAR, train, cfg, hardware=HW, out=out)
    return {
        "setting": name,
        "device_peak_bytes": r["memory_per_device"]["device"]["bytes"],
        "fits": r["memory_per_device"]["device"]["fits"],
        "host_bytes_per_ipu": r["memory_per_device"]["host"]["bytes"],
        "bytes_h2d_per_pass": r["bytes_h2d"],
        "bytes_collective_per_pass": r["bytes_collective"],
        "pass_time_s": r["step_time_s"],
        "breakdown": r["breakdown"],
        "model_flops_rel_err": r["model_flops_rel_err"],
        "step_time_s": PASSES * r["step_time_s"],
        "utilisation": r["utilisation"],
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    names = [r["setting"] for r in rows]
    left.barh(names, [r["device_peak_bytes"] / 1e6 for r in rows], color="#4c72b0")
    left.axvline(HW.device_memory_gb * 1e3, color="k", lw=1, label="GC200 in-processor memory")
    left.set(xlabel="device-tier peak per IPU (MB)", title="memory per IPU, one pass")
    left.legend(fontsize=8)
    keys = [k for k in rows[0]["breakdown"] if k != "compute_s"]
    base = [r["breakdown"]["compute_s"] for r in rows]
    right.barh(names, base, label="compute_s")
    for key in keys:
        values = [r["breakdown"][key] for r in rows]
        right.barh(names, values, left=base, label=key)
        base = [b + v for b, v in zip(base, values, strict=True)]
    right.set(xlabel="seconds per pass (critical stage)", title="where a pass's time goes")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(f"GPT-3 175B on {HW.name}, {PAR}, bfloat16, 1 x {SEQ} tokens per replica")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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

    rows = [
        phased(name, cfg, out / "trace" if i == 0 else None)
        for i, (name, cfg) in enumerate(SETTINGS.items())
    ]
    table = Table(title=f"phased: one pass of {PAR.replica} x {SEQ} tokens; step = {PASSES} passes")
    for col in ("setting", "device peak MB", "fits 900 MB", "h2d GB/pass", "pass s",
                "exposed comm s", "bubble s", f"step s (x{PASSES})", "utilisation"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        b = r["breakdown"]
        table.add_row(
            r["setting"], f"{r['device_peak_bytes'] / 1e6:,.0f}", "yes" if r["fits"] else "no",
            f"{r['bytes_h2d_per_pass'] / 1e9:,.0f}", f"{r['pass_time_s']:.2f}",
            f"{b['exposed_communication_s']:.2f}", f"{b['pipeline_bubble_s']:.2f}",
            f"{r['step_time_s']:,.0f}", f"{r['utilisation']:.1%}",
        )  # fmt: skip
    console.print(table)
    (out / "results.json").write_text(json.dumps({"resident": res, "phased": rows}, indent=2))
    plot(rows, out / "gpt3_pod256.png")
    figures = Path(__file__).resolve().parent.parent / "docs" / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "gpt3_pod256.png", figures / "gpt3_pod256.png")
    print(f"wrote {out}/results.json, {out}/gpt3_pod256.png and docs/figures/gpt3_pod256.png")


if __name__ == "__main__":
    main()
