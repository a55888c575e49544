"""The compiled pieces a stage builds, by name: one enum that the builders
(`Stage._build`, `systems.per_system_builders`) and the programs that run them
(`Executor.run(phase, Piece.FWD, stage, args)`) share, so that a piece's name is
written once. A member is a `str`: the compile counter and the ledger key by its value.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

Part = Literal["layers", "shared"]  # a phase's stacked layers, or the shared weights
Memory = Literal["device", "pinned_host"]


class Piece(StrEnum):
    GATHER_LAYERS = "gather-layers"  # a layer phase's weights into their compute layout
    GATHER_SHARED = "gather-shared"
    EMBED = "embed"
    EMBED_BWD = "embed-bwd"
    FWD = "fwd"  # layers forward, nothing kept
    FWD_KEEP = "fwd-keep"  # layers forward and their vjp (the residuals)
    FWD_ACTS = "fwd-acts"  # weight streaming: each system's forward, activations kept
    BWD = "bwd"  # layers backward from their input (recomputing the forward)
    BWD_KEEP = "bwd-keep"  # layers backward from a kept vjp
    BWD_ACTS = "bwd-acts"
    HEAD = "head"  # head, loss and their gradients
    ADD_SHARED = "add-shared"  # the shared weights' embedding and head gradients summed
    ACCUMULATE = "accumulate"
    SPARSE_GRADS = "sparse-grads"
    SQ_NORM = "sq-norm"
    UPDATE_LAYERS_DEVICE = "update-layers-device"
    UPDATE_LAYERS_HOST = "update-layers-pinned_host"
    UPDATE_SHARED_DEVICE = "update-shared-device"
    UPDATE_SHARED_HOST = "update-shared-pinned_host"
    SWARMX_REDUCE_LAYERS = "swarmx-reduce-layers"
    SWARMX_REDUCE_SHARED = "swarmx-reduce-shared"

    @classmethod
    def gather(cls, part: Part) -> Piece:
        return cls(f"gather-{part}")

    @classmethod
    def update(cls, part: Part, memory: Memory) -> Piece:
        return cls(f"update-{part}-{memory}")

    @classmethod
    def swarmx_reduce(cls, part: Part) -> Piece:
        return cls(f"swarmx-reduce-{part}")
