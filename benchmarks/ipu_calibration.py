"""The IPU's efficiency, calibrated on one published run: BERT-Large phase 1 on a Bow Pod16.

Graphcore's TensorFlow 2 BERT-Large (graphcore/examples, nlp/bert/tensorflow2,
configs/pretrain_large_128_phase1.json: micro-batch 8, 4 replicas, gradient accumulation
2040, a global batch of 65,280 sequences of 128 tokens, 20 masked positions, a vocabulary
of 30,400, LAMB, FP16.16, recomputation on, four pipeline stages of [embedding + 3, 7, 7,
7] layers with the heads back on the first IPU) ran at 4528 sequences/s on a Bow Pod16
with SDK 3.1 (graphcore.cn, "Performance Results", Bow Platform - Training). The step is
planned at two efficiencies; the compute it times scales as 1/efficiency and the rest
(exchange, bubble) does not, so step = a + b / efficiency, solved for the published step
and checked by planning at the solution. The result is `IPU_EFFICIENCY`
(predict/graphcore.py); `benchmarks/validation.py` holds it to other runs.

    python benchmarks/ipu_calibration.py [--out benchmarks/results/ipu_calibration.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from shardemu.devices import use_virtual_devices

use_virtual_devices(16)

from shardemu.config import Parallelism, TrainConfig  # noqa: E402
from shardemu.models import get_preset  # noqa: E402
from shardemu.predict.graphcore import BULK_SYNCHRONOUS, IPU_EFFICIENCY  # noqa: E402
from shardemu.predict.plan_resident import plan_resident  # noqa: E402
from shardemu.predict.profiles import PROFILES  # noqa: E402

PUBLISHED = 4528.0  # sequences/s
BATCH, SEQ, MICROBATCH = 65_280, 128, 8
MODEL = get_preset("bert-large").replace(vocab_size=30_400, max_predictions=20)
# Graphcore's stages are paced by their 7-layer IPUs; its first IPU holds the embedding,
# 3 layers and the heads. Ours keep the heads on the last stage: 4, 7, 7, 6 layers, so
# that the 7-layer stages pace the pipeline here too.
TRAIN = TrainConfig(
    batch=BATCH, seq=SEQ, schedule="1f1b", precision="fp16-mixed", stage_layers=(4, 7, 7, 6)
)


def step_at(efficiency: float) -> float:
    hw = dataclasses.replace(PROFILES["bow-pod16"], efficiency=efficiency)
    plan = plan_resident(
        MODEL, Parallelism(pipe=4, replica=4), TRAIN, MICROBATCH, hw,
        recompute="full", overlap=BULK_SYNCHRONOUS,
    )  # fmt: skip
    return plan.report["step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/ipu_calibration.json")
    args = parser.parse_args()
    low, high = 0.3, 0.4
    slow, fast = step_at(low), step_at(high)
    b = (slow - fast) / (1 / low - 1 / high)
    a = fast - b / high
    target = BATCH / PUBLISHED
    solved = b / (target - a)
    check = BATCH / step_at(solved)
    at_profile = BATCH / step_at(IPU_EFFICIENCY)
    print(f"step = {a:.3f} s + {b:.3f} s / efficiency; published {PUBLISHED:.0f} sequences/s "
          f"= a {target:.3f} s step -> efficiency {solved:.4f} (planned there: "
          f"{check:.0f} sequences/s, {check / PUBLISHED - 1:+.2%}); the profile's "
          f"{IPU_EFFICIENCY}: {at_profile:.0f} sequences/s "
          f"({at_profile / PUBLISHED - 1:+.2%})")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "published_sequences_per_s": PUBLISHED, "fixed_s": a, "compute_s_at_efficiency_1": b,
        "efficiency": solved, "planned_at_efficiency": check,
        "profile_efficiency": IPU_EFFICIENCY, "planned_at_profile": at_profile,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
