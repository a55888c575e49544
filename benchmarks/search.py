"""`shardemu search` on the layouts the issue names, timed, against the published layout
predicted by the same cost model:

- GPT-3 175B on 1024 A100 80GB, batch 1536 x 2048: Megatron-LM's pipe 16, tensor 8,
  replica 8 with microbatch 1 and full recomputation (Narayanan et al. 2021, Table 1
  and section 5.1), planned with `plan_resident`;
- GPT-3 175B on an IPU-POD256, batch 1536 x 2048: Graphcore's pipe 8, tensor 8,
  replica 4, phased, FP16 (MISSION.md), planned with `plan_phased` (one layer a phase,
  rts 4, activations offloaded, no prefetch: its least device memory; one sequence a
  pass);
- GPT-3 175B on 1536 A100 80GB (`--case gpu1536`), the issue's second GPU count, with
  no published layout to compare.

    python benchmarks/search.py [--case gpu|ipu|gpu1536|all] [--precision P[,P...]]
        [--max-microbatch B] [--zero-stages S[,S...]] [--context-sizes C[,C...]]
        [--exhaustive] [--out benchmarks/results/search.json]

Prints a table and writes `--out` (each case's row replacing its last one there). The
search must predict its winner at least as fast as the published layout (the published
layout is in its space).
`--exhaustive` searches again timing every layout that fits (no branch and bound) and
says whether the top and the Pareto front are the same.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shardemu import use_virtual_devices
from shardemu.config import ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.models import get_preset
from shardemu.predict.layouts import Space
from shardemu.predict.profiles import PROFILES
from shardemu.predict.rows import SearchResult
from shardemu.predict.search import search
from shardemu.run.verify import search_devices

RESULTS = Path(__file__).resolve().parent / "results" / "search.json"
MODEL, BATCH, SEQ = "gpt3-175b", 1536, 2048
CASES = {
    "gpu": {"hardware": "a100-80gb", "devices": 1024, "published": Parallelism(16, 8, 8),
            "precision": "bf16", "modes": "auto"},
    "ipu": {"hardware": "ipu-pod256", "devices": 256, "published": Parallelism(8, 8, 4),
            "precision": "fp16-mixed", "modes": "auto"},
    # issue 37's second A100 count; no GPT-3 run on 1536 GPUs is published
    "gpu1536": {"hardware": "a100-80gb", "devices": 1536, "published": None,
                "precision": "bf16", "modes": "auto"},
}  # fmt: skip


def published(case: dict) -> dict:
    """The published layout's predicted step, by the planner the search uses."""
    cfg, hw, par = get_preset(MODEL), PROFILES[case["hardware"]], case["published"]
    if case["hardware"].startswith("ipu"):
        from shardemu.predict.plan_phased import plan_phased

        # one layer a phase, activations offloaded, no prefetch: the least device memory
        # (no --device-memory, so a layout over the IPU's memory is still timed)
        phased = PhasedConfig(phases=cfg.num_layers, rts=par.replica, activations="offload",
                              prefetch=False)  # fmt: skip
        train = TrainConfig(batch=BATCH, seq=SEQ, precision=case["precision"])
        report = plan_phased(cfg, par, train, phased, hardware=hw, microbatch_size=1).report
    else:
        from shardemu.predict.plan_resident import plan_resident

        train = TrainConfig(batch=BATCH, seq=SEQ, precision=case["precision"])
        report = plan_resident(cfg, par, train, 1, hw, recompute="full").report
    memory = report["memory_per_device"]
    return {
        "layout": str(par),
        "step_time_s": report["step_time_s"],
        "fits": all(tier["fits"] for tier in memory.values()),
        "bytes_per_device": {tier: m["bytes"] for tier, m in memory.items()},
        "utilisation": report["utilisation"],
    }


def exhaustive_check(cfg: ModelConfig, case: dict, space: Space, pruned: SearchResult) -> dict:
    """The same search with a `top` no search fills, so that prunes 5 and 6 (which drop
    a layout only where `top` faster ones are found) never fire and every layout that
    fits is timed: its time (the counts are the first search's, made in this process:
    the timing alone), and whether its five fastest and its Pareto front are the pruned
    search's."""
    result = search(cfg, PROFILES[case["hardware"]], case["devices"], BATCH, SEQ, space,
                    top=10**9)  # fmt: skip
    fastest = [r.label for r in result.top[: len(pruned.top)]]
    check = {
        "search_s": result.elapsed_s,
        "counts": result.counts,
        "same_top": fastest == [r.label for r in pruned.top],
        "same_pareto": [r.label for r in result.pareto] == [r.label for r in pruned.pareto],
    }
    fit, same = result.counts["fit"], (check["same_top"], check["same_pareto"])
    print(f"exhaustive: {result.elapsed_s:.0f} s with the counts made, {fit} fit; the same top "
          f"{same[0]}, the same Pareto front {same[1]}")  # fmt: skip
    return check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=(*CASES, "all"), default="all")
    parser.add_argument("--precision", default=None, help="default: every one the profile has")
    parser.add_argument("--max-microbatch", type=int, default=Space(()).max_microbatch)
    # issue 37: the grown space (ZeRO stages, context sizes) must be searched in 60 s too
    parser.add_argument("--zero-stages", default="0", help="e.g. 0,1,2,3")
    parser.add_argument("--context-sizes", default="1", help="e.g. 1,2")
    parser.add_argument(
        "--exhaustive", action="store_true",
        help="search again timing every layout that fits, and compare the top and front",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    grown = {
        "zero_stages": tuple(int(z) for z in args.zero_stages.split(",")),
        "context_sizes": tuple(int(c) for c in args.context_sizes.split(",")),
    }
    names = list(CASES) if args.case == "all" else [args.case]
    cfg = get_preset(MODEL)
    spaces = {}
    for name in names:
        hw = PROFILES[CASES[name]["hardware"]]
        precisions = tuple(args.precision.split(",")) if args.precision else hw.precisions
        spaces[name] = Space(
            precisions, CASES[name]["modes"], max_microbatch=args.max_microbatch, **grown
        )
    use_virtual_devices(max(
        search_devices(cfg, CASES[n]["devices"], BATCH, spaces[n]) for n in names
    ))  # fmt: skip
    out = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name in names:
        case = CASES[name]
        t0 = time.perf_counter()
        result = search(
            cfg, PROFILES[case["hardware"]], case["devices"], BATCH, SEQ, spaces[name],
            log=lambda line, t0=t0: print(f"[{time.perf_counter() - t0:5.0f} s] {line}"),
        )  # fmt: skip
        best = result.best.to_json()
        row = {
            "search_s": result.elapsed_s,
            "space": result.to_json()["space"],
            "counts": result.counts,
            "best": {k: best[k] for k in ("label", "step_time_s", "utilisation", "device_bytes")},
            "top": [r.label for r in result.top],
            "published": published(case) if case["published"] else None,
        }
        if row["published"]:
            row["best_vs_published"] = best["step_time_s"] / row["published"]["step_time_s"]
        if args.exhaustive:
            row["exhaustive"] = exhaustive_check(cfg, case, spaces[name], result)
        grew = (args.zero_stages, args.context_sizes) != ("0", "1")
        out[f"{name} zero {args.zero_stages} context {args.context_sizes}" if grew else name] = row
        against = row["published"] and (
            f"; published {row['published']['layout']} {row['published']['step_time_s']:.2f} "
            f"s: ratio {row['best_vs_published']:.3f}"
        )
        print(
            f"{name}: searched in {row['search_s']:.0f} s ({result.counts['candidates']} "
            f"layouts, {result.counts['fit']} fit); best {best['label']} "
            f"{best['step_time_s']:.2f} s ({best['utilisation']:.1%} MFU){against or ''}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
