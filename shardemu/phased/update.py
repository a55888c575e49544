"""The update of a phased step: each part (a phase's layers, the shared weights) clipped
by the global gradient norm and updated where the optimizer lives, in the host tier or
on the device with its weights, state and gradients streamed in and out
(`PhasedConfig.optimizer_on`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardemu.accounting.ledger import Phase
from shardemu.config import PhasedConfig
from shardemu.phased.state import Layout, PhasedState
from shardemu.stages.executor import Executor
from shardemu.stages.pieces import Piece
from shardemu.stages.stage import Stage


def update_part(
    ex: Executor,
    cfg: PhasedConfig,
    st: Stage,
    part: str,
    phase: Phase,
    grads: Any,
    opt: Any,
    weights: Any,
    norm: float,
) -> tuple[Any, Any]:
    """The optimizer update of one phase's layers (or of the shared weights) where
    `optimizer_on` says; the new weights and state end in the host tier."""
    store = st.layer_store if part == "layers" else st.shared_store
    opt_sh = st.layer_opt if part == "layers" else st.shared_opt
    kind = "device" if cfg.optimizer_on == "device" else "pinned_host"
    norm_arg = ex.place(np.float32(norm), st.replicated.with_memory_kind(kind))
    name = Piece.update(part, kind)
    if kind == "pinned_host":
        return ex.run(
            phase,
            name,
            st,
            (grads, opt, weights, norm_arg),
            carries="optimizer_state",
            on="host",
        )
    sized = st.layer_bytes if part == "layers" else lambda w, o: None
    w = ex.to_device(st.index, "update:w", weights, store, phase, "weights", sized(weights, opt))
    o = ex.to_device(st.index, "update:opt", opt, opt_sh, phase, "optimizer_state")
    g = ex.to_device(st.index, "update:g", grads, store, phase, "gradients")
    new_w, new_o = ex.run(phase, name, st, (g, o, w, norm_arg), carries="optimizer_state")
    for key in ("update:w", "update:opt", "update:g"):
        ex.tiers[st.index].release(key)
    return (
        ex.to_host(st.index, new_w, store, phase, "weights", sized(new_w, new_o)),
        ex.to_host(st.index, new_o, opt_sh, phase, "optimizer_state"),
    )


def update(
    ex: Executor,
    lay: Layout,
    cfg: PhasedConfig,
    state: PhasedState,
    grads: list[Any],
    shared_grads: Any,
    norm: float,
) -> PhasedState:
    """Every phase's update, then the shared weights': the next step's state."""
    layers, opt_layers = [], []
    for i in range(len(lay.slices)):
        w, o = update_part(
            ex,
            cfg,
            lay.stage_of(i),
            "layers",
            lay.phase("update", i),
            grads[i],
            state.opt_layers[i],
            state.layers[i],
            norm,
        )
        layers.append(w)
        opt_layers.append(o)
    shared_w, opt_shared = update_part(
        ex,
        cfg,
        lay.stages[0],
        "shared",
        Phase("update"),
        shared_grads,
        state.opt_shared,
        state.shared,
        norm,
    )
    return PhasedState(shared_w, layers, opt_shared, opt_layers)
