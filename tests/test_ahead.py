"""Counting ahead (`predict/ahead.py`): groups of keys are made in order by background
threads, a group's keys in turn; `ready` waits for the group being made, takes back a
group not started (the caller makes its keys), and lets a failed key's error come from
the caller's own call; a key no longer `wanted` by its turn is skipped."""

import threading

import pytest

from shardemu.predict.ahead import CountsAhead


def test_groups_are_made_in_order_and_ready_waits_for_the_one_being_made():
    release, started, made = threading.Event(), threading.Event(), []

    def count(key: int) -> None:
        if key == 1:
            started.set()
            assert release.wait(10)
        made.append(key)

    groups = [(1, 2), (3,), (2, 4)]
    with CountsAhead(count, groups, workers=1) as ahead:
        assert started.wait(10)
        ahead.ready(3)  # not started: taken back at once, the caller's to make
        release.set()
        ahead.ready(2)  # its group is being made: returns once the group is made
        assert made[:2] == [1, 2]
        ahead.ready(4)  # made by now, or taken back
        ahead.ready(5)  # never asked ahead: nothing to wait for
    assert 3 not in made
    assert made.count(2) == 1  # a key in two groups is made once, with the first


def test_a_failed_count_is_left_to_the_caller():
    made = []

    def count(key: int) -> None:
        made.append(key)
        raise ValueError(f"no layout {key}")

    with CountsAhead(count, [(1,)]) as ahead:
        ahead.ready(1)  # returns: the caller's own call raises, with its traceback
        with pytest.raises(ValueError, match="no layout 1"):
            count(1)
    assert made == [1, 1]


def test_a_key_no_longer_wanted_when_its_turn_comes_is_skipped():
    """`wanted` is asked as each key's turn comes, not when it is queued: a key ruled out
    meanwhile (a search's layouts pruned by what it found since) is not made."""
    release, started, last = (threading.Event() for _ in range(3))
    made, unwanted = [], set()

    def count(key: int) -> None:
        if key == 1:
            started.set()
            assert release.wait(10)
        made.append(key)
        if key == 3:
            last.set()

    with CountsAhead(count, [(1,), (2, 3)], workers=1, wanted=lambda k: k not in unwanted):
        assert started.wait(10)
        unwanted.add(2)  # after it was queued, before its turn
        release.set()
        assert last.wait(10)
    assert made == [1, 3]
