"""Context parallelism (`Parallelism.context`, `megatron_rules(context_parallel=True)`):
every sequence split over `context`, each device's queries attending to keys and values
all-gathered over it (Llama 3's all-gather context parallelism). Runs on the resident
engine equal one device (the staged engines' runs, and a phased plan held to its run,
are test_llama.py's); the ledger holds the keys' and values' all-gathers and their
gradients' reduce-scatters with the ring's bytes; what is not built says so."""

import jax
import pytest

from shardemu.accounting.count import Counter, with_shardings
from shardemu.accounting.ledger import totals
from shardemu.accounting.sizes import bytes_per_device
from shardemu.config import ConfigError, Parallelism, TrainConfig
from shardemu.models import Model, get_preset
from shardemu.parallel.mesh import make_mesh
from shardemu.predict.planning import plan
from shardemu.predict.profiles import PROFILES
from shardemu.resident.trainer import Trainer

TRAIN = TrainConfig(batch=8, seq=16, seed=0)
STEPS = 3


def test_the_mesh_and_its_text_name_the_context_axis():
    par = Parallelism.parse("context=2,tensor=2")
    assert (par.context, par.num_devices, str(par)) == (2, 4, "pipe=1,tensor=2,replica=1,context=2")
    mesh = make_mesh(tensor=2, context=2, devices=jax.devices()[:4])
    assert mesh.axis_names == ("pipe", "replica", "expert", "context", "tensor")
    assert make_mesh(tensor=2, devices=jax.devices()[:2]).axis_names == (
        "pipe", "replica", "expert", "tensor",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "axes", "sequence_parallel"),
    [("gpt-tiny", {"context": 2}, False), ("llama-tiny", {"context": 2, "tensor": 2}, True)],
)
def test_context_parallel_equals_one_device(
    name, axes, sequence_parallel, single_device_reference, train_and_compare
):
    """gpt-tiny over context=2, and llama-tiny (grouped-query attention) over context=2
    x tensor=2 with sequence parallelism (the residual stream split over both): every
    loss, the first gradients and the final weights as one device's; the keys' and
    values' collectives as the ring's formula (not their projections' inputs, d wide:
    `models.llama.Attention`), and a plan of the layout as the run (gpt-tiny's also
    in BF16, at 2 bytes an element)."""
    model = Model(get_preset(name))
    reference = single_device_reference(model, TRAIN, STEPS)
    devices = jax.devices()[: Parallelism(**axes).num_devices]
    train = TrainConfig(batch=8, seq=16, seed=0, sequence_parallel=sequence_parallel)
    trainer = Trainer(model, make_mesh(**axes, devices=devices), train)
    train_and_compare(trainer, reference)
    # the keys' and values' collectives, by the ring's formula: K and V [b, s, G k] in
    # FP32 a layer, all-gathered over context forward (each of the c t devices sends
    # (c - 1) / c of its 1 / t of them), their gradients reduce-scattered backward
    events = trainer.step_events(Counter(), 0)
    sent = {
        op: sum(e.bytes for e in events if e.axis == "context" and e.op == op)
        for op in ("all-gather", "reduce-scatter")
    }
    cfg, c = model.cfg, axes["context"]
    kv = 2 * TRAIN.batch * TRAIN.seq * cfg.kv_heads * cfg.head_dim * 4 * cfg.num_layers
    assert sent == {"all-gather": (c - 1) * kv, "reduce-scatter": (c - 1) * kv}
    planned_like_the_run(trainer, axes, train, events)
    if not sequence_parallel:
        planned_in_bf16(trainer.model, axes, kv // 2)


def planned_in_bf16(model, axes, kv):
    """In BF16 the keys and values are gathered and their gradients scattered at 2 bytes
    an element (`kv`: the FP32 formula's bytes halved), as a GPU sends them: XLA's CPU
    backend gathers the projections' FP32 output and converts after the gather
    (`collectives._narrowed`), which would count twice the bytes."""
    train = TrainConfig(batch=8, seq=16, seed=0, precision="bf16")
    h100 = PROFILES["h100-sxm"]
    planned = plan(model, Parallelism(**axes), train, h100, microbatch_size=8, recompute="none")
    c, events = axes["context"], planned.ledger.events
    for op in ("all-gather", "reduce-scatter"):
        assert sum(e.bytes for e in events if e.axis == "context" and e.op == op) == (c - 1) * kv


def planned_like_the_run(trainer, axes, train, events):
    """A resident plan of the run's layout (one microbatch, nothing recomputed) counts
    its step on the context devices: the run's FLOPs (within 1%) and the keys' and
    values' collectives over context exactly; its weight gradients reduced once, over
    replica x context (here context alone), none in the pieces."""
    par, h100 = Parallelism(**axes), PROFILES["h100-sxm"]
    planned = plan(trainer.model, par, train, h100, microbatch_size=8, recompute="none")
    run, ledger = totals(events), planned.ledger.events
    assert planned.report["model_flops"] == pytest.approx(run["model_flops"], rel=0.01)
    for op in ("all-gather", "reduce-scatter"):
        assert sum(e.bytes for e in ledger if e.axis == "context" and e.op == op) == sum(
            e.bytes for e in events if e.axis == "context" and e.op == op
        )
    reductions = [
        e for e in ledger if "context" in (e.axis or "").split("+") and e.op == "all-reduce"
    ]
    assert {e.axis for e in reductions} == {"replica+context"}
    grads = bytes_per_device(with_shardings(trainer.param_shapes, trainer.param_shardings))
    # the ring: each of the c t devices sends 2 (c-1)/c of its gradients (FP32)
    c = par.context
    assert sum(e.bytes for e in reductions) == 2 * (c - 1) * par.tensor * grads


def test_what_context_parallelism_does_not_cover_is_refused():
    """A sequence the context (and, with sequence parallelism, tensor) size does not
    divide; plans of experts split besides."""
    model = Model(get_preset("gpt-tiny"))
    with pytest.raises(ConfigError, match="TrainConfig.seq 16 is not divisible by context=3"):
        TRAIN.check_fits(model.cfg, Parallelism(context=3))
    sp = TrainConfig(batch=8, seq=12, sequence_parallel=True)
    with pytest.raises(ConfigError, match="over tensor x context=8, which does not divide"):
        sp.check_fits(model.cfg, Parallelism(tensor=4, context=2))
    h100 = PROFILES["h100-sxm"]
    moe = get_preset("moe-tiny")
    with pytest.raises(ConfigError, match="context and expert parallelism together"):
        plan(moe, Parallelism(context=2, expert=2), TRAIN, h100, microbatch_size=4)
