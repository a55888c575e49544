"""Python's cyclic garbage collector run less often while shardemu builds large
structures.

Planning allocates millions of small objects that form no cycles (a 1T-parameter
plan's 200k timeline spans, its schedules' slots, tracing's jaxprs), and CPython's
collector, at its default thresholds (700, 10, 10), sweeps every live object again and
again while they pile up: the 1T plan (`shardemu plan --model gpt --layers 128 --hidden
25600 ...`, README) took 12.8 s in its command, 10.6 s with the thresholds below, 10.1
s with no collection at all (one run each on a 2-core laptop); placing its two short
steps, 1.5 s and 0.8 s. Objects are still freed when their last reference goes; only
cycles wait longer. The test suite runs with the same thresholds (tests/conftest.py).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# the first generation collected every 50,000 allocations (not 700), the older two
# after 50 and 1,000 of the younger's collections (not 10 and 10)
THRESHOLDS = (50_000, 50, 1000)


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Inside, the collector at `THRESHOLDS` (or at the caller's, where those are
    higher); the thresholds before are restored on leaving. Usable as a decorator."""
    before = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(before, THRESHOLDS, strict=True)))
    try:
        yield
    finally:
        gc.set_threshold(*before)
