"""Counting ahead: the counts a search will need, made in background threads while the
search plans with the counts it already has.

A search's time is counting (tracing and compiling pieces: JAX and XLA) and planning
(assembling and timing events: pure Python). XLA compiles without holding Python's
global interpreter lock, so on two cores a compile in the background runs beside the
planning in the foreground (and, while the planning waits for a count, two compiles
run side by side). The counts are the same functions' results whichever
thread makes them (`resident_count.counted_microbatch`, cached per process).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class CountsAhead:
    """`fn(key)` for each key of each group, a group's keys in turn, the groups in
    order over `workers` background threads, each key only if `wanted(key)` still holds
    when its turn comes (a search learns, while the counts are made, which layouts its
    bounds rule out: a count queued for them alone is skipped). Before using a key's
    count the caller calls `ready(key)`: it waits for the key's group if it is being
    made, and takes the group back if it has not started, so the caller makes its keys
    itself (no count is made twice at once; a key skipped is the caller's to make).
    `add` queues more groups, each as its iterable yields it."""

    def __init__(
        self,
        fn: Callable[[Any], Any],
        groups: Iterable[tuple[Hashable, ...]] = (),
        workers: int = 2,
        wanted: Callable[[Any], bool] = lambda _: True,
    ) -> None:
        self._fn = fn
        self._wanted = wanted
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="count-ahead")
        self._futures: dict[Hashable, Future] = {}
        self.add(groups)

    def add(self, groups: Iterable[tuple[Hashable, ...]]) -> None:
        """Queue more groups, after those queued (a key queued before is not again),
        each as soon as `groups` yields it: the caller may work out the next groups
        while the first are made."""
        for group in groups:
            keys = [k for k in dict.fromkeys(group) if k not in self._futures]
            if keys:
                future = self._pool.submit(self._make, keys)
                self._futures |= dict.fromkeys(keys, future)

    def _make(self, keys: list[Hashable]) -> None:
        for key in keys:
            if self._wanted(key):
                self._fn(key)

    def ready(self, key: Hashable) -> None:
        """Return once `fn(key)` is made, or is the caller's to make."""
        future = self._futures.pop(key, None)
        if future is None or future.cancel():
            return
        # a count that failed is made again by the caller, whose call raises the error
        future.exception()

    def close(self) -> None:
        """Drop the counts not started; wait for the one being made."""
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CountsAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
