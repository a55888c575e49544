"""ZeRO in a resident plan: stages 1, 2 and 3 (`TrainConfig.zero`; Rajbhandari et al. 2020).

The microbatch is counted with the optimizer state whole on its tensor group; ZeRO
splits that state (the FP32 master weights with it) over `replica`, reduce-scatters the
gradients instead of all-reducing them (`resident_step._StepEvents.all_reduce`), and
each stage all-gathers its updated weights after its update
(`resident_step._StepEvents.after`); stage 2 holds only a replica's share of the
gradients; stage 3 gathers each layer's weights where it
is used and reduce-scatters its gradients every microbatch
(`resident_step._StepEvents.gathered`).
The resident engine runs the same layout for real (`resident/trainer.py`).
"""

from __future__ import annotations

import dataclasses

from shardemu.config import Parallelism
from shardemu.predict.resident_count import Microbatch
from shardemu.predict.weight_casts import WeightCasts, with_bytes


def zero(mb: Microbatch, stage: int, par: Parallelism) -> Microbatch:
    """`mb` under ZeRO stage `stage` (`TrainConfig.zero`) over `replica` (x `context`)
    (Rajbhandari et al. 2020, Table 1): stage 1 (P_os) splits the optimizer state, the
    FP32 master weights with it (K Psi / N_d of the 2 Psi + 2 Psi + K Psi),
    reduce-scatters the gradients and all-gathers the updated weights (Megatron-LM's
    distributed optimizer); stage 2 (P_os+g) also holds only each replica's share of the gradients
    (2 Psi / N_d of them: `resident_memory._stage_bytes`); stage 3 (P_os+g+p,
    FSDP) also splits the weights: the layers', gathered one layer ahead of their use
    (`resident_step._StepEvents.gathered`), and the shared weights (embedding, head),
    gathered for the slots that use them (`_StepEvents.shared_gather`)."""
    r = par.replica * par.context  # with context parallelism, over both (its devices
    # hold the same weights), as Megatron-Core's distributed optimizer shards over its
    # data- and context-parallel group; the resident engine does the same
    if not stage or r == 1:
        return mb
    opt = (round(mb.opt_bytes[0] / r), round(mb.opt_bytes[1] / r))
    return dataclasses.replace(mb, opt_bytes=opt, zero=r, zero_stage=stage)


def placed_casts(mb: Microbatch) -> Microbatch:
    """`mb` with its weights' FP8 casts (`weight_casts.py`) in its pieces: once a step,
    with the layer's update, where a device keeps the layer's weights from one
    microbatch to the next; every microbatch, in the forward and the backward that make
    them, under ZeRO stage 3, which gathers them for each microbatch and frees them."""
    casts, pieces = mb.casts, dict(mb.pieces)
    if casts.forward == casts.backward == (0, 0):  # not FP8, or a memory bound
        return mb
    if mb.zero_stage == 3:
        pieces["forward"] = with_bytes(pieces["forward"], casts.forward)
        pieces["backward"] = with_bytes(pieces["backward"], casts.backward)
    else:
        pieces["update0"] = with_bytes(pieces["update0"], casts.once)
    return dataclasses.replace(mb, pieces=pieces, casts=WeightCasts())
