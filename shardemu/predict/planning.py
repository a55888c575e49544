"""One entry point for planning a step from shapes alone: `plan` hands a layout to the
planner it needs (`plan_resident` for a resident, pipelined step; `plan_phased` with a
`PhasedConfig`) and returns their one `Plan`. The command line's `shardemu plan`, the
search and a Python caller plan through it alike.
"""

from __future__ import annotations

from typing import Literal

from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.models import Model, as_model
from shardemu.parallel.rules import Rules
from shardemu.pipelined.layout import refuse_phased
from shardemu.predict.hardware import Hardware
from shardemu.predict.layouts import Recompute
from shardemu.predict.overlap import DEFAULT_OVERLAP, Overlap
from shardemu.predict.plan import Plan
from shardemu.predict.plan_phased import plan_devices, plan_phased
from shardemu.predict.plan_resident import plan_resident, plan_resident_auto


def plan(
    model: Model | ModelConfig,
    par: Parallelism,
    train: TrainConfig,
    hardware: Hardware | None = None,
    *,
    phased: PhasedConfig | None = None,
    microbatch_size: int | Literal["auto"] | None = None,
    recompute: Recompute = "full",
    attention: str = "materialized",
    overlap: Overlap = DEFAULT_OVERLAP,
    rules: Rules | None = None,
    must_fit: bool = False,
    band: bool = True,
) -> Plan:
    """Plan one training step of `model` (a `Model`, your own family's included, or a
    registered family's config) on `par` with `train`'s settings (batch, sequence,
    schedule, precision, sparsity, stage layers), timed on `hardware`, its parameters
    and activations sharded by `rules` (Megatron-LM's by default).

    Without `phased`: a resident step (`plan_resident`: `recompute` and `attention`
    apply; needs `hardware`). With `phased`: a phased or weight-streaming step
    (`plan_phased`: its activations policy replaces `recompute`). `microbatch_size`
    None on a pipeline (pipe > 1) with hardware, or "auto", plans each candidate size
    and keeps the fastest that fits (one microbatch would leave (p-1)/p of a p-stage
    pipeline idle); None otherwise is the whole batch per replica, and on one resident
    stage whose whole batch does not fit, the fastest smaller microbatch that does (the
    whole batch, when it fits, is the fastest: no bubble, the fewest kernels). With
    `must_fit`, a step over a memory tier raises `CapacityError`. With `band` False the
    prediction holds no band (`band.py`: two to four more timelines a step, which a
    search, ranking by the step alone, does not read). Needs JAX devices for
    one stage (`plan_phased.plan_devices`) or one tensor group."""
    model = as_model(model)
    model.check_rules(rules)
    auto = microbatch_size == "auto" or (
        microbatch_size is None and par.pipe > 1 and hardware is not None
    )
    if phased is not None:
        if recompute != "full" or attention != "materialized":
            raise ConfigError(
                f"recompute={recompute!r} and attention={attention!r} set a resident plan; "
                f"a phased plan keeps, offloads or recomputes activations as "
                f"PhasedConfig.activations says ({phased.activations!r})"
            )
        refuse_phased(train)
        return plan_phased(
            model,
            par,
            train,
            phased,
            rules=rules,
            hardware=hardware,
            microbatch_size="auto" if auto else microbatch_size,
            overlap=overlap,
            must_fit=must_fit,
            band=band,
        )
    if hardware is None:
        raise ConfigError(
            "a resident plan is timed on a hardware profile: give `hardware` "
            "(shardemu.get_hardware(NAME))"
        )
    settings = {
        "rules": rules,
        "recompute": recompute,
        "attention": attention,
        "overlap": overlap,
        "must_fit": must_fit,
        "band": band,
    }
    if auto:
        return plan_resident_auto(model, par, train, hardware, **settings)
    size = microbatch_size if microbatch_size is not None else train.batch // par.data
    whole = plan_resident(model, par, train, size, hardware, **settings)
    if microbatch_size is None and not whole.fits:  # one stage: smaller microbatches
        return plan_resident_auto(model, par, train, hardware, **settings)  # may fit
    return whole


def plan_devices_needed(par: Parallelism, phased: bool) -> int:
    """The JAX devices a plan of `par` counts on: a phased stage (`plan_devices`), or a
    resident stage's context x tensor group (`plan_resident`)."""
    return plan_devices(par) if phased else par.context * par.tensor
