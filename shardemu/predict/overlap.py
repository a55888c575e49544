"""How a step's communication overlaps its computation: the plan options that say so.

Real training systems differ here, and a step time depends on it, so each choice is an
option of `plan` (and of `search`), with the default a modern system uses:

- `grad_reduce` (resident plans): when the data-parallel gradient all-reduce runs.
  `bucketed` (default) reduces the gradients in buckets of `bucket_mb` megabytes while the
  backward pass of the last microbatch is still producing the rest, as PyTorch's
  DistributedDataParallel does (Li et al. 2020, "PyTorch Distributed", VLDB, §3.2.3;
  `bucket_cap_mb` defaults to 25) and Megatron-LM with `--overlap-grad-reduce`
  (Megatron-Core's `DistributedDataParallelConfig.overlap_grad_reduce`). A pipeline's
  gradients are complete only after their last microbatch's backward, so that is the
  only backward a reduction can hide behind. `end` reduces all of a stage's gradients
  after its last backward: Megatron-LM as Narayanan et al. 2021 ran it
  (`megatron/training.py::train_step` calls `allreduce_gradients()` after
  `forward_backward_func`). Phased plans reduce each phase's gradients after that phase
  either way: the phases are the buckets.
- `grad_reduce_in_fp32` (resident plans): the data-parallel gradient reductions (the
  all-reduce, or under ZeRO the reduce-scatter) carry FP32 gradients whatever the
  compute precision: TorchTitan's FSDP2 (`MixedPrecisionPolicy(reduce_dtype=float32)`
  from `training.mixed_precision_reduce`, "float32" by default: pytorch/torchtitan,
  `torchtitan/config/job_config.py`) and Megatron-LM with BF16, which accumulates and
  all-reduces its gradients in FP32 (`--accumulate-allreduce-grads-in-fp32`, forced on
  with `--bf16`: `megatron/training/arguments.py`). Off (default), they carry the
  gradients' own dtype, as shardemu's engines reduce them. It changes the bytes
  reduced, and under ZeRO stage 3 the reduce-scatter's input a plan holds in the
  backward (`resident_memory._reduce_scatter`), not the gradients it keeps.
- `pipe_sends`: whether a stage waits for its point-to-point send to finish before it
  computes again. `async` (default): the send overlaps the sender's next computation,
  and only the receiver waits for it (non-blocking isend/irecv, Megatron-Core's
  `overlap_p2p_comm`). `blocking`: the sender waits too, as Megatron-LM's 2021
  `p2p_communication._communicate` did (`batch_isend_irecv`, then `wait()` on every
  request before returning).
- `pipe_scatter_gather`: whether a send of what every tensor rank of a stage holds (the
  activation between stages, replicated over `tensor` unless sequence parallelism
  splits it: `Event.copies`) goes whole from each rank (default, as XLA sends it and
  as Megatron-Core does, whose sends are sequence-parallel or whole) or as Megatron-LM's
  scatter/gather (Narayanan et al. 2021, SC21, §4.1): each of the t ranks sends 1/t of
  it over its own link, and the receiving stage all-gathers the pieces over `tensor`
  (NVLink) before it computes. Megatron-LM had it on by default
  (`--no-scatter-gather-tensors-in-pipeline` turned it off; `p2p_communication.
  _communicate` splits with `split_tensor_into_1d_equal_chunks`, waits for the
  requests, then `gather_split_1d_tensor`), and off where `--sequence-parallel` already
  splits the tensor (2022); Megatron-Core's p2p dropped it. A send then takes S/t over
  the pipe link and the all-gather's (t-1)/t S over the tensor group's, in turn
  (`durations.pipe_send_seconds`).
- `tp_overlap` (resident plans): `none` (default, as Megatron-Core's
  `tp_comm_overlap=False`): each tensor-parallel collective produces the input of the
  next computation (Shoeybi et al. 2019, "Megatron-LM", §3: the f and g operators sit on
  the critical path), as on the bulk-synchronous IPU. `chunked`: Megatron-Core's
  `--tp-comm-overlap` with Transformer Engine's userbuffers (Wang et al. 2022, "Overlap
  Communication with Dependent Computation via Decomposition", ASPLOS '23): a
  sequence-parallel layer's all-gather before a column-parallel matmul, and its
  reduce-scatter after a row-parallel one, split into `tensor` chunks moved around the
  ring while the matmul computes the chunk already there. For a collective of C seconds
  over n devices beside matmuls of G seconds: n-1 steps of C/(n-1) against n matmul
  chunks of G/n, so max(n G/n, (n-1) C/(n-1) + G/n) in all and
  `exposed_chunked(C, G, n)` = max(0, C - G (n-1)/n) exposed. G is the matmul time of
  the piece the collective belongs to (its projections; the attention core is not split
  this way), shared by the piece's collectives in program order. It needs sequence
  parallelism (Megatron-Core refuses `--tp-comm-overlap` without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardemu.accounting.ledger import Event
from shardemu.config.checks import require_choice, require_finite
from shardemu.config.flags import choices_of, setting

GradReduce = Literal["bucketed", "end"]
PipeSends = Literal["async", "blocking"]
TpOverlap = Literal["none", "chunked"]
GRAD_REDUCE = choices_of(GradReduce)
PIPE_SENDS = choices_of(PipeSends)
# At most this many buckets per pipeline chunk: the exposed tail of a bucketed reduction
# is one bucket, so beyond this the prediction changes by under 1/64 of the chunk's
# reduction while the step's events keep growing.
MAX_BUCKETS = 64


@dataclass(frozen=True)
class Overlap:
    grad_reduce: GradReduce = setting(
        "bucketed",
        "--grad-reduce",
        "resident plans: all-reduce gradients in buckets during the last backward "
        "(PyTorch DDP, Megatron --overlap-grad-reduce) or all at the end (Megatron-LM 2021)",
    )
    bucket_mb: float = setting(
        25.0,
        "--bucket-mb",
        "gradient bucket size in MiB for --grad-reduce bucketed (DDP's bucket_cap_mb)",
    )
    grad_reduce_in_fp32: bool = setting(
        False,
        "--grad-reduce-in-fp32",
        "resident plans: reduce the data-parallel gradients in FP32 whatever the precision "
        "(TorchTitan's FSDP2 default, Megatron-LM with bf16); default: in their own dtype",
    )
    pipe_sends: PipeSends = setting(
        "async", "--pipe-sends", "pipeline sends overlap the sender's next computation, or block it"
    )
    pipe_scatter_gather: bool = setting(
        False,
        "--pipe-scatter-gather",
        "each tensor rank sends 1/tensor of a stage's replicated activation and the next "
        "stage all-gathers it over tensor (Megatron-LM's scatter/gather, Narayanan et al. "
        "2021 §4.1); default: each rank sends it whole",
    )
    tp_overlap: TpOverlap = setting(
        "none",
        "--tp-overlap",
        "resident plans with --sequence-parallel: hide tensor all-gathers and reduce-scatters "
        "behind their matmuls in chunks (Megatron-Core --tp-comm-overlap), or not",
    )

    def __post_init__(self) -> None:
        require_choice(self, "grad_reduce", GradReduce)
        require_choice(self, "pipe_sends", PipeSends)
        require_choice(self, "pipe_scatter_gather", Literal[False, True])
        require_choice(self, "grad_reduce_in_fp32", Literal[False, True])
        require_choice(self, "tp_overlap", TpOverlap)
        require_finite("Overlap", True, bucket_mb=self.bucket_mb)

    def reduce_itemsize(self, gradient_itemsize: int) -> int:
        """Bytes an element of the data-parallel gradient reduction takes: FP32's 4
        under `grad_reduce_in_fp32`, else the gradients' own `gradient_itemsize`."""
        return 4 if self.grad_reduce_in_fp32 else gradient_itemsize

    def buckets(self, grad_bytes_per_device: float) -> int:
        """How many buckets a chunk's gradients of `grad_bytes_per_device` fill."""
        full = -(-grad_bytes_per_device // (self.bucket_mb * 2**20))
        return int(min(max(full, 1), MAX_BUCKETS))

    def to_json(self) -> dict[str, object]:
        return {
            "grad_reduce": self.grad_reduce,
            "bucket_mb": self.bucket_mb,
            "grad_reduce_in_fp32": self.grad_reduce_in_fp32,
            "pipe_sends": self.pipe_sends,
            "pipe_scatter_gather": self.pipe_scatter_gather,
            "tp_overlap": self.tp_overlap,
        }

    def hides(self, event: Event) -> bool:
        """Whether `tp_overlap` hides `event` behind its piece's matmuls: a
        sequence-parallel layer's all-gather or reduce-scatter over `tensor`."""
        return (
            self.tp_overlap == "chunked"
            and event.kind == "collective"
            and event.axis == "tensor"
            and event.op in ("all-gather", "reduce-scatter")
            and event.carries != "gradients"  # a piece's own, not a data-parallel reduction
        )


def exposed_chunked(comm_s: float, matmul_s: float, n: int) -> float:
    """Seconds of a collective of `comm_s` over `n` devices left exposed when it is
    split into chunks behind matmuls of `matmul_s` (module docstring): max(0, C - G
    (n-1)/n)."""
    return max(0.0, comm_s - matmul_s * (n - 1) / n)


DEFAULT_OVERLAP = Overlap()
