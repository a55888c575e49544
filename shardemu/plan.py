"""Abstract mode: a phased training step counted on a mesh of any size, nothing allocated.

The same `PhasedTrainer` that trains for real runs one step on `ShapeDtypeStruct`s
(`phased/executor.py`): weights, optimizer state and batch are shapes with shardings,
transfers and the device tiers' bookkeeping happen on shapes, and only one layer of each
distinct piece is compiled (its counts are reused for every identical layer and every
identical pipeline stage). So GPT-3 175B on 256 virtual devices is planned on a laptop.
"""

from __future__ import annotations

import time
from typing import Any

from shardemu import flops
from shardemu.config import ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.mesh import mesh_from
from shardemu.models import Model, param_bytes, param_count
from shardemu.phased.scheduler import PhasedTrainer
from shardemu.sharding import Rules

VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def padded_for(model_cfg: ModelConfig, par: Parallelism) -> ModelConfig:
    """The model with its vocabulary padded as Megatron-LM pads it when the tensor axis
    does not divide it: to a multiple of 128 * tensor (Shoeybi et al. 2019; Megatron-LM
    `_vocab_size_with_padding`)."""
    if model_cfg.vocab_size % par.tensor == 0:
        return model_cfg
    return model_cfg.pad_vocab(VOCAB_MULTIPLE * par.tensor)


def plan_phased(
    model_cfg: ModelConfig,
    par: Parallelism,
    train_cfg: TrainConfig,
    phased: PhasedConfig,
    rules: Rules | None = None,
) -> dict[str, Any]:
    """Count one phased step in abstract mode: the JSON `shardemu plan --json` prints.
    Needs `par.num_devices` JAX devices (virtual CPU devices will do)."""
    t0 = time.perf_counter()
    model = Model(model_cfg)
    trainer = PhasedTrainer(model, mesh_from(par), train_cfg, phased, rules)
    plan = trainer.plan()
    totals = plan.pop("step_totals")
    analytic = flops.training_step(model_cfg, train_cfg.batch, train_cfg.seq)
    shapes, _ = model.abstract_params()
    host = plan["host_bytes_per_device"]
    return {
        "model": model_cfg.name,
        "mesh": str(par),
        "devices": par.num_devices,
        "vocab_size": model_cfg.vocab_size,
        "param_count": param_count(shapes),
        "param_bytes": param_bytes(shapes),
        "batch": train_cfg.batch,
        "seq": train_cfg.seq,
        "tokens_per_step": train_cfg.batch * train_cfg.seq,
        **totals,
        "model_flops_analytic": analytic,
        "model_flops_rel_err": totals["model_flops"] / analytic - 1,
        "memory_per_device": {
            "device": plan["device_high_water"],
            "host": host["weights"] + host["optimizer_state"],
        },
        "plan": plan,
        "elapsed_s": time.perf_counter() - t0,
    }
