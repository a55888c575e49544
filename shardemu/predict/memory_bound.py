"""A resident layout's device bytes with nothing compiled: the microbatch's weights,
optimizer state and layer input from their shapes (what a layer keeps for its backward
is the target's: `resident_memory.kept`). A search judges memory first (`search.py`,
`resident_memory.device_bytes_at_least`), and most layouts that do not fit would
compile only to find that out.
"""

from __future__ import annotations

import functools
from typing import Any

from shardemu.accounting.count import PROCESS_COUNTER
from shardemu.accounting.matmuls import compute_itemsize
from shardemu.accounting.sizes import bytes_per_device, copies
from shardemu.predict.resident_count import (
    CountKey,
    Microbatch,
    one_stage,
    optimizer_state,
    shared_reads,
)
from shardemu.stages.pieces import Piece


@functools.lru_cache(maxsize=256)
def memory_bound(key: CountKey) -> Microbatch:
    """`counted_microbatch`'s bytes (`count_key`), with nothing compiled and no pieces:
    exact, but for what a layer keeps for its backward without full recomputation,
    which is not traced (0 here): a layout's device bytes hold what the target keeps
    (`resident_memory.kept`), not the count's (its report's CPU witness), so they are
    the same from this bound as from the count (test_search.py)."""
    model, tensor, microbatch_size, seq, full, precision, _, rules, context = key
    built, st, shared, layer, batch, settings = one_stage(
        model, tensor, microbatch_size, seq, precision, rules, context
    )
    # traced through the process counter, whose count of the microbatch then reuses it
    embed = (shared, batch)
    leaves, tree = PROCESS_COUNTER.outputs(
        Piece.EMBED, st.fn(Piece.EMBED), st.mesh, embed, settings, embed
    )
    x, _ = tree.unflatten(leaves)  # shardings declared: nothing compiled
    opt = (
        bytes_per_device(optimizer_state(built.tx_layers, layer, st.layer_opt)),
        bytes_per_device(optimizer_state(built.tx_shared, shared, st.shared_opt)),
    )
    return Microbatch(
        {},
        bytes_per_device(layer),
        bytes_per_device(shared),
        bytes_per_device(x) if full else 0,  # with full recomputation, its input alone
        opt,
        bytes_per_device(x),
        copies(x),
        reads=_reads(key, st, shared, batch),
        weight_itemsize=compute_itemsize(layer),
    )


# (model, tensor, seq, precision, attention, rules, context) -> `shared_reads`
_READS: dict[CountKey, tuple[int, int]] = {}


def _reads(key: CountKey, st: Any, shared: Any, batch: Any) -> tuple[int, int]:
    """`shared_reads` once a mesh and precision: which shared weights the embedding and
    the head read does not depend on how many sequences they read or whether the
    layers recompute, and tracing the head's backward took 4.4 of the 15 CPU-seconds
    a grown search's own thread works (240 traces for 24 answers: GPT-3 175B on 1024
    A100s, ZeRO 0 and 3, context 1 and 2)."""
    mesh = key._replace(microbatch_size=0, full=False)
    if mesh not in _READS:
        _READS[mesh] = shared_reads(st, shared, batch)
    return _READS[mesh]
