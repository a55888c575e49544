"""A piece's optimized HLO, without the machine code XLA would make of it.

A count reads three things of a compiled piece: its HLO after XLA's passes (kernels,
collectives), XLA's cost analysis of that HLO (FLOPs), and its outputs' shardings. On
the CPU, XLA spends most of a compile after those passes, generating kernels a count
never runs: `perf` over two GPT-3 175B microbatch counts found the HLO passes 5% of the
samples, the fusion emitters 26%, LLVM 12%, the thunk emitter 9% and MLIR contexts 10%.
So a count compiles with a hook at the end of XLA's pipeline (`jax.extend.xla`'s
`register_hlo_module_transformation`, after scheduling) that keeps the module and ends
the compile there. That module is the one `Compiled.as_text()` prints (debug metadata
aside), and `hlo_module_cost_analysis` of it is `Compiled.cost_analysis()`:
tests/test_count.py holds every field of a count and every output sharding made this
way equal to those of the whole compile.

The hook sees every CPU compile in the process; it acts only on modules whose name
carries `_MARK` (a count's lowering is renamed, its trace reused, so no lowering JAX
caches for a run is touched), and leaves the rest (a run's programs) as they are. It
reads JAX internals (a `Traced`'s parameters, `pxla`'s reading of an executable's
output shardings, `hlo_module_cost_analysis`), so pyproject.toml keeps JAX at 0.10;
tests/test_count.py fails if they change.
"""

from __future__ import annotations

import itertools
import re
import threading
from dataclasses import dataclass
from typing import Any

import jax
from jax._src.interpreters import pxla
from jax._src.lib import _jax, hlo, xla_client
from jax.extend import xla as jax_xla
from jax.extend.sharding import GSPMDSharding
from jax.sharding import Mesh
from jax.stages import Traced

_MARK = "shardemu_hlo_only_"
_SERIAL = re.compile(_MARK + r"(\d+)_")
# XLA's memory spaces on the CPU, as `Compiled.output_shardings` names them (S(5), S(6)
# in a layout; none is the device's)
_MEMORY_KINDS = {"": "device", "5": "pinned_host", "6": "unpinned_host"}
_RESULT_LAYOUT = re.compile(r"entry_computation_layout=\{\(.*?\)->(.*?)\}(?:, \w+=|$)")
_LEAF = re.compile(r"\w+\[[\d,]*\](?:\{[^}]*\})?")
_SPACE = re.compile(r":S\((\d+)\)")


class _Stop(Exception):
    """Raised by the hook: the module is kept, nothing after it is needed."""


_kept: dict[int, Any] = {}
_serials = itertools.count()
_install = threading.Lock()
_installed: list[bool] = []


def _keep(proto: bytes) -> None:
    """The hook: keep a marked module (its name is the proto's first field) and stop."""
    if _MARK.encode() not in proto[:256]:
        return None
    module = hlo.HloModule.from_serialized_hlo_module_proto(proto)
    serial = _SERIAL.search(module.name)
    if serial is None:
        return None
    _kept[int(serial.group(1))] = module
    raise _Stop(module.name)


def _ensure_hook() -> None:
    with _install:
        if not _installed:
            jax_xla.register_hlo_module_transformation(
                _keep,
                name="shardemu-keep-optimized-hlo",
                stage=jax_xla.PipelineStage.POST_SCHEDULER,
                platforms="cpu",
            )
            _installed.append(True)


@dataclass(frozen=True)
class Optimized:
    """What a count reads of a compiled piece, answered as `jax.stages.Compiled`
    answers it: `as_text()`, `cost_analysis()`, `output_shardings` (a tree of them)."""

    text: str
    cost: dict[str, float]
    output_shardings: Any

    def as_text(self) -> str:
        return self.text

    def cost_analysis(self) -> dict[str, float]:
        return self.cost


def optimized(fn: Any, args: tuple, mesh: Mesh, options: dict[str, Any]) -> Optimized:
    """The jitted `fn` over the abstract `args`, compiled with `options` up to the end of
    XLA's HLO passes on `mesh` and no further. (On another platform, whose compiler
    the hook is not registered with, compiled whole: the same HLO, later.)"""
    if mesh.devices.flat[0].platform != "cpu":
        whole = fn.lower(*args).compile(compiler_options=options)
        return Optimized(whole.as_text(), whole.cost_analysis(), whole.output_shardings)
    _ensure_hook()
    traced = fn.trace(*args)
    serial = next(_serials)
    params = {**traced._params, "name": f"{_MARK}{serial}_{traced.fun_name}"}
    marked = Traced(traced._meta_tys_flat, params, traced._in_tree, traced.out_tree, traced._consts)
    try:
        marked.lower().compile(compiler_options=options)
    except jax.errors.JaxRuntimeError:
        if serial not in _kept:
            raise
    else:
        raise RuntimeError(f"XLA compiled {traced.fun_name} whole: the HLO hook did not run")
    module = _kept.pop(serial)
    client = mesh.devices.flat[0].client
    cost = _jax.hlo_module_cost_analysis(client, module)
    text = module.to_string()
    shardings = _output_shardings(traced, args, module, text, mesh)
    return Optimized(text, dict(cost), shardings)


def _output_shardings(traced: Traced, args: tuple, module: Any, text: str, mesh: Mesh) -> Any:
    """Each output's sharding, as JAX reads an executable's (`pxla`'s
    `get_out_shardings_from_executable`, then JAX's own `maybe_recover_user_shardings`
    and `finalize_shardings`): the one `fn` declares; else XLA's (replicated on one
    device, where XLA's SPMD partitioner does not run; one for all, where XLA put one
    on the tuple of outputs), with the memory kind of the result's layout, and
    written as JAX writes it (an argument's sharding where equivalent to it)."""
    devices = tuple(mesh.devices.flat)
    out_avals = traced.jaxpr.out_avals
    header = text.split("\n", 1)[0]
    kinds = [_memory_kind(leaf) for leaf in _LEAF.findall(_RESULT_LAYOUT.search(header)[1])]
    if len(devices) == 1:
        xla = [GSPMDSharding.get_replicated(devices, memory_kind=k) for k in kinds]
    else:
        whole = xla_client.HloSharding.from_proto(module.spmd_output_sharding)
        parts = whole.tuple_elements() or [whole]
        if len(parts) == 1 and len(out_avals) > 1:
            parts = parts * len(out_avals)
        xla = [GSPMDSharding(devices, p, memory_kind=k) for p, k in zip(parts, kinds, strict=True)]
    declared = [x.sharding for x in jax.tree.leaves(traced.out_info)]
    out = [x if mine is None else mine for mine, x in zip(declared, xla, strict=True)]
    given = [x.sharding for x in jax.tree.leaves(args)]
    out = pxla.maybe_recover_user_shardings(
        given, out, traced.jaxpr.in_avals, out_avals, None, traced._params["ctx_mesh"]
    )
    return jax.tree.unflatten(traced.out_tree, pxla.finalize_shardings(out, devices))


def _memory_kind(leaf: str) -> str:
    space = _SPACE.search(leaf)
    key = space.group(1) if space else ""
    if key not in _MEMORY_KINDS:
        raise NotImplementedError(f"an output in XLA memory space S({key}): {leaf}")
    return _MEMORY_KINDS[key]
