"""The microbatch size of a pipelined plan the user did not give one: planned for each
candidate, the fastest that fits. One microbatch would leave a pipeline of p stages
idle (p-1)/p of the step (GPipe, Huang et al. 2019, section 2.2), so it is not a
default to fall back on silently."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardemu.config import ConfigError, Parallelism

Plan = Callable[[int], tuple[dict[str, Any], Any]]  # size -> (report, anything else)


def microbatch_candidates(per_replica: int) -> list[int]:
    """The sizes tried: the powers of two that divide the batch per replica, and the
    whole of it."""
    sizes = {1 << k for k in range(per_replica.bit_length()) if per_replica % (1 << k) == 0}
    return sorted(sizes | {per_replica})


def choose_microbatch(batch: int, par: Parallelism, plan: Plan) -> tuple[dict[str, Any], Any]:
    """`plan(size)` for each candidate; the fastest predicted step whose device memory
    fits (the least memory when none fits). Sizes a plan refuses (interleaved 1F1B
    needs microbatches in multiples of pipe) are skipped. The chosen report gets
    `microbatch_choice`: the size, the rule, and every candidate's step and memory."""
    if batch % par.data:
        raise ConfigError(
            f"TrainConfig.batch {batch} is not divisible by replica * expert = {par.data}"
        )
    best, tried, refused = None, {}, None

    def key(report: dict) -> tuple:  # fitting first, then the faster; else the smaller
        mem = report["memory_per_device"]["device"]
        return (not mem["fits"], report["step_time_s"] if mem["fits"] else mem["bytes"])

    for size in microbatch_candidates(batch // par.data):
        try:
            planned = plan(size)
        except ConfigError as err:
            refused = err
            continue
        tried[str(size)] = planned[0]
        if best is None or key(planned[0]) < key(best[0][0]):
            best = (planned, size)
    if best is None:  # every size was refused: the last refusal says why
        raise refused  # type: ignore[misc]
    (report, rest), size = best
    fits = report["memory_per_device"]["device"]["fits"]
    report["microbatch_choice"] = {
        "chosen": size,
        "rule": "the fastest that fits" if fits else "none fits: the least memory",
        "step_time_s": {k: r["step_time_s"] for k, r in tried.items()},
        "device_bytes": {k: r["memory_per_device"]["device"]["bytes"] for k, r in tried.items()},
    }
    return report, rest
