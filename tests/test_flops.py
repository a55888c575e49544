"""FLOPs have two witnesses: the per-operation count of shardemu.accounting.flops against
Narayanan et al.'s closed form, and against XLA's cost analysis of the real forward and
backward pass, compiled over ShapeDtypeStructs (nothing allocated, nothing run)."""

import pytest

from shardemu.accounting import flops
from shardemu.config import ModelConfig
from shardemu.models import Model, get_preset

# Wide enough that matmuls dominate the elementwise work XLA also counts. One layer:
# XLA's cost analysis counts a while-loop body once whatever its trip count (see the
# last test), and the layers run in a scan.
WIDE = {
    "gpt": ModelConfig("gpt-wide", "gpt", 8192, 1, 1024, 8, 4096, 256),
    "bert": ModelConfig(
        "bert-wide",
        "bert",
        8192,
        1,
        1024,
        8,
        4096,
        256,
        layer_norm_eps=1e-12,
        gelu_approximate=False,
    ),
}


@pytest.mark.parametrize("name", ["gpt2-small", "gpt3-1.3b", "gpt3-175b"])
def test_per_op_count_equals_narayanan_closed_form(name):
    cfg = get_preset(name)
    analytic = flops.training_step(Model(cfg), 8, 2048)
    assert analytic == pytest.approx(flops.narayanan_gpt(cfg, 8, 2048), rel=1e-12)


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_analytic_count_agrees_with_xla_within_2_percent(family, xla_training_flops):
    cfg, batch, seq = WIDE[family], 2, 128
    xla = xla_training_flops(Model(cfg), batch, seq)
    analytic = flops.training_step(Model(cfg), batch, seq)
    assert abs(xla - analytic) / analytic < 0.02, (xla, analytic)


def test_recomputation_adds_one_forward_of_the_layers():
    model = Model(get_preset("gpt2-small"))
    extra = flops.training_step(model, 4, 1024, True) - flops.training_step(model, 4, 1024)
    assert extra == model.cfg.num_layers * sum(flops.layer_forward(model, 4, 1024).values())


def test_xla_counts_a_scanned_layer_stack_once(xla_training_flops):
    """A fact the ledger must respect: XLA's cost analysis does not multiply a loop
    body by its trip count, so a 3-layer scan reports the FLOPs of a 1-layer one.
    Per-layer (per-phase) counts therefore come from per-layer compilations."""
    one, three = WIDE["gpt"], WIDE["gpt"].replace(num_layers=3)
    assert xla_training_flops(Model(three), 2, 128) == pytest.approx(
        xla_training_flops(Model(one), 2, 128), rel=1e-3
    )
    assert flops.training_step(Model(three), 2, 128) > 1.5 * flops.training_step(Model(one), 2, 128)
