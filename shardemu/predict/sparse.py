"""A sparse step's compute on hardware that runs block-sparse matmuls.

XLA counts a masked matmul as dense, so the ledger's compute events hold the dense
FLOPs. On hardware with a block-sparse speed (`Hardware.block_sparse_speed`) the sparse
kernels' share of each event costs `Hardware.sparse_time` of its dense time; the rest
(attention's score and context products, the head, elementwise work) is unchanged.

The share is analytic (`accounting/flops.py`): of one layer's forward matmul FLOPs, the
query, key, value, attention-out and MLP matmuls; the backward pass and a recomputed
forward are the same matmuls again, so the share holds for every event of a layer
phase. A resident step's one event (`step`) covers the head too: its share is taken of
the whole model's forward.
"""

from __future__ import annotations

import dataclasses

from shardemu.accounting import flops
from shardemu.accounting.ledger import Event
from shardemu.config import SparsityConfig
from shardemu.models import Model
from shardemu.predict.hardware import Hardware

SPARSE_MATMULS = ("qkv", "attn_out", "mlp_in", "mlp_out")  # masks.SPARSE_KERNELS' matmuls


def sparse_share(model: Model, seq: int) -> tuple[float, float]:
    """(of a layer's, of the whole model's) forward matmul FLOPs, the fraction in sparse
    kernels (the batch cancels out)."""
    layer = flops.layer_forward(model, 1, seq)
    sparse = sum(layer[k] for k in SPARSE_MATMULS)
    return sparse / sum(layer.values()), model.cfg.num_layers * sparse / flops.forward(
        model, 1, seq
    )


def _scaled(event: Event, factor: float) -> Event:
    """`event` with its FLOPs times `factor` if it is a device computation."""
    if event.kind == "compute" and event.on == "device":
        return dataclasses.replace(event, flops=event.flops * factor)
    return event


def scale_compute(events: list[Event], factor: float) -> list[Event]:
    """`events` with each device computation's FLOPs times `factor`."""
    return [_scaled(e, factor) for e in events]


def _factor(share: float, hw: Hardware, sparse: SparsityConfig) -> float:
    """How much of its dense time a computation whose FLOPs are `share` sparse-kernel
    matmuls takes sparse on `hw`."""
    return 1 - share * (1 - hw.sparse_time(sparse.density, sparse.block))


def layer_factor(hw: Hardware, model: Model, seq: int, sparse: SparsityConfig) -> float:
    """How much of its dense time a layer's computation takes sparse on `hw`."""
    return _factor(sparse_share(model, seq)[0], hw, sparse)


def sparse_compute(
    events: list[Event], hw: Hardware, model: Model, seq: int, sparse: SparsityConfig
) -> list[Event]:
    """A ledger's events with each device computation's FLOPs replaced by the dense FLOPs
    that take as long on `hw` as it does sparse: what the timeline should time. Layer
    phases (`forward`, `backward`) and a resident `step` are scaled; the rest is not."""
    layer, whole = (_factor(share, hw, sparse) for share in sparse_share(model, seq))
    factors = {"forward": layer, "backward": layer, "step": whole}
    return [_scaled(e, factors[e.phase.kind]) if e.phase.kind in factors else e for e in events]


def model_flops_sparse(
    model: Model, tokens: int, model_flops: float, sparse: SparsityConfig | None
) -> dict[str, float]:
    """A plan's `model_flops_sparse` (`flops.without_zero_weights`), the zero weights
    being `sparsity` of the sparse kernels' L (4 d^2 + 2 d f) (ERK keeps the same
    total)."""
    if sparse is None:
        return {}
    d, f = model.cfg.embed_dim, model.cfg.mlp_dim
    zeros = sparse.sparsity * model.cfg.num_layers * (4 * d * d + 2 * d * f)
    return {"model_flops_sparse": flops.without_zero_weights(model_flops, tokens, zeros)}


def sparse_report(hw: Hardware, sparse: SparsityConfig | None) -> dict[str, float]:
    """What a prediction assumed of a sparse model: its density, block, and the time of
    its sparse matmuls as a fraction of dense on `hw` (1.0: run masked dense)."""
    if sparse is None:
        return {}
    return {
        "density": sparse.density,
        "block": sparse.block,
        "sparse_matmul_time": hw.sparse_time(sparse.density, sparse.block),
    }
