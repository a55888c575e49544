"""Pipeline parallelism executed for real: GPipe over `pipe` (with tensor and replica
sharding inside each stage), microbatches and gradient accumulation all give the loss,
gradients and parameters of plain single-device jax.jit on the same global batch; the
executed order is the schedule module's GPipe order."""

import jax
import numpy as np
import pytest

from shardemu.config import ConfigError, TrainConfig
from shardemu.parallel.mesh import make_mesh
from shardemu.parallel.rules import ShardingError
from shardemu.parallel.schedules import make_schedule
from shardemu.training.resident import Trainer

# (pipe, tensor, replica): microbatch counts. Every mesh runs, every M in {1, 2, 4} runs
# on pipe 2 and 4 and with tensor and replica sharding inside stages (the full product
# compiled 18 step variants per model; this covers it with 8, keeping the suite short).
MESHES = {
    (2, 1, 1): (1, 4),
    (4, 1, 1): (2,),
    (2, 2, 1): (4,),
    (2, 1, 2): (2,),
    (2, 2, 2): (1, 4),
    (4, 1, 2): (4,),
}
CASES = [(*mesh, m, 1) for mesh, ms in MESHES.items() for m in ms]
CASES += [(1, 1, 1, 1, 2), (2, 1, 2, 2, 2), (2, 2, 2, 1, 2)]  # gradient accumulation
# BERT differs from GPT in the pipeline only by its per-example padding mask, which
# travels with the microbatches: it runs the cases with several microbatches on both
# pipeline depths and with accumulation (GPT runs them all)
BERT_CASES = {(2, 2, 2, 4, 1), (4, 1, 2, 4, 1), (2, 1, 2, 2, 2), (4, 1, 1, 2, 1)}
STEPS = 3
TRAIN = TrainConfig(batch=16, seq=16, seed=0)


pytestmark = pytest.mark.slow  # each case compiles and runs whole steps


@pytest.fixture(scope="module")
def reference(tiny_model, single_device_reference):
    return single_device_reference(tiny_model, TRAIN, STEPS)


@pytest.mark.parametrize(
    ("pipe", "tensor", "replica", "microbatches", "accum"),
    CASES,
    ids=[f"p{p}t{t}r{r}-m{m}-k{k}" for p, t, r, m, k in CASES],
)
def test_pipelined_equals_single_device(
    tiny_model, reference, pipe, tensor, replica, microbatches, accum, train_and_compare
):
    if (
        tiny_model.cfg.family == "bert"
        and (pipe, tensor, replica, microbatches, accum) not in BERT_CASES
    ):
        pytest.skip("GPT covers this mesh; BERT runs the cases its padding mask changes")
    train = TrainConfig(
        batch=TRAIN.batch,
        seq=TRAIN.seq,
        seed=TRAIN.seed,
        microbatches=microbatches,
        grad_accum=accum,
    )
    devices = jax.devices()[: pipe * tensor * replica]
    trainer = Trainer(tiny_model, make_mesh(pipe, tensor, replica, devices=devices), train)
    params = jax.device_put(reference["init"], trainer.param_shardings)
    opt_state = jax.jit(trainer.tx.init, out_shardings=trainer.opt_shardings)(params)
    result = train_and_compare(trainer, params, opt_state, reference)

    if pipe * microbatches > 1:  # the executed order is GPipe's forward wavefront
        sched = make_schedule("gpipe", pipe, microbatches)
        expected = np.full((pipe + microbatches - 1, pipe), -1)
        for slot in sched.slots:
            if slot.kind == "F":
                expected[slot.time, slot.stage] = slot.microbatch
        for executed in np.asarray(result.order):  # one per accumulation step
            np.testing.assert_array_equal(executed, expected)


def test_stage_parameters_live_on_their_pipe_slice(tiny_model):
    trainer = Trainer(tiny_model, make_mesh(pipe=4, tensor=1, replica=2), TRAIN)
    params = jax.device_put(
        jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), trainer.param_shapes),
        trainer.param_shardings,
    )
    kernel = params[tiny_model.stack_key]["mlp"]["fc_in"]["kernel"]  # [L=4, d, f]
    for shard in kernel.addressable_shards:
        stage = trainer.mesh.devices.tolist()  # [pipe][replica][tensor]
        pipe_index = next(i for i, plane in enumerate(stage) if shard.device in np.ravel(plane))
        assert shard.index[0] == slice(pipe_index, pipe_index + 1)  # layer s on stage s


def test_uneven_stages_are_refused(tiny_model):
    with pytest.raises(
        ShardingError, match=r"'layers', size 4\) is not divisible by mesh axis 'pipe' \(size 8\)"
    ):
        Trainer(tiny_model, make_mesh(pipe=8), TRAIN)


def test_batch_must_split_into_microbatches_and_accumulation(tiny_model):
    bad = TrainConfig(batch=16, seq=16, microbatches=4, grad_accum=4)
    with pytest.raises(
        ConfigError, match="replica \\* microbatches \\* grad_accum = 2 \\* 4 \\* 4 = 32"
    ):
        Trainer(tiny_model, make_mesh(pipe=2, tensor=2, replica=2), bad)
