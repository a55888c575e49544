"""How a pipeline's point-to-point sends are made, and what it does to a step: two
settings whose effect docs/results.md quotes, measured by the cost model.

1. Megatron-LM's scatter/gather (`--pipe-scatter-gather`; Narayanan et al. 2021,
   SC21, §4.1) on the layout of that paper's Figure 18: GPT-3 175B on 96 A100s, pipe
   12, tensor 8, the interleaved schedule with 2 chunks a stage, microbatch 1, full
   recomputation, gradients reduced after the backward and blocking sends, as
   Megatron-LM ran them (`validation.MEGATRON_2021` but for the option). The paper
   reports up to 11% more throughput from it in its most communication-bound
   schedules; this is a witness, not a row of the validation.
2. The Llama 3 405B rows of `validation.py` with the two settings Meta did not publish:
   scatter/gather, and interleaved microbatch groups (`--microbatch-group`,
   Megatron-Core's `microbatch_group_size_per_vp_stage`) of every microbatch a
   replica runs (the 8,192-GPU row's 32; the other rows run 16, the stage count, so
   no larger group exists). Not adopted: a sensitivity, with whether each plan fits.

    python benchmarks/pipe_sends.py [--out benchmarks/results/pipe_sends.json]

Prints two tables and writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shardemu.config import Parallelism, TrainConfig
from shardemu.devices import use_virtual_devices
from shardemu.models import get_preset
from shardemu.predict.plan_resident import plan_resident
from shardemu.predict.profiles import PROFILES

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validation  # noqa: E402 (the rows' cases, beside this script)

FIGURE_18_BATCHES = (12, 24, 36, 48, 60)


def figure_18() -> list[dict]:
    """GPT-3 175B on 96 A100s (p12 t8, interleaved x2): the step with whole and with
    scattered sends at each batch."""
    cfg, par, hw = get_preset("gpt3-175b"), Parallelism(pipe=12, tensor=8), PROFILES["a100-80gb"]
    rows = []
    for batch in FIGURE_18_BATCHES:
        train = TrainConfig(batch=batch, seq=2048, precision="bf16", schedule="interleaved")
        steps = {}
        for scattered in (False, True):
            overlap = dataclasses.replace(validation.MEGATRON_2021, pipe_scatter_gather=scattered)
            plan = plan_resident(cfg, par, train, 1, hw, "full", overlap=overlap, band=False)
            steps[scattered] = plan.report["step_time_s"]
        rows.append({
            "batch": batch, "whole_step_s": steps[False], "scattered_step_s": steps[True],
            "throughput_gain": steps[False] / steps[True] - 1,
        })  # fmt: skip
    return rows


def llama3_rows() -> list[dict]:
    """Each Llama 3 405B row as planned, with scatter/gather, and (where a group larger
    than the stage count exists) with one group of all its microbatches, and both."""
    out = []
    for case in (c for c in validation.CASES if c.name.startswith("Llama 3 405B")):
        m = case.batch // (case.par.replica * case.microbatch_size)
        groups = (None, m) if m > case.par.pipe else (None,)
        for group in groups:
            for scattered in (False, True):
                train = dataclasses.replace(validation.train_config(case), microbatch_group=group)
                overlap = dataclasses.replace(case.overlap, pipe_scatter_gather=scattered)
                r = plan_resident(
                    case.model, case.par, train, case.microbatch_size,
                    PROFILES[case.hardware], case.recompute, overlap=overlap,
                    attention=case.attention, band=False,
                ).report  # fmt: skip
                device = r["memory_per_device"]["device"]
                out.append({
                    "case": case.name, "microbatch_group": group or case.par.pipe,
                    "scatter_gather": scattered, "mfu": r["utilisation"],
                    "error": r["utilisation"] / case.published - 1,
                    "step_time_s": r["step_time_s"],
                    "bubble_s": r["breakdown"]["pipeline_bubble_s"],
                    "device_gb": device["bytes"] / 1e9, "fits": device["fits"],
                })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/pipe_sends.json")
    args = parser.parse_args()
    use_virtual_devices(validation.devices_for(validation.CASES))
    console = Console(width=140)
    fig = figure_18()
    table = Table(title="GPT-3 175B on 96 A100s, p12 t8 interleaved x2 (Narayanan et al. Fig. 18)")
    for col in ("batch", "whole sends s", "scatter/gather s", "throughput gain"):
        table.add_column(col, justify="right")
    for r in fig:
        table.add_row(str(r["batch"]), f"{r['whole_step_s']:.3f}",
                      f"{r['scattered_step_s']:.3f}", f"{r['throughput_gain']:+.1%}")  # fmt: skip
    console.print(table)
    llama = llama3_rows()
    table = Table(title="Llama 3 405B rows with settings Meta did not publish (not adopted)")
    for col in ("case", "group", "scatter/gather", "MFU", "error", "step s", "bubble s",
                "device GB", "fits"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in llama:
        table.add_row(r["case"], str(r["microbatch_group"]), str(r["scatter_gather"]),
                      f"{r['mfu']:.1%}", f"{r['error']:+.1%}", f"{r['step_time_s']:.2f}",
                      f"{r['bubble_s']:.2f}", f"{r['device_gb']:.1f}", str(r["fits"]))  # fmt: skip
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"figure_18": fig, "llama3": llama}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
