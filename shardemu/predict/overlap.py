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
- `pipe_sends`: whether a stage waits for its point-to-point send to finish before it
  computes again. `async` (default): the send overlaps the sender's next computation,
  and only the receiver waits for it (non-blocking isend/irecv, Megatron-Core's
  `overlap_p2p_comm`). `blocking`: the sender waits too, as Megatron-LM's 2021
  `p2p_communication._communicate` did (`batch_isend_irecv`, then `wait()` on every
  request before returning).
- Tensor-parallel collectives are always exposed: each all-reduce produces the input of
  the next computation (Shoeybi et al. 2019, "Megatron-LM", §3: the f and g operators sit
  on the critical path), and the IPU is bulk-synchronous (compute, then exchange). This
  is not an option: hiding them needs kernels that split a matmul around its
  communication, which no counted piece here has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardemu.config.checks import require_choice, require_finite
from shardemu.config.flags import choices_of, setting

GradReduce = Literal["bucketed", "end"]
PipeSends = Literal["async", "blocking"]
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
    pipe_sends: PipeSends = setting(
        "async", "--pipe-sends", "pipeline sends overlap the sender's next computation, or block it"
    )

    def __post_init__(self) -> None:
        require_choice(self, "grad_reduce", GradReduce)
        require_choice(self, "pipe_sends", PipeSends)
        require_finite("Overlap", True, bucket_mb=self.bucket_mb)

    def buckets(self, grad_bytes_per_device: float) -> int:
        """How many buckets a chunk's gradients of `grad_bytes_per_device` fill."""
        full = -(-grad_bytes_per_device // (self.bucket_mb * 2**20))
        return int(min(max(full, 1), MAX_BUCKETS))

    def to_json(self) -> dict[str, object]:
        return {
            "grad_reduce": self.grad_reduce,
            "bucket_mb": self.bucket_mb,
            "pipe_sends": self.pipe_sends,
        }


DEFAULT_OVERLAP = Overlap()
