"""The microbatch choice against planning every size (`predict/microbatch.py`), over made-up
planners whose bytes grow with the size: the same choice whatever the screens skip, and,
where a larger size is no slower, the largest that fits found by bisection."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shardemu.config import ConfigError, Parallelism
from shardemu.predict.microbatch import Screen, choose_microbatch, microbatch_candidates


def planner(limit: int, extra: dict[int, int], refused: set[int], one_stage: bool):
    """A plan and its screen: `size` bytes a size (the screen's bound), and when
    planned whole the `extra` of it and of every smaller size more (bytes grow with the
    size); a step that falls with the size on one stage and has its least at 4
    otherwise; `refused` sizes refused by both."""
    screened: list[int] = []

    def step(size: int) -> float:
        return 1.0 / size if one_stage else 1.0 + abs(math.log2(size) - 2)

    def screen(size: int) -> Screen:
        if size in refused:
            raise ConfigError(f"size {size} refused")
        screened.append(size)
        return Screen(size, size <= limit, step(size) * 0.5)

    def plan(size: int) -> tuple[dict, None]:
        if size in refused:
            raise ConfigError(f"size {size} refused")
        used = size + sum(b for s, b in extra.items() if s <= size)
        fits = {"fits": used <= limit, "bytes": used}
        return {"step_time_s": step(size), "memory_per_device": {"device": fits}}, None

    return screen, plan, screened


@settings(max_examples=200, deadline=None)
@given(
    per_replica=st.sampled_from([1, 2, 8, 12, 64, 256]),
    limit=st.integers(0, 300),
    extra=st.dictionaries(st.sampled_from([1, 2, 4, 8, 64, 256]), st.integers(0, 100)),
    refused=st.sets(st.sampled_from([2, 4, 8, 12, 64])),
    one_stage=st.booleans(),
)
def test_a_screened_choice_is_the_choice_of_planning_every_size(
    per_replica, limit, extra, refused, one_stage
):
    screen, plan, screened = planner(limit, extra, refused, one_stage)
    # size 1 is never refused: there is always a size to choose
    sizes = [s for s in microbatch_candidates(per_replica) if s not in refused]
    reports = {s: plan(s)[0] for s in sizes}
    fitting = [s for s in sizes if reports[s]["memory_per_device"]["device"]["fits"]]
    if fitting:
        want = min(fitting, key=lambda s: (reports[s]["step_time_s"], s))
    else:  # none fits: the least memory
        want = min(sizes, key=lambda s: (reports[s]["memory_per_device"]["device"]["bytes"], s))
    par = Parallelism()
    report, _ = choose_microbatch(per_replica, par, plan, screen, larger_no_slower=one_stage)
    choice = report["microbatch_choice"]
    assert choice["chosen"] == want, (choice, want)
    assert set(choice["device_bytes"]) >= {str(s) for s in screened}
    assert str(choice["chosen"]) not in choice["not_planned"]
    if one_stage:  # bisection: the largest size, then halving the sizes left
        assert len(screened) <= 1 + math.ceil(math.log2(len(microbatch_candidates(per_replica))))


def test_one_stage_screens_the_whole_batch_alone_when_it_fits():
    screen, plan, screened = planner(10**6, {}, set(), one_stage=True)
    report, _ = choose_microbatch(256, Parallelism(), plan, screen, larger_no_slower=True)
    assert screened == [256] and report["microbatch_choice"]["chosen"] == 256
    assert report["microbatch_choice"]["not_planned"]["128"] == (
        "a smaller microbatch is no faster on one stage"
    )
