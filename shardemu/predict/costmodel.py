"""From a ledger and a hardware profile to a timeline and a step time.

Each pipeline stage's devices have concurrent streams: `compute`, `h2d`, `d2h`, one
`collective:<axis>` per mesh axis (pipeline point-to-point transfers are
`collective:pipe`) and `host` (optimizer updates in the host tier). Events of one step
are placed in program order (the ledger's), each on its stream, after its stream's
previous event and after what it depends on:

- a computation waits for the transfers and collectives of its own phase recorded before
  it (the weights it fetched and gathered, the activations it received or restored), and
  for the collectives of the computation before it on its stage (they produce its input);
  the embedding's and the head's computations also wait for the shared weights' transfers
  to their stage;
- a transfer or collective waits for the last computation of its phase on its stage
  recorded before it (the gradients or activations it carries, or, for collectives read
  from a compiled piece, the piece itself: bulk-synchronous compute then exchange, the
  IPU's model, and how Megatron's tensor-parallel all-reduces sit on the critical path);
  but an all-gather of stored weights in a forward or backward (FSDP's, rts's) reads no
  computation's output and waits for its stream alone, so the next part's gather runs
  while this part computes (FSDP's prefetch);
- a point-to-point send between pipeline stages waits for the last computation on its
  stage (and that computation's collectives): the activations or gradients it carries;
  with `Overlap.pipe_sends="blocking"` the sender's next computation also waits for it
  (its duration: the whole send, or Megatron-LM's scatter/gather with
  `Overlap.pipe_scatter_gather`, `durations.pipe_send_seconds`);
- a data-parallel gradient reduction (a collective carrying gradients over any axis but
  `pipe`) is the input of no computation but the optimizer update, so the backward
  computations after it do not wait for it: how a bucketed reduction hides behind the
  backward pass (`overlap.py`);
- a host-to-device transfer also waits for the end of the last computation on its stage
  recorded before it: the device tier holds one phase ahead, so the next phase's weights
  stream in while this phase computes (the prefetch that hides streaming);
- the optimizer update waits for every gradient to reach the host (clipping needs the
  global norm).

Weight streaming's SwarmX `broadcast` and `reduce` events have streams of their own and
the dependencies of a host-to-device transfer and of gradients leaving, respectively.

Durations: each event's on the profile (`durations.py`).

The step time is when the last event ends. Its breakdown is measured on the stage whose
compute is busiest: compute, and the rest of the step split by what that stage was
waiting for: transfers (exposed streaming), collectives (exposed communication), the
host update, or nothing of its own (another stage: the pipeline bubble).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from shardemu.accounting.assemble import AssembledLedger
from shardemu.accounting.ledger import Event, Phase
from shardemu.config import Parallelism
from shardemu.predict.durations import duration, is_pipe_send, pipe_send_seconds, stream_of
from shardemu.predict.hardware import Hardware
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap, exposed_chunked
from shardemu.predict.placing import placing_order
from shardemu.predict.roofline import projection_seconds

BREAKDOWN = (
    "compute_s",
    "exposed_transfer_s",
    "exposed_communication_s",
    "host_update_s",
    "pipeline_bubble_s",
)
# exposed-time categories, by the stream that keeps the stage busy, in priority order
_EXPOSED = (
    ("h2d", "exposed_transfer_s"),
    ("d2h", "exposed_transfer_s"),
    ("broadcast", "exposed_transfer_s"),
    ("reduce", "exposed_transfer_s"),
    ("collective", "exposed_communication_s"),
    ("host", "host_update_s"),
)

# computations that use the shared weights (embedding, head)
_READS_SHARED = ("embed", "head", "embed-backward", "shared-backward")
_GATHERED = ("forward", "backward")  # phases whose weights are gathered as stored


class Span(NamedTuple):
    """One event placed on the timeline (seconds from the start of the step). A tuple:
    a search makes millions."""

    index: int
    stage: int
    stream: str
    phase: Phase
    start: float
    end: float
    event: Event

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    spans: list[Span]
    step_time_s: float
    breakdown: dict[str, float] = field(default_factory=dict)
    critical_stage: int = 0

    def stream_totals(self) -> dict[tuple[int, str], float]:
        """Busy seconds per (stage, stream)."""
        totals: dict[tuple[int, str], float] = defaultdict(float)
        for s in self.spans:
            totals[(s.stage, s.stream)] += s.duration
        return dict(totals)


def build_timeline(
    events: Sequence[Event] | AssembledLedger,
    hw: Hardware,
    par: Parallelism,
    overlap: Overlap = DEFAULT_OVERLAP,
) -> Timeline:
    """Place one step's events (program order) on per-stage streams; see the module
    docstring for the dependency rules. Each rule waits for the latest end among the
    spans it names, so only that end is kept (a search places millions of events).
    An assembled step (`AssembledLedger`) is timed from its slots' counted events as
    they are, each set to its slot's microbatch and stage here rather than copied
    (`Event.placed`); its spans hold those events, and the span its phase and stage."""
    spans: list[Span] = []
    _place(events, hw, par, overlap, spans)
    return _timeline_of(spans)


def step_seconds(
    events: Sequence[Event] | AssembledLedger,
    hw: Hardware,
    par: Parallelism,
    overlap: Overlap = DEFAULT_OVERLAP,
) -> float:
    """`build_timeline(...).step_time_s`, no span kept: a prediction's band times four
    more steps for their step times alone (`band.py`)."""
    return _place(events, hw, par, overlap, None)


def _place(
    events: Sequence[Event] | AssembledLedger,
    hw: Hardware,
    par: Parallelism,
    overlap: Overlap,
    spans: list[Span] | None,
) -> float:
    """`build_timeline`'s placing, each span appended to `spans` (None: none kept);
    the step's end. What does not depend on `hw` is looked up once per step
    (`placing_order`); here each event's stream, phase and stage are list indices."""
    order = placing_order(events)
    rules = [rules_of(e, hw, par, overlap) for e in order.origins]
    stream_free = [0.0] * order.streams
    last_compute = [0.0] * order.phase_stages  # (phase, stage) -> latest compute's end
    phase_inputs = [0.0] * order.phases  # non-compute spans, by phase
    last_compute_on_stage = [0.0] * order.stages
    pending = [0.0] * order.stages  # collectives since a stage's compute
    reductions = [0.0] * order.stages  # gradient reductions, per stage
    shared_in = [0.0] * order.stages  # the shared weights, per stage
    gradients_out = 0.0
    chunked = overlap.tp_overlap == "chunked"
    chunking = _Chunking(order.origins, rules, hw, overlap) if chunked else None
    for stream, pair, phase, on, o, e, at in order.items:
        r = rules[o]
        seconds = r.seconds
        if chunking is not None and chunking.chunked[o]:
            seconds = chunking.seconds(o, on, seconds)
        ready = stream_free[stream]
        if r.compute:
            ready = max(ready, phase_inputs[phase], pending[on])
            pending[on] = 0.0  # (every end is >= 0: a wait on 0.0 is none)
            if r.update:
                ready = max(ready, reductions[on])
                reductions[on] = 0.0
            if r.reads_shared:
                ready = max(ready, shared_in[on])
        else:
            if r.after_compute:
                ready = max(ready, last_compute[pair])
            if r.after_stage:
                # after the stage's last computation; a pipe send also after that
                # computation's collectives (what it carries)
                produced = pending[on] if r.pipe else 0.0
                ready = max(ready, last_compute_on_stage[on], produced)
        if r.update:
            ready = max(ready, gradients_out)
        end = ready + seconds
        if spans is not None:
            spans.append(Span(len(spans), on, r.stream, at, ready, end, e))
        stream_free[stream] = end
        if r.compute:
            last_compute[pair] = end
            if r.on_device:
                last_compute_on_stage[on] = end
        elif r.reduction:
            reductions[on] = max(reductions[on], end)
        else:
            phase_inputs[phase] = max(phase_inputs[phase], end)
            if r.shared:
                shared_in[on] = max(shared_in[on], end)
        if r.holds:
            pending[on] = max(pending[on], end)
        if r.gradients_out:
            gradients_out = max(gradients_out, end)
    return max(stream_free, default=0.0)


def _timeline_of(spans: list[Span]) -> Timeline:
    """The timeline of a step's placed spans: its step time (the last end), critical
    stage and that stage's breakdown."""
    step = max((s.end for s in spans), default=0.0)
    timeline = Timeline(spans, step)
    timeline.critical_stage, timeline.breakdown = _breakdown(spans, step)
    return timeline


class EventRules(NamedTuple):
    """What placing an event depends on, read off it once for every copy of it
    (`Event.placed`) a timeline places: its stream and seconds, and which of the
    module docstring's waits and records apply to it."""

    stream: str
    seconds: float
    compute: bool
    on_device: bool  # a computation on the device (not the host's)
    update: bool  # in an optimizer update
    reads_shared: bool  # a computation that reads the shared weights
    shared: bool  # brings the shared weights in
    reduction: bool  # a data-parallel reduction of gradients
    after_compute: bool  # waits for its phase's computation on its stage
    after_stage: bool  # waits for its stage's last computation (h2d, broadcast, pipe)
    pipe: bool  # a send over `pipe`
    holds: bool  # the stage's next computation waits for it (a collective it carries)
    gradients_out: bool  # the gradients leaving for the host (the update waits)


def rules_of(e: Event, hw: Hardware, par: Parallelism, overlap: Overlap) -> EventRules:
    """`e`'s `EventRules` on `hw` with `overlap`'s pipe sends (blocking: they hold the
    sender's next computation; scatter/gather: their duration)."""
    collective, pipe = e.kind == "collective", e.axis == "pipe"
    reduction = collective and not pipe and e.carries == "gradients"
    blocking = overlap.pipe_sends == "blocking"
    scattered = overlap.pipe_scatter_gather and is_pipe_send(e)
    return EventRules(
        stream=stream_of(e),
        seconds=pipe_send_seconds(e, hw, par) if scattered else duration(e, hw, par),
        compute=e.kind == "compute",
        on_device=e.on == "device",
        update=e.phase.kind == "update",
        reads_shared=e.phase.kind in _READS_SHARED,
        shared=e.phase.kind == "shared",
        reduction=reduction,
        after_compute=not _reads_stored_weights(e),
        after_stage=e.kind in ("h2d", "broadcast") or pipe,
        pipe=pipe,
        holds=collective and not reduction and (not pipe or blocking),
        gradients_out=e.kind in ("d2h", "reduce") and e.carries == "gradients",
    )


def _reads_stored_weights(e: Event) -> bool:
    """An all-gather of weights as they are stored (FSDP's, rts's) in a forward or
    backward: it reads no computation's output, so it waits for its stream alone and
    runs while the computation before it does (the prefetch). The all-gather after an
    update carries what the update computed."""
    return e.op == "all-gather" and e.carries == "weights" and e.phase.kind in _GATHERED


class _Chunking:
    """Seconds under `tp_overlap="chunked"` (`overlap.py`), in program order: a device
    computation sets its stage's matmul time to hide behind; each of its hidden
    collectives, in order, takes what is left of it. What an event's origin decides
    (its projection's seconds, whether it is hidden, its group) is read once."""

    def __init__(
        self, origins: Sequence[Event], rules: list[EventRules], hw: Hardware, overlap: Overlap
    ) -> None:
        self.origins = origins
        self.hiding: dict[int, float] = {}  # per stage: matmul seconds left to hide behind
        device = [r.compute and r.on_device for r in rules]
        # by origin: a device computation's projection seconds (else 0), and whether its
        # seconds pass through `seconds` (a device computation, or a collective `overlap`
        # hides)
        self.projections = [
            projection_seconds(e, hw) if d else 0.0 for e, d in zip(origins, device, strict=True)
        ]
        self.chunked = [d or overlap.hides(e) for e, d in zip(origins, device, strict=True)]

    def seconds(self, o: int, stage: int, seconds: float) -> float:
        """The seconds on `stage` of an event placed from origin `o`, `seconds` without
        the overlap."""
        e = self.origins[o]
        if e.kind == "compute":
            self.hiding[stage] = self.projections[o]
            return seconds
        budget = self.hiding.get(stage, 0.0)
        exposed = exposed_chunked(seconds, budget, e.group)
        left = budget - (seconds - exposed) * e.group / max(e.group - 1, 1)
        self.hiding[stage] = max(0.0, left)
        return exposed


def compute_busy(spans: list[Span]) -> dict[int, float]:
    """Compute seconds per stage, stages in the order they first compute."""
    busy: dict[int, float] = defaultdict(float)
    for s in spans:
        if s.stream == "compute":
            busy[s.stage] += s.duration
    return busy


def _breakdown(spans: list[Span], step: float) -> tuple[int, dict[str, float]]:
    """The busiest stage, and its `stage_breakdown`."""
    busy = compute_busy(spans)
    stage = max(busy, key=busy.get, default=0)
    return stage, stage_breakdown(spans, step, stage, busy.get(stage, 0.0))


def stage_breakdown(
    spans: list[Span], step: float, stage: int, compute_s: float
) -> dict[str, float]:
    """A stage's compute time, and its idle time by what it waited for: a sweep over
    the stage's span boundaries with a count of active spans per kind."""
    out = dict.fromkeys(BREAKDOWN, 0.0)
    out["compute_s"] = compute_s
    edges: list[tuple[float, int, str]] = [(0.0, 0, ""), (step, 0, "")]
    for s in spans:
        if s.stage == stage and s.duration > 0:
            kind = s.stream.split(":")[0]
            edges += [(s.start, 1, kind), (s.end, -1, kind)]
    edges.sort(key=lambda e: (e[0], e[1]))  # ends before starts at the same time
    active: dict[str, int] = defaultdict(int)
    for (t, delta, kind), (t_next, _, _) in zip(edges, edges[1:], strict=False):
        if kind:
            active[kind] += delta
        if t_next <= t or active["compute"] > 0:
            continue
        key = next((k for prefix, k in _EXPOSED if active[prefix] > 0), "pipeline_bubble_s")
        out[key] += t_next - t
    return out
