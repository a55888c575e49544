"""The microbatch size of a pipelined plan the user did not give one: the fastest that
fits. One microbatch would leave a pipeline of p stages idle (p-1)/p of the step
(GPipe, Huang et al. 2019, section 2.2), so it is not a default to fall back on
silently.

Planning a size whole counts its pieces (seconds each, at GPT-3's size); a planner that
can `screen` a size cheaply (its memory from a dry run that compiles almost nothing, and
a step no plan at that size beats) lets the choice plan fewer: a size that does not fit
is not planned while another fits, and sizes are planned in order of their least step
until the fastest planned beats every bound left. The choice is the one planning every
size would make, since each bound is a true lower bound (tested against the whole
search). Sizes are screened from the smallest up, and none above the first that does
not fit: a larger microbatch keeps at least the bytes of a smaller one (the weights,
their buffers and optimizer state do not change with it, and every activation, gradient
of one and working set grows with it), so it does not fit either, and is chosen neither
when a smaller fits nor, when none does, over the least memory (a dry run screens in
about a second at GPT-3's size: the IPU-POD256 plan, none of whose sizes fits, screened
nine). Where a larger size is never slower (one pipeline stage) only the largest that
fits is wanted, and the same order of bytes finds it by bisection: the whole batch
first, which usually fits (Megatron-LM GPT 1.7B on 32 A100s screened five sizes, now
one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardemu.config import ConfigError, Parallelism

Plan = Callable[[int], tuple[dict[str, Any], Any]]  # size -> (report, anything else)


@dataclass(frozen=True)
class Screen:
    """A size judged without planning it: its device bytes, whether they fit, and a
    step time no plan at this size is faster than."""

    device_bytes: int
    fits: bool
    least_step_s: float


def microbatch_candidates(per_replica: int) -> list[int]:
    """The sizes tried: the powers of two that divide the batch per replica, and the
    whole of it."""
    sizes = {1 << k for k in range(per_replica.bit_length()) if per_replica % (1 << k) == 0}
    return sorted(sizes | {per_replica})


def _fits(report: dict) -> bool:
    return report["memory_per_device"]["device"]["fits"]


def _key(report: dict) -> tuple:
    """Fitting first, then the faster; when none fits, the smaller."""
    mem = report["memory_per_device"]["device"]
    return (not mem["fits"], report["step_time_s"] if mem["fits"] else mem["bytes"])


def choose_microbatch(
    batch: int,
    par: Parallelism,
    plan: Plan,
    screen: Callable[[int], Screen] | None = None,
    larger_no_slower: bool = False,
) -> tuple[dict[str, Any], Any]:
    """`plan(size)` for the candidates `screen` does not rule out (all of them without
    one); the fastest predicted step whose device memory fits (the least memory when
    none fits). With `larger_no_slower` (a planner whose step never grows with the
    size: one pipeline stage), sizes are screened by bisection for the largest that
    fits and planned from it down, and the first that fits is the choice. Sizes a
    planner refuses (interleaved 1F1B needs microbatches in multiples of pipe) are
    skipped; where it refuses every size, the smallest size's refusal is raised. The
    chosen report gets
    `microbatch_choice`: the size, the rule, the step of every size planned, the device
    bytes of every size screened or planned, and why any size was not planned."""
    if batch % par.data:
        raise ConfigError(
            f"TrainConfig.batch {batch} is not divisible by replica * expert = {par.data}"
        )
    sizes, screens = microbatch_candidates(batch // par.data), {}
    not_planned: dict[str, str] = {}
    refused: dict[int, ConfigError] = {}  # by size
    if screen is not None:
        find = _largest_fitting if larger_no_slower else _fitting
        sizes = find(sizes, screen, screens, not_planned, refused)
        if not screens:  # every size was refused
            raise _why(refused)
    if larger_no_slower:  # the largest first, of those the screen lets fit first
        sizes = sorted(sizes, key=lambda s: (s in screens and not screens[s].fits, -s))
    best, tried = None, {}
    for size in sizes:
        if best is not None and size in screens:
            reason = _passed_over(screens[size], best[0][0])
            if reason:
                not_planned[str(size)] = reason
                continue
        if larger_no_slower and best is not None and _fits(best[0][0]):
            not_planned[str(size)] = "a smaller microbatch is no faster on one stage"
            continue
        try:
            planned = plan(size)
        except ConfigError as err:
            refused[size] = err
            continue
        tried[str(size)] = planned[0]
        if best is None or (_key(planned[0]), size) < (_key(best[0][0]), best[1]):
            best = (planned, size)
    if best is None:  # every size was refused
        raise _why(refused)
    (report, rest), size = best
    fits = report["memory_per_device"]["device"]["fits"]
    device = {str(s): c.device_bytes for s, c in sorted(screens.items())}
    report["microbatch_choice"] = {
        "chosen": size,
        "rule": ("the largest that fits" if larger_no_slower else "the fastest that fits")
        if fits
        else "none fits: the least memory",
        "step_time_s": {k: r["step_time_s"] for k, r in tried.items()},
        "device_bytes": device
        | {k: r["memory_per_device"]["device"]["bytes"] for k, r in tried.items()},
        "not_planned": not_planned,
    }
    return report, rest


def _why(refused: dict[int, ConfigError]) -> ConfigError:
    """What to raise when every size was refused: the smallest size's refusal, of the
    most microbatches (a size larger still only moves further from what was asked)."""
    return refused[min(refused)]


def _fitting(
    sizes: list[int], screen: Callable[[int], Screen], screens: dict[int, Screen],
    not_planned: dict[str, str], refused: dict[int, ConfigError],
) -> list[int]:  # fmt: skip
    """Screen `sizes` from the smallest up into `screens`, stopping at the first that
    does not fit (module docstring), and return those screened in the order to plan
    them (`_order`); a size the screen refuses is left out (its error in `refused`)."""
    for i, size in enumerate(sizes):
        try:
            screens[size] = screen(size)
        except ConfigError as err:
            refused[size] = err
            continue
        if not screens[size].fits:  # nor any larger (module docstring): not screened
            for larger in sizes[i + 1 :]:
                not_planned[str(larger)] = f"not screened: larger than {size}, which does not fit"
            break
    return _order(screens) if screens else []


def _largest_fitting(
    sizes: list[int], screen: Callable[[int], Screen], screens: dict[int, Screen],
    not_planned: dict[str, str], refused: dict[int, ConfigError],
) -> list[int]:  # fmt: skip
    """Bisect `sizes` (ascending, bytes growing with them) for the largest the screen
    lets fit, the largest size first; return it and the sizes below it, unscreened
    (they fit too), or, when none fits, the smallest alone (the least memory). A size
    the screen refuses is left out (its error in `refused`)."""
    sizes = list(sizes)
    lo, hi, probe = 0, len(sizes), len(sizes) - 1  # sizes[:lo] fit, sizes[hi:] do not
    while lo < hi:
        size = sizes[probe]
        try:
            screens[size] = screen(size)
        except ConfigError as err:
            refused[size] = err
            del sizes[probe]
            hi -= 1
        else:
            lo, hi = (probe + 1, hi) if screens[size].fits else (lo, probe)
        probe = (lo + hi) // 2
    left = sizes[:lo] or sizes[:1]  # none fits: the smallest, the least memory
    for size in sizes[len(left) :]:
        if size in screens:
            not_planned[str(size)] = f"does not fit: {screens[size].device_bytes:,} device bytes"
        else:
            not_planned[str(size)] = f"not screened: larger than {sizes[lo]}, which does not fit"
    return left


def _passed_over(screen: Screen, best: dict[str, Any]) -> str:
    """Why a size need not be planned after `best` was, or "" when it must be."""
    planned = best["memory_per_device"]["device"]
    if not planned["fits"]:  # it may fit, or need less than the one planned: plan it
        if screen.fits or screen.device_bytes < planned["bytes"]:
            return ""
        return "does not fit, and needs at least the device memory of the size chosen"
    if not screen.fits:
        return f"does not fit: {screen.device_bytes:,} device bytes"
    if screen.least_step_s > best["step_time_s"]:
        return f"its least step, {screen.least_step_s:.4g} s, is slower than the chosen one"
    return ""


def _order(screens: dict[int, Screen]) -> list[int]:
    """The sizes to plan in turn: those that fit by their least step (ties: the smaller
    first, as planning every size in order would choose); when none fits, the one of
    least memory alone (the choice then), the rest after it to be passed over."""
    fitting = sorted(
        (s for s in screens if screens[s].fits), key=lambda s: (screens[s].least_step_s, s)
    )
    if fitting:
        return fitting + [s for s in screens if not screens[s].fits]
    least = min(screens, key=lambda s: (screens[s].device_bytes, s))
    return [least] + [s for s in screens if s != least]
