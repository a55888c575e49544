"""ZeRO in a resident plan: stage 1 (`TrainConfig.zero`; Rajbhandari et al. 2020, P_os).

The microbatch is counted with the optimizer state whole on its tensor group; ZeRO
splits that state (the FP32 master weights with it) over `replica`, and each stage
all-gathers its updated weights after its update (`plan_resident._StepEvents.after`).
The resident engine runs the same layout for real (`resident/trainer.py`).
"""

from __future__ import annotations

import dataclasses

from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.predict.resident_count import Microbatch


def require_planned_stage(train: TrainConfig) -> None:
    """Plans model ZeRO stage 1; stages 2 and 3 run for real but are refused here."""
    if train.zero > 1:
        raise ConfigError(
            f"TrainConfig.zero={train.zero}: plans model ZeRO stage 1 only; stages 2 and 3 "
            f"run on the resident engine (their ledgers count the reduce-scatters and "
            f"all-gathers), but are not planned yet"
        )


def zero(mb: Microbatch, train: TrainConfig, par: Parallelism) -> Microbatch:
    """`mb` under ZeRO stage 1 (`TrainConfig.zero`): the optimizer state, the FP32
    master weights with it, split over `replica` (Rajbhandari et al. 2020, P_os: K Psi /
    N_d of the 2 Psi + 2 Psi + K Psi), and its updated weights all-gathered."""
    if not train.zero or par.replica == 1:
        return mb
    r = par.replica
    opt = (round(mb.opt_bytes[0] / r), round(mb.opt_bytes[1] / r))
    return dataclasses.replace(mb, opt_bytes=opt, zero=r)
