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
Across processes (`--processes`), every process writes its shards into process 0's run
directory (`shared_run_path`: each other process keeps its own records in a temporary
folder), and orbax joins them; process 0 alone writes the manifest and sets aside a
damaged checkpoint.

A complete checkpoint can still be damaged afterwards (a truncated or zeroed file, a
part deleted): each checkpoint's files are listed with their sizes and CRC-32s
(`write_manifest`), and a resume passes over a damaged one for the newest that reads
back whole, and says so (`restore_newest`).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh

from shardemu.errors import CheckpointError
from shardemu.run import spanning

if TYPE_CHECKING:
    import orbax.checkpoint as ocp


def _orbax() -> Any:
    """orbax.checkpoint, imported where a run first checkpoints: 0.15 s of every command's
    start (`shardemu plan` among them) that only a run with checkpoints needs."""
    import orbax.checkpoint

    return orbax.checkpoint


CHECKPOINTS = "checkpoints"
log = logging.getLogger("shardemu")
_PATH_BYTES = 4096  # the longest run directory path `shared_run_path` sends


def shared_run_path(path: str | Path) -> Path:
    """Process 0's run directory, as every process of a multi-process run must name the
    one checkpoint folder they write together (`path` itself in one process)."""
    if jax.process_count() == 1:
        return Path(path)
    from jax.experimental import multihost_utils

    encoded = str(Path(path).absolute()).encode()
    if len(encoded) > _PATH_BYTES:
        raise CheckpointError(
            f"run directory {path}: its path is over {_PATH_BYTES} bytes; use a shorter one"
        )
    padded = np.zeros(_PATH_BYTES, np.uint8)
    padded[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    sent = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return Path(bytes(sent[sent != 0]).decode())


def abstract_like(state: Any) -> Any:
    """Shapes, dtypes and shardings of `state`: the target orbax restores into."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )


def _without_empty(tree: Any) -> Any:
    """`tree` with its arrays of no elements as None: orbax refuses to save an array of
    zero size ("Cannot save arrays with zero size"), and such an array holds nothing
    to save (a model chunk without layers: `pipelined/layout.Split`)."""
    return jax.tree.map(lambda a: None if a.size == 0 else a, tree)


def _refilled(restored: Any, template: Any) -> Any:
    """`restored` (from a tree saved `_without_empty`) with `template`'s arrays of no
    elements put back where it holds None."""
    leaves, treedef = jax.tree.flatten(restored, is_leaf=lambda x: x is None)
    kept = [t if r is None else r for r, t in zip(leaves, jax.tree.leaves(template), strict=True)]
    return jax.tree.unflatten(treedef, kept)


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """orbax's handler of a state's tree (what `StandardSave` uses), but for one setting:
    each array is written from the shards of its first replica whole, not sliced
    across its replicas on the devices first (`use_replica_parallel`, which spreads a
    replicated array's writing over hosts). On one machine's virtual devices the slices
    only added a compiled slice per shard and save: a tensor=2,replica=4 GPT-tiny saved
    1,924 of them in four checkpoints (1.4 of its 2.4 s of saving), and test_checkpoint.py
    took 33-35 CPU-s against 38-42. The files are the same tensorstore arrays (replicas
    hold the same values), and a checkpoint of either kind restores."""
    ocp = _orbax()
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (int, ocp.type_handlers.ScalarHandler()),
        (float, ocp.type_handlers.ScalarHandler()),
        (np.number, ocp.type_handlers.ScalarHandler()),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class Checkpoints:
    """The checkpoints of one run directory (the last two are kept)."""

    def __init__(self, run_path: str | Path, stages: Sequence[Mesh] = ()) -> None:
        """`stages`: the meshes of a pipelined or phased run's stages, whose arrays a
        checkpoint across processes joins over `pipe` (`spanning.py`)."""
        self.path = Path(run_path).absolute() / CHECKPOINTS
        self.stages = tuple(stages)
        ocp = _orbax()
        options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
        handlers = {"state": _state_handler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.path, options=options, item_handlers=handlers)

    def save(self, steps_done: int, state: Any, layout: dict[str, Any]) -> None:
        """The state after `steps_done` steps, and the layout it was made for."""
        meta = {"steps_done": steps_done, "data_position": steps_done, "layout": layout}
        if spanning.needed(self.stages):
            state = spanning.spanning(state, self.stages)
        ocp = _orbax()
        saved = ocp.args.PyTreeSave(_without_empty(state))
        args = ocp.args.Composite(state=saved, meta=ocp.args.JsonSave(meta))
        self._manager.save(steps_done, args=args, force=True)
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
            write_manifest(self.path / str(steps_done))

    def latest(self) -> int | None:
        """Steps done at the newest complete checkpoint (None if there is none)."""
        self._manager.reload()
        return self._manager.latest_step()

    def check_layout(self, steps_done: int, layout: dict[str, Any]) -> None:
        """Refuse, before anything compiles, a run whose state is laid out otherwise."""
        ocp = _orbax()
        meta = self._manager.restore(
            steps_done, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        ).meta
        if not isinstance(meta, dict) or "layout" not in meta:
            raise ValueError(f"its meta record holds no layout: {meta!r}")
        if meta["layout"] != layout:
            raise CheckpointError(
                f"the checkpoint after {steps_done} steps in {self.path} holds a state laid "
                f"out as {meta['layout']}, which cannot be restored as {layout}; resume with "
                f"the checkpoint's engine and pipeline settings (tensor and replica may change)"
            )

    def restore(self, steps_done: int, template: Any) -> Any:
        """The state saved after `steps_done` steps, placed as `template` is."""
        joined = spanning.needed(self.stages)
        target = spanning.spanning_template(template, self.stages) if joined else template
        abstract = abstract_like(_without_empty(target))
        ocp = _orbax()
        restore = ocp.checkpoint_utils.construct_restore_args(abstract)
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(abstract, restore_args=restore))
        state = _refilled(self._manager.restore(steps_done, args=args).state, target)
        return spanning.on_stages(state, template) if joined else state

    def restore_newest(
        self, template: Any, layout: dict[str, Any], set_aside: bool
    ) -> tuple[int, Any]:
        """(steps done, state) of the newest checkpoint that restores whole, placed as
        `template` is; (0, `template`) when there is none. A damaged one (a meta record
        or arrays that do not read back: what a kill, a full disk or a bad block leaves)
        is passed over for the one before and said so on the `shardemu` logger; with
        `set_aside` (the run goes on in this directory and will save those steps again)
        it is renamed `<step>.damaged`, kept, not deleted. A whole checkpoint of another
        layout is refused (`check_layout`); none whole among several is an error naming
        why each failed."""
        self._manager.reload()
        damaged: list[tuple[int, str]] = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            broken = check_manifest(self.path / str(step))
            if broken is not None:  # found without asking orbax, which prints its failures
                damaged.append((step, broken))
                continue
            try:
                self.check_layout(step, layout)
                state = self.restore(step, template)
            except CheckpointError:
                raise
            except Exception as err:  # orbax and tensorstore raise bare Exception too
                damaged.append((step, str(err).splitlines()[0][:200]))
                continue
            self._report(damaged, step, set_aside)
            return step, state
        if damaged:
            reasons = "; ".join(f"after {step} steps: {why}" for step, why in damaged)
            raise CheckpointError(
                f"no checkpoint in {self.path} reads back whole ({reasons}); nothing was "
                f"changed: remove them to start over"
            )
        return 0, template

    def _report(self, damaged: list[tuple[int, str]], used: int, set_aside: bool) -> None:
        for step, why in damaged:
            where = self.path / str(step)
            if set_aside and jax.process_index() == 0:
                where = where.rename(where.with_name(f"{step}.damaged"))
            log.warning(
                "the checkpoint after %d steps does not read back whole (%s): resuming from "
                "the one after %d steps%s",
                step, why, used, f"; it is kept as {where}" if set_aside else "",
            )  # fmt: skip

    def close(self) -> None:
        self._manager.close()


MANIFEST = "shardemu-manifest.json"


def _crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(2**24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(step_dir: Path) -> None:
    """Every file of a finished checkpoint with its size and CRC-32, so that a resume
    finds a truncated, zeroed or missing part before restoring (`check_manifest`)."""
    files = {
        str(f.relative_to(step_dir)): [f.stat().st_size, _crc(f)]
        for f in sorted(step_dir.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    (step_dir / MANIFEST).write_text(json.dumps(files))


def check_manifest(step_dir: Path) -> str | None:
    """Why the checkpoint in `step_dir` differs from what was written (None: it does
    not, or it has no manifest: one written before manifests, or killed between its
    commit and its manifest, which the restore itself then checks)."""
    try:
        files = json.loads((step_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        return f"its manifest does not read ({err})"
    for name, (size, crc) in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, written as {size:,}"
        if _crc(path) != crc:
            return f"{name} does not hold the bytes written (CRC-32 differs)"
    return None
