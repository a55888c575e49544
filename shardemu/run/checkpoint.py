"""Checkpoints of a run's state with orbax-checkpoint, in `RUN_DIR/checkpoints/<step>/`.

A checkpoint holds the engine's whole state as it lives between steps (parameters and
optimizer state; for a phased run, the host tier) and a small JSON record: the number
of steps done, which is also the data position (step k trains on batch k), and the
layout the state was made for. The data stream is a pure function of (seed, step), so
restoring the state and the step is all a resumed run needs to repeat the losses bit
for bit.

Restoring goes through a template: the state a fresh engine initialises on the mesh
of the resumed run. orbax reads each array straight into the template's sharding, so
a checkpoint written on one mesh restores onto another (tensor=2,replica=2 onto one
device, say). The tree must be the same: an engine or pipeline layout that differs
from the checkpoint's is refused with both named.

orbax writes a checkpoint into a temporary directory and renames it when complete
(`orbax.checkpoint` "atomicity"), so a run killed while writing keeps the previous one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from shardemu.errors import CheckpointError

CHECKPOINTS = "checkpoints"


def abstract_like(state: Any) -> Any:
    """Shapes, dtypes and shardings of `state`: the target orbax restores into."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )


class Checkpoints:
    """The checkpoints of one run directory (the last two are kept)."""

    def __init__(self, run_path: str | Path) -> None:
        self.path = Path(run_path).absolute() / CHECKPOINTS
        options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.path, options=options)

    def save(self, steps_done: int, state: Any, layout: dict[str, Any]) -> None:
        """The state after `steps_done` steps, and the layout it was made for."""
        meta = {"steps_done": steps_done, "data_position": steps_done, "layout": layout}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(steps_done, args=args, force=True)
        self._manager.wait_until_finished()

    def latest(self) -> int | None:
        """Steps done at the newest complete checkpoint (None if there is none)."""
        self._manager.reload()
        return self._manager.latest_step()

    def check_layout(self, steps_done: int, layout: dict[str, Any]) -> None:
        """Refuse, before anything compiles, a run whose state is laid out otherwise."""
        meta = self._manager.restore(
            steps_done, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        ).meta
        if meta["layout"] != layout:
            raise CheckpointError(
                f"the checkpoint after {steps_done} steps in {self.path} holds a state laid "
                f"out as {meta['layout']}, which cannot be restored as {layout}; resume with "
                f"the checkpoint's engine and pipeline settings (tensor and replica may change)"
            )

    def restore(self, steps_done: int, template: Any) -> Any:
        """The state saved after `steps_done` steps, placed as `template` is."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_like(template)))
        return self._manager.restore(steps_done, args=args).state

    def close(self) -> None:
        self._manager.close()
