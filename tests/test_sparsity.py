"""Block sparsity: the masks' patterns and densities, one dynamic update against a
hand count (the pruned blocks are the smallest by L1 norm, the non-zero count is
unchanged, regrown moments are zero), and a sharded sparse run against one device
(same masks, same losses, zeros exactly zero, FLOPs by the analytic count) on every
engine; the phased engine's compressed weight streams against an encoding of its
shards; the hardware's block-sparse speed in a plan."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cli_helpers import shardemu

from shardemu import Model, Parallelism, SyntheticCorpus, TrainConfig, get_preset
from shardemu.accounting.ledger import Ledger
from shardemu.accounting.sizes import bytes_all_devices
from shardemu.config import ConfigError, PhasedConfig, SparsityConfig
from shardemu.models import custom_model
from shardemu.parallel.mesh import mesh_from
from shardemu.phased.trainer import PhasedTrainer
from shardemu.pipelined.trainer import PipelinedTrainer
from shardemu.predict.hardware import HardwareError
from shardemu.predict.profiles import get_hardware, load_profile
from shardemu.predict.sparse import sparse_compute, sparse_share
from shardemu.report.rundir import read_metrics
from shardemu.resident.trainer import Trainer
from shardemu.run.engine import PhasedEngine, PipelinedEngine, ResidentEngine
from shardemu.sparsity import apply_masks, densities, sparse_leaves, wrap_optax
from shardemu.sparsity.masks import (
    block_mask,
    block_norms,
    kernel_id,
    layer_uniforms,
    matrix_shape,
)
from shardemu.sparsity.wrapper import _updated

GPT = Model(get_preset("gpt-tiny"))
SHAPES, LOGICAL = GPT.abstract_params()
# 6 FLOPs per token for each zero weight at sparsity 0.75: 4 layers of q, k, v, out
# (64 x 64 each) and MLP in and out (64 x 256 each)
REMOVED = 6 * round(0.75 * 4 * (4 * 64 * 64 + 2 * 64 * 256))


def sparse_items(tree):
    """(path, leaf, logical axes) of the sparse kernels of a parameter-shaped tree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    axes = jax.tree.leaves(LOGICAL, is_leaf=lambda x: isinstance(x, tuple))
    sparse = jax.tree.leaves(sparse_leaves(LOGICAL))
    return [(p, x, a) for (p, x), a, s in zip(flat, axes, sparse, strict=True) if s]


def test_the_sparse_kernels_are_the_layers_dense_weights():
    names = {"/".join(str(k.key) for k in p[1:3]) for p, _, _ in sparse_items(SHAPES)}
    assert names == {"attn/query", "attn/key", "attn/value", "attn/out", "mlp/fc_in", "mlp/fc_out"}


def test_the_kernels_drawn_together_draw_what_each_draws_alone():
    """`layer_uniforms` draws every kernel's scores in one batch: each kernel's rows are
    what a draw of its own gives, keyed by the kernel and the layer's index in the
    model (so a stage of layers 2.. draws what the whole model draws for them), though
    the kernels differ in layers and blocks."""
    key, first = jax.random.key(5), 2
    grids = [(path, matrix_shape(x.shape, a)[0], 8 * i + 8) for i, (path, x, a) in
             enumerate(sparse_items(SHAPES)[:2])] + [(("other",), 2, 5)]  # fmt: skip
    for (path, layers, blocks), drawn in zip(grids, layer_uniforms(key, grids, first), strict=True):
        kernel = jax.random.fold_in(key, kernel_id(path))
        draws = [jax.random.fold_in(kernel, first + i) for i in range(layers)]
        alone = np.stack([jax.random.uniform(k, (blocks,)) for k in draws])
        np.testing.assert_array_equal(drawn, alone)


@pytest.mark.parametrize("block", [1, 4, 16])  # elementwise, a block, the widest
def test_initial_pattern_has_the_density_in_every_layer_and_is_constant_on_blocks(block):
    cfg = SparsityConfig(0.75, block=block)
    tx = wrap_optax(optax.sgd(0.1), cfg, LOGICAL, steps=10, seed=3)
    masks = jax.eval_shape(tx.init, SHAPES).masks  # shapes first: dense leaves are scalars
    state = jax.jit(tx.init)(jax.jit(GPT.init_params)(jax.random.key(0)))
    for (_, m, axes), (_, shape, _) in zip(
        sparse_items(state.masks), sparse_items(masks), strict=True
    ):
        assert m.shape == shape.shape and m.dtype == bool
        layers, rows, cols = matrix_shape(m.shape, axes)
        blocks = (rows // block) * (cols // block)
        per_layer = block_mask(m, axes, block).sum(axis=1)
        assert per_layer.tolist() == [round(0.25 * blocks)] * layers
        grid = np.asarray(m).reshape(layers, rows // block, block, cols // block, block)
        assert (grid == grid[:, :, :1, :, :1]).all()  # one value per block


def test_erk_keeps_the_same_weights_and_favours_thin_kernels():
    cfg = SparsityConfig(0.9, distribution="erk")
    density = densities(SHAPES, LOGICAL, cfg)
    sizes = {p: matrix_shape(x.shape, a) for p, x, a in sparse_items(SHAPES)}
    kept = sum(density[p] * n * r * c for p, (n, r, c) in sizes.items())
    assert kept == pytest.approx(0.1 * sum(n * r * c for n, r, c in sizes.values()))
    # density / ((r + c) / (r c)) is one constant (no kernel is capped at 1 here)
    ratios = {density[p] * r * c / (r + c) for p, (_, r, c) in sizes.items()}
    assert max(ratios) == pytest.approx(min(ratios))


@pytest.mark.parametrize("distribution", ["uniform", "erk"])
def test_densities_of_a_tree_without_sparse_kernels_are_refused(distribution):
    """No kernel to make sparse is a clear error, not ERK's division by zero nor an empty
    answer that leaves the run dense."""
    no_kernels = {"wte": {"embedding": jax.ShapeDtypeStruct((64, 8), jnp.float32)}}
    with pytest.raises(ConfigError, match=f"block sparsity .{distribution}.*has none"):
        densities(no_kernels, {"wte": {"embedding": ("vocab", "embed")}},
                  SparsityConfig(0.5, distribution=distribution))  # fmt: skip


def test_a_dynamic_update_prunes_the_smallest_blocks_and_keeps_the_count():
    cfg = SparsityConfig(0.5, block=4, mode="dynamic", updates=5, prune_ratio=0.5)
    params = jax.jit(GPT.init_params)(jax.random.key(1))
    tx = wrap_optax(optax.adam(1e-3), cfg, LOGICAL, steps=10, seed=0)
    masks = jax.jit(tx.init)(params).masks
    params = jax.jit(apply_masks)(params, masks)
    t = 2
    # one compiled program, as the wrapper runs it (not one small program an operation)
    update = jax.jit(lambda p, m, k: _updated(p, p, m, jnp.int32(t), cfg, LOGICAL, 10, k, 0))
    new = update(params, masks, jax.random.key(0))
    ratio = 0.5 * 0.5 * (1 + math.cos(math.pi * t / 10))
    as_blocks = jax.jit(block_mask, static_argnums=(1, 2))
    norms_of = jax.jit(block_norms, static_argnums=(1, 2))
    for (_, p, axes), (_, m, _), (_, n, _) in zip(
        sparse_items(params), sparse_items(masks), sparse_items(new), strict=True
    ):
        old_b, new_b = np.asarray(as_blocks(m, axes, 4)), np.asarray(as_blocks(n, axes, 4))
        norms = np.asarray(norms_of(p, axes, 4))
        assert (old_b.sum(1) == new_b.sum(1)).all()  # as many non-zero blocks
        for layer in range(old_b.shape[0]):
            k = math.floor(ratio * old_b[layer].sum())
            pruned = old_b[layer] & ~new_b[layer]
            grown = new_b[layer] & ~old_b[layer]
            assert pruned.sum() == grown.sum() == k > 0
            kept_norms = norms[layer][old_b[layer] & new_b[layer]]
            assert norms[layer][pruned].max() <= kept_norms.min()  # the smallest went


def test_wrapped_updates_keep_zeros_and_zero_the_regrown_moments():
    cfg = SparsityConfig(0.5, block=4, mode="dynamic", updates=2, prune_ratio=1.0)
    params = jax.jit(GPT.init_params)(jax.random.key(1))
    tx = wrap_optax(optax.adam(1e-2), cfg, LOGICAL, steps=2, seed=0)
    state = jax.jit(tx.init)(params)
    params = jax.jit(apply_masks)(params, state.masks)
    grads = jax.tree.map(jnp.ones_like, params)
    update = jax.jit(tx.update)
    for _ in range(2):  # step 0 trains; step 1 updates the pattern first (every 2 // 2 steps)
        updates, new_state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        # read on the host: NumPy's checks compile nothing
        old, new = jax.device_get((state.masks, new_state.masks))
        regrown = jax.tree.map(lambda n, o: n & ~o, new, old)
        for p, m in zip(jax.device_get(jax.tree.leaves(params)), jax.tree.leaves(new), strict=True):
            assert np.all(np.where(m, True, p == 0))  # masked weights exactly zero
        mu = jax.device_get(new_state.inner[0].mu)
        for r, moment in zip(jax.tree.leaves(regrown), jax.tree.leaves(mu), strict=True):
            assert np.all(np.where(r, moment == 0, True))
        state = new_state
    changed = sum(int(np.sum(r)) for r in jax.tree.leaves(regrown) if r.ndim)
    assert changed > 0  # the second step did update the pattern


SPARSE_TRAIN = TrainConfig(
    steps=3, batch=8, seq=16, sparsity=SparsityConfig(0.75, block=8, mode="dynamic", updates=2)
)
CORPUS = SyntheticCorpus(GPT.cfg.vocab_size, seed=0)
HELD_OUT = [
    GPT.batch(SyntheticCorpus(GPT.cfg.vocab_size, seed=0, split="validation"), i, 8, 16)
    for i in range(2)
]


def train_sparse(engine, masks_of, params_of, witness=None):
    """Run `SPARSE_TRAIN` on `engine`: per step (loss, counts, full masks), and checks
    that every masked weight is exactly zero after every step. `witness(state_before,
    step)` is called before each step."""
    state, steps = engine.init(0), []
    for step in range(SPARSE_TRAIN.steps):
        if witness:
            witness(state, step)
        out = engine.step(state, GPT.batch(CORPUS, step, SPARSE_TRAIN.batch, SPARSE_TRAIN.seq))
        state = out.state
        masks, params = masks_of(state), params_of(state)
        for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(masks), strict=True):
            assert np.all(np.where(m, True, np.asarray(p) == 0))
        steps.append((out.loss, out.counts, masks))
    return steps, state


@pytest.fixture(scope="module")
def one_device():
    """The dynamic sparse run on one device (3 steps, 2 pattern updates), which the
    other engines must equal; and its held-out loss, checked against the model's own
    loss of the same parameters."""
    mesh = mesh_from(Parallelism(), jax.devices()[:1])
    engine = ResidentEngine(Trainer(GPT, mesh, SPARSE_TRAIN))
    steps, (params, _) = train_sparse(
        engine, lambda s: jax.tree.map(np.asarray, s[1].masks), lambda s: jax.device_get(s[0])
    )
    evaluated = engine.evaluate((params, None), HELD_OUT)["val_loss"]
    direct = [float(jax.jit(GPT.loss)(jax.device_get(params), b)) for b in HELD_OUT]
    assert evaluated == pytest.approx(np.mean(direct), rel=1e-5)
    return steps, evaluated


def assert_same_run(run, reference, layers_only=False):
    """The same masks after every step, the same losses, the same density, and the
    same FLOPs removed from model_flops: the masks' zeros (counted by the engine) against
    the configured sparsity of the kernels' shapes (`REMOVED`)."""
    reference = reference[0]
    patterns = [jax.tree.leaves(s[2]) for s in reference]
    assert any((a != b).any() for a, b in zip(patterns[0], patterns[-1], strict=True))
    for (loss_a, counts_a, masks_a), (loss_b, counts_b, masks_b) in zip(
        reference, run, strict=True
    ):
        if layers_only:
            masks_a = masks_a[GPT.stack_key]
        assert jax.tree.all(jax.tree.map(np.array_equal, masks_a, masks_b))
        assert loss_b == pytest.approx(loss_a, rel=1e-5)
        assert counts_a["density"] == counts_b["density"] == 0.25
        # the zero weights' FLOPs, removed from each engine's own count
        removed = [c["model_flops"] - c["model_flops_sparse"] for c in (counts_a, counts_b)]
        assert removed[0] == removed[1] == REMOVED * SPARSE_TRAIN.tokens


def stacked_masks(opt_states):
    """The masks of a model's layer stack, from its parts' optimizer states."""
    masks = jax.device_get([o.masks for o in opt_states])
    return jax.tree.map(lambda *xs: np.concatenate(xs) if xs[0].ndim else xs[0], *masks)


def encoded_bytes(weights, masks, block):
    """A block-COO encoding of every device's shard of `weights`, built here from the
    host tier's arrays: (values, int32 coordinates) per sparse kernel, the shard whole
    for the rest; its total bytes over all devices."""
    total = 0
    for path, w in jax.tree_util.tree_flatten_with_path(weights)[0]:
        m = np.asarray(masks[path[0].key][path[1].key][path[2].key]) if len(path) == 3 else None
        for shard in w.addressable_shards:
            data = np.asarray(shard.data)
            if m is None or m.ndim == 0:
                total += data.nbytes
                continue
            part = m[shard.index]
            # in-projections are (layers, embed | out...), out-projections (layers, in... | embed)
            at = data.ndim - 1 if path[1].key in ("out", "fc_out") else 2
            grid = (data.shape[0], math.prod(data.shape[1:at]) // block, block, -1, block)
            keep = part.reshape(grid)[:, :, 0, :, 0]
            values = data.reshape(grid).transpose(0, 1, 3, 2, 4)[keep]
            coords = np.argwhere(keep).astype(np.int32)
            total += values.nbytes + coords.nbytes
    return total


@pytest.mark.slow
def test_phased_sparse_run_equals_one_device_and_streams_the_compressed_bytes(one_device):
    """pipe=2 x tensor=2, two phases per stage, dynamic sparse: the one-device run's
    masks and losses; each phase's weights stream in exactly the bytes of a block-COO
    encoding of its shards (values and coordinates), built from the host tier's arrays."""
    mesh = mesh_from(Parallelism(pipe=2, tensor=2), jax.devices()[:4])
    trainer = PhasedTrainer(GPT, mesh, SPARSE_TRAIN, PhasedConfig(phases=4))
    expected = {}

    def witness(state, step):
        for i, (w, o) in enumerate(zip(state.layers, state.opt_layers, strict=True)):
            expected[(step, i)] = encoded_bytes(w, jax.device_get(o.masks), 8)

    engine = PhasedEngine(trainer)
    run, state = train_sparse(
        engine, lambda s: stacked_masks(s.opt_layers),
        lambda s: trainer.params(s)[GPT.stack_key], witness,
    )  # fmt: skip
    assert_same_run(run, one_device, layers_only=True)
    # the held-out loss of the phased run's parameters, against the one-device run's
    assert engine.evaluate(state, HELD_OUT)["val_loss"] == pytest.approx(one_device[1], rel=1e-5)
    streamed = {
        (e.step, e.phase.index): e.bytes
        for e in trainer.ledger.events
        if e.kind == "h2d" and e.carries == "weights" and e.phase.kind == "forward"
    }
    assert streamed == expected
    dense = sum(bytes_all_devices(w) for w in state.layers)
    assert sum(expected[(2, i)] for i in range(4)) < 0.35 * dense  # 1/4 of the blocks kept


@pytest.mark.slow
def test_weight_streaming_sparse_run_equals_one_device_and_broadcasts_compressed(one_device):
    """Weight streaming on 2 systems, dynamic sparse: the one-device run's masks and
    losses; each layer's broadcast carries, per SwarmX link, one system's copy of the
    block-COO encoding, and the per-system gradients reduced in the host tier drop
    the zero weights' gradients as the other engines do."""
    systems = 2
    mesh = mesh_from(Parallelism(replica=systems), jax.devices()[:systems])
    cfg = PhasedConfig(weight_streaming=True, activations="keep-activations")
    trainer = PhasedTrainer(GPT, mesh, SPARSE_TRAIN, cfg)
    expected = {}

    def witness(state, step):
        for i, (w, o) in enumerate(zip(state.layers, state.opt_layers, strict=True)):
            expected[(step, i)] = encoded_bytes(w, jax.device_get(o.masks), 8) // systems

    run, _ = train_sparse(
        PhasedEngine(trainer), lambda s: stacked_masks(s.opt_layers),
        lambda s: trainer.params(s)[GPT.stack_key], witness,
    )  # fmt: skip
    assert_same_run(run, one_device, layers_only=True)
    streamed = {
        (e.step, e.phase.index): e.bytes
        for e in trainer.ledger.events
        if e.kind == "broadcast" and e.carries == "weights" and e.phase.kind == "forward"
    }
    assert streamed == expected


@pytest.mark.slow
def test_pipelined_sparse_run_equals_one_device(one_device):
    """pipe=2 x replica=2, 1F1B over 2 microbatches, dynamic sparse: the one-device
    run's masks and losses."""
    train = dataclasses.replace(SPARSE_TRAIN, microbatches=2, schedule="1f1b")
    mesh = mesh_from(Parallelism(pipe=2, replica=2), jax.devices()[:4])
    trainer = PipelinedTrainer(GPT, mesh, train)
    run, _ = train_sparse(
        PipelinedEngine(trainer), lambda s: stacked_masks(s.opt_chunks),
        lambda s: trainer.params(s)[GPT.stack_key],
    )  # fmt: skip
    assert_same_run(run, one_device, layers_only=True)


BAD = [
    (["--sparsity", "1"], "--sparsity 1.0 must be in [0, 1)"),
    (["--sparsity", "-0.1"], "must be in [0, 1)"),
    (["--sparsity", "0.9", "--block", "3"], "--block 3 must be one of 1, 4, 8, 16"),
    (["--sparsity", "0.9", "--block", "16", "--mesh", "tensor=8", "--batch", "8"],
     "--block 16 does not divide the columns of 'blocks/attn/"),
    (["--sparsity", "0.9", "--sparse-mode", "dynamic", "--sparse-updates", "5"],
     "--sparse-updates 5 is more than the 2 steps"),
    (["--sparsity", "0.9", "--prune-ratio", "0"], "--prune-ratio 0.0 must be in (0, 1]"),
    (["--sparsity", "0.9", "--prune-ratio", "1.5"], "--prune-ratio 1.5 must be in (0, 1]"),
    (["--block", "4"], "--block need --sparsity"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "message"), BAD)
def test_bad_sparsity_is_one_clear_error(extra, message, tmp_path):
    argv = ["run", "--model", "gpt-tiny", "--steps", "2", "--batch", "4", "--seq", "16"]
    out = shardemu(*argv, *extra, "--out", str(tmp_path / "r"))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert message in lines[0], lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_sparse_run_on_the_standard_library_logs_density_and_held_out_loss(tmp_path):
    out = tmp_path / "run"
    # the settings of the one-device run above, so its compiled step is reused
    result = shardemu(
        "run", "--model", "gpt-tiny", "--steps", "3", "--batch", "8", "--seq", "16",
        "--data", "stdlib", "--eval-every", "2", "--sparsity", "0.75", "--block", "8",
        "--sparse-mode", "dynamic", "--sparse-updates", "2", "--hardware", "cs2",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = read_metrics(out)
    assert [r["density"] for r in records] == [0.25] * 3
    assert all(r["model_flops"] - r["model_flops_sparse"] == REMOVED * 128 for r in records)
    evaluated = [r["step"] for r in records if "val_loss" in r]
    assert evaluated == [1, 2]  # every 2 steps and after the last
    assert all(0 < r["val_loss"] < 2 * math.log(512) for r in records if "val_loss" in r)
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["data"] == "stdlib" and config["train"]["sparsity"]["block"] == 8
    summary = (out / "summary.md").read_text()
    assert f"| final_val_loss | {records[-1]['val_loss']:.6g} |" in summary
    assert "| predicted_sparse_matmul_time | 0.25 |" in summary  # a CS-2 runs at density


def test_hardware_block_sparse_speed_and_profile_files(tmp_path):
    """CS-2 runs the non-zeros at the dense rate at any block size; a GC200 breaks even
    at 16 x 16 blocks and density 0.1 and gains past it; GPUs run masked dense; a profile
    file may give its own speeds, and a bad entry is refused."""
    cs2, ipu, gpu = (get_hardware(n) for n in ("cs2", "ipu-pod16", "a100-80gb"))
    assert [cs2.sparse_time(0.1, b) for b in (1, 4, 8, 16)] == [0.1] * 4
    assert ipu.sparse_time(0.1, 16) == pytest.approx(1.0) and ipu.sparse_time(0.1, 4) == 1.0
    assert ipu.sparse_time(0.05, 16) == pytest.approx(0.5)
    assert gpu.sparse_time(0.1, 16) == 1.0
    good = tmp_path / "mine.toml"
    good.write_text('base = "a100-80gb"\nblock_sparse_speed = [[16, 0.4], [8, 0.2]]\n')
    assert load_profile(good).sparse_time(0.1, 16) == pytest.approx(0.25)
    bad = tmp_path / "bad.toml"
    bad.write_text('base = "a100-80gb"\nblock_sparse_speed = [[3, 0.4]]\n')
    with pytest.raises(HardwareError, match=r"block_sparse_speed entries are \[block, speed\]"):
        load_profile(bad)


def test_a_sparse_plan_streams_a_tenth_and_times_the_layers_sparse():
    """A phased plan at sparsity 0.9 with 16 x 16 blocks: each phase's weights stream
    close to 10x fewer bytes (the non-zero blocks and their coordinates); on a CS-2 the
    layers' computations take the analytic share of their dense time, and the rest is
    timed as before."""
    model = Model(custom_model("gpt", layers=2, hidden=256, heads=4, vocab=512, positions=64))
    sparse = SparsityConfig(0.9, block=16)
    train = TrainConfig(batch=4, seq=64, sparsity=sparse)
    mesh = mesh_from(Parallelism(), jax.devices()[:1])
    trainer = PhasedTrainer(model, mesh, train, PhasedConfig())
    ledger = Ledger()
    trainer.plan(ledger=ledger)
    streamed = sum(
        e.bytes
        for e in ledger.events
        if e.kind == "h2d" and e.carries == "weights" and e.phase.kind == "forward"
    )
    dense = sum(bytes_all_devices(w) for w in trainer.abstract_state().layers)
    assert 9.5 < dense / streamed < 10
    plans = {"sparse": ledger.events}
    cs2 = get_hardware("cs2")
    timed = sparse_compute(plans["sparse"], cs2, model, 64, sparse)
    layer_share, _ = sparse_share(model, 64)
    for before, after in zip(plans["sparse"], timed, strict=True):
        if before.kind == "compute" and before.phase.kind in ("forward", "backward"):
            assert after.flops == pytest.approx(before.flops * (1 - 0.9 * layer_share))
        else:
            assert after == before
    # by hand: q, k, v, out 8 s d^2 and the MLP 16 s d^2, against attention's 4 s^2 d
    d, s = 256, 64
    assert layer_share == pytest.approx((24 * s * d * d) / (24 * s * d * d + 4 * s * s * d))


def test_plan_with_sparsity_predicts_the_sparse_step(tmp_path):
    """`shardemu plan --phased --sparsity` on a CS-2: the report says the density and
    what the sparse matmuls cost, and counts model_flops_sparse."""
    out = shardemu(
        "plan", "--model", "gpt", "--layers", "2", "--hidden", "256", "--heads", "4",
        "--vocab", "512", "--batch", "4", "--seq", "64", "--phased", "--hardware", "cs2",
        "--json", "--sparsity", "0.9", "--block", "16", "--out", str(tmp_path / "plan"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["density"] == pytest.approx(0.1) and report["block"] == 16
    assert report["sparse_matmul_time"] == pytest.approx(0.1)
    zeros = 0.9 * 2 * (4 * 256 * 256 + 2 * 256 * 1024)
    assert report["model_flops_sparse"] == pytest.approx(report["model_flops"] - 6 * 256 * zeros)
