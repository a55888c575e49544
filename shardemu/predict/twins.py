"""Layouts that are one step: a search's resident candidates that differ in precision
alone where the precisions count alike (`count_key`: fp16-mixed counts in bfloat16) and
the profile runs them at one rate. Their plans take equal inputs (`plan_resident.
CountedLayout.same_step`), so the search times one and gives the other its measures
(`search.Searcher.screen`): on 1536 A100s, every one of GPT-3 175B's 120 BF16 layouts
that fit had an FP16 twin with the same step time and bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from shardemu.predict.layouts import Candidate
from shardemu.predict.plan_resident import CountedLayout
from shardemu.predict.rows import SearchRow


@dataclasses.dataclass
class Twins:
    """The rows judged so far by their candidates less the precision, and `counted`, a
    candidate's counted layout (None where its plan is refused or does not fit)."""

    counted: Callable[[Candidate], CountedLayout | None]
    _rows: dict[Candidate, list[SearchRow]] = dataclasses.field(default_factory=dict)

    def of(self, c: Candidate) -> SearchRow | None:
        """A row judged for a layout whose step is `c`'s, or None."""
        rows = self._rows.get(dataclasses.replace(c, precision=""), [])
        mine = self.counted(c) if rows else None
        if mine is None:
            return None
        for row in rows:
            theirs = self.counted(row.candidate)  # type: ignore[arg-type]
            if theirs is not None and mine.same_step(theirs):
                return row
        return None

    def add(self, c: Candidate, row: SearchRow) -> None:
        """Keep `row`, a timed plan of `c`."""
        self._rows.setdefault(dataclasses.replace(c, precision=""), []).append(row)
