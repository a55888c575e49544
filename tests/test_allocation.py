"""`fewer_collections`: the collector's thresholds raised inside, never lowered, and put
back on leaving, even when the body raises."""

import gc

import pytest

from shardemu.allocation import THRESHOLDS, fewer_collections


def test_thresholds_are_raised_inside_and_restored_after():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 2000)  # the caller's third is above THRESHOLDS'
        with pytest.raises(RuntimeError), fewer_collections():
            assert gc.get_threshold() == (THRESHOLDS[0], THRESHOLDS[1], 2000)
            raise RuntimeError("the body failed")
        assert gc.get_threshold() == (700, 10, 2000)
    finally:
        gc.set_threshold(*before)
