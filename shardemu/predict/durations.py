"""How long one ledger event takes on a hardware profile, and the stream it runs on
(`costmodel.py` places events on streams).

Durations: a device computation = its roofline (`roofline.py`: each matmul at the
matmul rate or the memory bandwidth, plus a fixed cost; the other kernels' bytes at the
memory bandwidth); on the host, FLOPs / host FLOP/s. A transfer = bytes per device /
host-link bandwidth. A SwarmX broadcast or reduce = bytes per link / the slower of
the system's I/O and MemoryX, plus a latency per level of the tree
(`Hardware.swarmx_seconds`). A collective = bytes each device sends (the ledger holds
the ring algorithm's: `collectives.py`) / the link bandwidth of its axis, intra-node
when the axis's device group fits in one node (the mesh is laid out pipe, replica,
expert, tensor with tensor innermost), else inter-node. A pipeline send under
Megatron-LM's scatter/gather: a share over the pipe link, then an all-gather over
`tensor` (`pipe_send_seconds`).
"""

from __future__ import annotations

import functools

from shardemu.accounting.ledger import Event
from shardemu.config import Parallelism
from shardemu.predict.hardware import GB, Hardware
from shardemu.predict.roofline import compute_seconds


def stream_of(event: Event) -> str:
    if event.kind == "compute":
        return "host" if event.on == "host" else "compute"
    if event.kind == "collective":
        return f"collective:{event.axis}"
    return event.kind


@functools.lru_cache(maxsize=1024)  # asked once per collective a timeline places
def axis_span(axis: str, par: Parallelism) -> int:
    """How many consecutive devices a group along `axis` (e.g. "replica+tensor")
    spans, in the mesh's (pipe, replica, expert, context, tensor) layout."""
    names = set(axis.split("+"))
    if "pipe" in names:
        return par.num_devices
    if "replica" in names:
        return par.replica * par.expert * par.context * par.tensor
    if "expert" in names:
        return par.expert * par.context * par.tensor
    if "context" in names:
        return par.context * par.tensor
    return par.tensor


def rules_key(event: Event) -> Event:
    """The event whose stream and seconds `event` has on every profile: the copy of a
    chunk's piece it is alike to (`resident_step._StepEvents.scaled`: the same work in
    another chunk's phase), else the event it was placed from (`Event.placed`: another
    microbatch or stage), else itself. Neither a duration nor a stream reads the phase
    beyond its kind, or the stage."""
    return event.__dict__.get("_alike") or event.__dict__.get("_origin", event)


def duration(event: Event, hw: Hardware, par: Parallelism) -> float:
    """Seconds one event takes on `hw` (the module docstring)."""
    per_device = 1 / max(event.devices, 1)
    if event.kind == "compute" and event.on == "host":
        return event.flops * per_device / (hw.host_tflops * 1e12)
    if event.kind == "compute":
        return compute_seconds(event, hw)
    if event.kind in ("h2d", "d2h"):
        return event.bytes * per_device / (hw.host_link_gbps * GB)
    if event.kind in ("broadcast", "reduce"):  # bytes per SwarmX link; devices = systems
        return hw.swarmx_seconds(event.bytes, event.devices)
    return event.bytes * per_device / (collective_gbps(event, hw, par) * GB)


def is_pipe_send(event: Event) -> bool:
    """Whether `event` is a point-to-point send between pipeline stages (not the tied
    embedding's all-reduce over `pipe`): what scatter/gather changes."""
    return event.axis == "pipe" and event.op == "collective-permute"


def pipe_send_seconds(event: Event, hw: Hardware, par: Parallelism) -> float:
    """A send over `pipe` under Megatron-LM's scatter/gather (`Overlap.pipe_scatter_gather`):
    each of the `event.copies` tensor ranks holding a byte sends 1/copies of it over the
    pipe link, then the receiving stage all-gathers the pieces over `tensor`, (k-1)/k of
    the tensor a rank in a ring (`collectives.py`) at the tensor group's bandwidth, in
    turn (`p2p_communication._communicate` waits for the sends before it gathers)."""
    k = event.copies
    if k <= 1:
        return duration(event, hw, par)
    scattered = event.replaced(bytes=event.bytes // k)
    gather = event.replaced(axis="tensor", op="all-gather", group=k,
                            bytes=event.bytes * (k - 1) // k)  # fmt: skip
    return duration(scattered, hw, par) + duration(gather, hw, par)


def least_seconds(event: Event, hw: Hardware, par: Parallelism) -> float:
    """`event`'s seconds under any `Overlap`: a send over `pipe` whole or scattered,
    whichever is shorter (for bounds that do not know which a plan will use)."""
    seconds = duration(event, hw, par)
    if is_pipe_send(event):
        return min(seconds, pipe_send_seconds(event, hw, par))
    return seconds


RING_OPS = frozenset({"all-reduce", "all-gather", "reduce-scatter"})


def collective_gbps(event: Event, hw: Hardware, par: Parallelism) -> float:
    """GB/s per device for a collective's bytes: the node's links when its group stays in
    one node; across nodes, a device's own link, or (`Hardware.nic_per_device`, a ring
    collective) the links of the group's devices in one node together, at most the
    node's own bandwidth. (FSDP over 64 A100s gathers at 8 x 25 GB/s a GPU; Megatron's
    data parallelism at tensor 8, one device of each group a node, at 25.)"""
    axis = event.axis or ""
    span = axis_span(axis, par)
    if span <= hw.devices_per_node:
        return hw.intra_node_gbps
    if not (hw.nic_per_device and event.op in RING_OPS):
        return hw.inter_node_gbps
    # the group's devices (`Event.group`, from the compiled replica groups) lie evenly
    # over the devices its axis spans
    in_node = max(1, hw.devices_per_node * event.group // span)
    return min(hw.intra_node_gbps, in_node * hw.inter_node_gbps)
