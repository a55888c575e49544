"""The ledger: every transfer, collective and phase computation of a run, as events.

An event records where it happened (step, a typed `Phase`, the pipeline `stage`), what
it was (`kind`: h2d, d2h, collective, compute, or weight streaming's SwarmX `broadcast`
and `reduce` over the `swarmx` link), what it carried (weights, gradients,
activations, optimizer_state), over which mesh axis, on how many devices, and its bytes
(summed over those devices) and FLOPs (summed over those devices). A collective also
names its `op` and `group` size, and its bytes are those its devices send
(`collectives.py`); a broadcast's or reduce's bytes are what each link of the SwarmX tree
carries (one copy; `devices` is the number of systems); a compute event names the tier
it ran in (`on`) and how many of its FLOPs recompute a forward pass (`recompute_flops`).
Per-step totals are what `metrics.jsonl` reports; the event list is what `ledger.json`
holds (`ledger_file.py`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple

Kind = Literal["h2d", "d2h", "collective", "compute", "broadcast", "reduce"]
Carries = Literal["weights", "gradients", "activations", "optimizer_state", ""]
Where = Literal["device", "host"]
PhaseKind = Literal[
    "shared",
    "embed",
    "forward",
    "head",
    "backward",
    "embed-backward",
    "shared-backward",
    "update",
    "step",
]
Part = Literal["once", "F", "B", "update"]

_PART: dict[str, Part] = {
    "shared": "once",
    "embed": "F",
    "forward": "F",
    "head": "F",
    "backward": "B",
    "embed-backward": "B",
    "shared-backward": "B",
    "update": "update",
    "step": "once",
}
_SHORT = {
    "forward": "fwd",
    "backward": "bwd",
    "embed-backward": "bwd-embed",
    "shared-backward": "bwd-shared",
}


@dataclass(frozen=True)
class Phase:
    """Where in a step an event belongs: a value, never a string to parse back.

    kind    what the step was doing: fetching the shared weights (`shared`), the
            embedding, a forward phase of layers, the head and loss, a backward phase,
            the embedding's and the shared weights' backward, an optimizer update, or
            (`step`) a resident step's whole forward and backward pass
    index   which phase of layers (forward, backward, update); None for the shared
            pieces (an update of the shared weights has no index)
    layers  the [start, end) layers it covers, where it covers layers
    micro   the microbatch (or pass) of a pipelined step; None outside pipelines
    """

    kind: PhaseKind
    index: int | None = None
    layers: tuple[int, int] | None = None
    micro: int | None = None

    @property
    def part(self) -> Part:
        """Where a pipeline schedule puts it: once per step, in a forward (F) or
        backward (B) slot, or in the updates at the end."""
        return _PART[self.kind]

    def at(self, micro: int) -> Phase:
        """The same phase for microbatch `micro`, made once per microbatch and kept on
        this phase (outside its fields): a search places millions of events."""
        made = self.__dict__.get("_at")
        if made is None:
            made = self.__dict__["_at"] = {}
        phase = made.get(micro)
        if phase is None:  # not `dataclasses.replace`, which reads the fields each call
            phase = made[micro] = Phase(self.kind, self.index, self.layers, micro)
        return phase

    def __hash__(self) -> int:
        """The fields' hash, kept on the phase once made (a timeline keys its waits
        by phase, millions of times a search)."""
        known = self.__dict__.get("_hash")
        if known is None:
            known = self.__dict__["_hash"] = hash((self.kind, self.index, self.layers, self.micro))
        return known

    def __str__(self) -> str:
        """The readable name: fwd3, bwd-embed, update-shared, fwd@5 (microbatch 5)."""
        name = _SHORT.get(self.kind, self.kind)
        if self.index is not None:
            name += str(self.index)
        elif self.kind == "update":
            name += "-shared"
        return name if self.micro is None else f"{name}@{self.micro}"


class Matmul(NamedTuple):
    """One matmul kernel per device and run of its compiled piece (`matmuls.py`): its
    FLOPs, the bytes of its operands and output, whether both operands are FP8, whether
    it is an attention core's batched product (its [s, s] scores), the share of its
    FLOPs the target's kernel computes (a causal fused attention core skips the blocks
    above the diagonal: `flops.causal_fraction`), and whether a fused attention kernel
    (FlashAttention) computes it, at its own rate (`Hardware.attention_efficiency`)."""

    flops: float
    bytes: int
    fp8: bool = False
    attention: bool = False
    share: float = 1.0
    fused: bool = False


@dataclass(frozen=True)
class Event:
    step: int
    phase: Phase
    kind: Kind
    carries: Carries
    bytes: int = 0
    flops: float = 0.0
    axis: str | None = None
    devices: int = 1
    op: str = ""
    group: int = 1
    on: Where = "device"
    recompute_flops: float = 0.0
    stage: int = 0  # the pipeline stage whose devices did it (the sender, for a p2p)
    # a device computation's roofline (`predict/roofline.py`), per device and per run of
    # its compiled piece: the piece's FLOPs, its matmuls and the bytes its other kernels
    # move; `flops / devices / run_flops` runs
    run_flops: float = 0.0
    matmuls: tuple[Matmul, ...] = ()
    memory_bytes: int = 0
    # the same kernels' bytes fused as an accelerator fuses them (`fusion.py`)
    fused_memory_bytes: int = 0
    # a send over `pipe`: how many of the sending stage's devices hold each byte it
    # carries (`sizes.copies`: an activation replicated over `tensor`, tensor), which
    # Megatron-LM's scatter/gather sends a 1/copies share of from each
    # (`Overlap.pipe_scatter_gather`)
    copies: int = 1

    def replaced(self, **changes: Any) -> Event:
        """`dataclasses.replace(self, **changes)` (its fields alone, not what `placed`
        keeps beside them) without re-running `__init__`: 1.9 us a copy against 5.1, and
        a search scales 200k pieces into chunks."""
        event = object.__new__(Event)
        own = self.__dict__
        event.__dict__.update({f: own[f] for f in _EVENT_FIELDS}, **changes)
        return event

    def placed(self, micro: int, stage: int) -> Event:
        """This event for microbatch `micro` on pipeline stage `stage`. A plain copy of
        the fields: `dataclasses.replace` re-runs `__init__`, and a GPT-3 step on an
        IPU-POD places 750k events. The copy keeps the event it was placed from as
        `_origin` (outside its fields): the same work and duration on another microbatch
        or stage, which a timeline times once (`costmodel.build_timeline`)."""
        event = object.__new__(Event)
        event.__dict__.update(self.__dict__, phase=self.phase.at(micro), stage=stage)
        event.__dict__.setdefault("_origin", self)
        return event


_EVENT_FIELDS = tuple(f.name for f in fields(Event))


def totals(events: Iterable[Event]) -> dict[str, Any]:
    """The metrics of a step's events: `flops` (executed), `model_flops` (forward and
    backward without recomputation or the optimizer, as in model FLOPs utilisation:
    Chowdhery et al. 2022, "PaLM", Appendix B), `bytes_h2d`, `bytes_d2h`,
    `bytes_h2d_weights`, `bytes_d2h_gradients`, `bytes_collective` by mesh axis, and for
    weight streaming `bytes_broadcast` and `bytes_reduce` (per SwarmX link)."""
    out: dict[str, Any] = {
        "flops": 0.0,
        "model_flops": 0.0,
        "bytes_h2d": 0,
        "bytes_d2h": 0,
        "bytes_h2d_weights": 0,
        "bytes_d2h_gradients": 0,
    }
    collective: dict[str, int] = defaultdict(int)
    for e in events:
        out["flops"] += e.flops
        if e.kind == "compute" and e.carries != "optimizer_state":
            out["model_flops"] += e.flops - e.recompute_flops
        if e.kind in ("h2d", "d2h"):
            out[f"bytes_{e.kind}"] += e.bytes
        if e.kind == "h2d" and e.carries == "weights":
            out["bytes_h2d_weights"] += e.bytes
        if e.kind == "d2h" and e.carries == "gradients":
            out["bytes_d2h_gradients"] += e.bytes
        if e.kind == "collective":
            collective[e.axis or "?"] += e.bytes
        if e.kind in ("broadcast", "reduce"):
            out[f"bytes_{e.kind}"] = out.get(f"bytes_{e.kind}", 0) + e.bytes
    out["bytes_collective"] = dict(collective)
    return out


class Ledger:
    def __init__(self, events: Iterable[Event] = ()) -> None:
        self.events: list[Event] = list(events)

    def record(self, event: Event) -> None:
        self.events.append(event)

    def step(self, step: int) -> list[Event]:
        """The events of one step, in program order."""
        return [e for e in self.events if e.step == step]

    def step_totals(self, step: int) -> dict[str, Any]:
        """`totals` of one step's events."""
        return totals(self.step(step))
