"""Shared fixtures: 8 virtual CPU devices for the whole session, tiny configs.

Compilation dominates this suite on 2 cores, so tests compile faster than a user's
process does, in ways that change nothing the tests check, for reference and
sharded runs alike (subprocesses started by the tests inherit them):

- XLA's CPU backend optimisation off: it changes only LLVM code generation, after the
  SPMD partitioning that the tests exercise (it halved compile time).
- XLA's older CPU kernel emitters (`xla_cpu_use_fusion_emitters=false`): the whole
  suite 6 min 40 s -> 3 min 24 s of pytest, one run each on this 2-core machine. It
  changes which elementwise ops the CPU backend fuses into one kernel, after the SPMD
  partitioning, and so the bytes its kernels move: not the FLOPs (within 0.02%), the
  collectives, the transfers or the numbers a step computes. The tests that hold kernel
  bytes to a hand count (test_roofline.py) compile with XLA's default fusion, as a
  user's process does.
- LLVM code generation in one piece (`xla_cpu_parallel_codegen_split_count=1`), not
  split into parts for parallel threads: three workers already keep both cores busy,
  and splitting only adds work (a sharded gradient program's compile 0.60 -> 0.45
  CPU-seconds; the whole suite 341 s -> 286 s of pytest, one run each on this 2-core
  machine). The machine code it emits computes the same.

HLO carries no Python source locations (`jax_include_full_tracebacks_in_locations` off,
`jax_traceback_in_locations_limit` 0): every lowered op otherwise records the stack that
traced it, which XLA copies through each pass and the compilation cache serializes.
Nothing in shardemu reads them. Three test files (engine, phased, sparsity) took 119.5
and 119.1 s of pytest with them, 115.6 and 104.5 s without (alternating runs, one
process); their backend compiles 61.1 -> 56.7 and 61.5 -> 52.3 s.

Python's cyclic garbage collector runs less often (`shardemu.allocation.THRESHOLDS`, as
the commands and planners run it: its first generation collected every 50,000
allocations, not 700): tracing allocates millions of short-lived objects, and
test_llama.py with test_moe.py took 42.3 s with the default thresholds, 38.9 s with
these (one process). Nothing a test checks depends on when garbage is collected.

A persistent compilation cache in a fresh temporary folder, shared by the pytest-xdist
workers, lets identical programs compile once per session: test files share the steps
they both run. (A piece compiled only to be counted stops at the end of XLA's HLO passes,
`accounting/optimized.py`, and is not cached.)
"""

import functools
import gc
import os
import shutil
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    + " --xla_cpu_parallel_codegen_split_count=1"
).strip()

# read by JAX when it is imported, and inherited by the `shardemu` processes tests start
os.environ["JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS"] = "false"
os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"] = "0"

import jax  # noqa: E402

from shardemu.allocation import THRESHOLDS  # noqa: E402

gc.set_threshold(*THRESHOLDS)

from shardemu.devices import use_virtual_devices  # noqa: E402

use_virtual_devices(8)
# one cache for the whole session: the xdist workers inherit the folder the controller made
# (set as JAX's own environment variables, so that the `shardemu` processes the tests
# start share the cache too); the process that made it removes it at the end
_MADE_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _MADE_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardemu-xla-")
# A worker ends with os._exit (`pytest_unconfigure`), which runs no finalizer, so the
# temporary folders made in it were left behind (W&B makes two when imported: 36 in
# /tmp after a day's suites): they go in a folder of its own, which it removes
_WORKER_TMP = None
if "PYTEST_XDIST_WORKER" in os.environ:
    _WORKER_TMP = tempfile.tempdir = tempfile.mkdtemp(prefix="shardemu-test-worker-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

from shardemu.cli.compile_cache import share_across_device_sets  # noqa: E402

# a pipeline's stages share each compile through the cache, as the command's do
# (test_pipeline.py: 32 -> 106 of 293 compiles served by the cache)
share_across_device_sets()
assert len(jax.devices()) == 8  # start the backend now: no command can change the count

import pytest  # noqa: E402

from shardemu.config import TrainConfig  # noqa: E402
from shardemu.models import Model, get_preset  # noqa: E402

NUM_DEVICES = 8


def pytest_collection_finish(session) -> None:
    """What is alive once the tests are imported (JAX, Flax, the test modules) stays
    alive: moved out of the cyclic collector's sight (`gc.freeze`), so that its full
    collections do not walk it again and again (test_pipeline.py 34.3-34.9 -> 32.3-32.5
    CPU-s, two runs each)."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session) -> None:
    """The compilation cache goes with the session that made it (tens of MB a run)."""
    if _MADE_CACHE is not None:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """A pytest-xdist worker ends at once when its session is over: its results went to
    the controller in its sessionfinish (`workerfinished`, after which xdist takes the
    end of its channel for a normal one), and the controller waits for it to exit. An
    ordinary exit took 11 s of the suite's wall time between the last test and pytest's
    end (thread joins, JAX's `clean_up` clearing every cache, freeing the heap); nothing
    is left to write but the standard streams, and its temporary folder to remove."""
    if hasattr(config, "workerinput"):
        if _WORKER_TMP is not None:
            shutil.rmtree(_WORKER_TMP, ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


TINY = {"gpt": "gpt-tiny", "bert": "bert-tiny"}


@pytest.fixture(scope="session")
def tiny_train() -> TrainConfig:
    return TrainConfig(batch=8, seq=16, seed=0)


@pytest.fixture(scope="session", params=sorted(TINY))
def tiny_model(request) -> Model:
    return Model(get_preset(TINY[request.param]))


@pytest.fixture(scope="session")
def assert_params_close():
    """Parameters after a few Adam steps, sharded run vs reference.

    Adam's update lr * m / (sqrt(v) + eps) is ~lr * sign(g) for |g| >> eps, but for an
    element with |g| near eps = 1e-8 a float32 rounding difference in g (sums reordered
    by sharding) moves its update by a fraction of lr. So: every element within 0.1 lr
    (a sharding bug moves parameters by ~lr, or shows in the gradients, which are
    compared tightly), and at most 1 in 10^4 elements beyond 0.01 lr.
    """

    def check(actual, desired, lr: float) -> None:
        import numpy as np

        diffs = [
            np.abs(np.asarray(a) - np.asarray(d)).ravel()
            for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True)
        ]
        diff = np.concatenate(diffs)
        outliers = int((diff > 1e-2 * lr).sum())
        assert diff.max() <= 0.1 * lr, f"max |param diff| {diff.max():.3g} > 0.1 lr"
        assert outliers <= 1e-4 * diff.size, f"{outliers} of {diff.size} params differ > 0.01 lr"

    return check


@pytest.fixture(scope="session")
def single_device_reference():
    return _single_device_reference


@functools.cache  # test files on one worker share it; callers only read it
def _single_device_reference(model: Model, train: TrainConfig, steps: int) -> dict:
    """The witness every engine is compared with: plain `jax.jit` on the default device,
    no shardings, no Trainer, whole batch at once. Returns the initial parameters, the
    loss of every step, the first step's gradients and the final parameters."""
    import optax

    from shardemu.data import SyntheticCorpus
    from shardemu.numerics.optim import make_optimizer

    params = jax.jit(model.init_params)(jax.random.key(train.seed))
    tx = make_optimizer(train, *model.abstract_params())

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    corpus = SyntheticCorpus(model.cfg.vocab_size, seed=train.seed)
    init, opt_state, losses, first_grads = jax.device_get(params), tx.init(params), [], None
    for s in range(steps):
        batch = model.batch(corpus, s, train.batch, train.seq)
        params, opt_state, loss, grads = step(params, opt_state, batch)
        losses.append(float(loss))
        first_grads = jax.device_get(grads) if first_grads is None else first_grads
    return {"init": init, "losses": losses, "grads": first_grads, "final": jax.device_get(params)}


@pytest.fixture(scope="session")
def train_and_compare(assert_params_close):
    """Step a resident `trainer` through the reference's batches, from (params,
    opt_state), or from the reference's initial parameters placed on its mesh when
    none are given, checking every loss, the first step's gradients and the final
    parameters; returns the last ResidentOutput."""
    import chex
    import numpy as np

    from shardemu.data import SyntheticCorpus

    def run(trainer, reference: dict, params=None, opt_state=None):
        if params is None:
            params = jax.device_put(reference["init"], trainer.param_shardings)
            opt_state = jax.jit(trainer.tx.init, out_shardings=trainer.opt_shardings)(params)
        model, train = trainer.model, trainer.train
        corpus = SyntheticCorpus(model.cfg.vocab_size, seed=train.seed)
        for step, want in enumerate(reference["losses"]):
            batch = model.batch(corpus, step, train.batch, train.seq)
            result = trainer.step(params, opt_state, batch, keep_grads=True)
            params, opt_state = result.params, result.opt_state
            np.testing.assert_allclose(float(result.loss), want, rtol=1e-5)
            if step == 0:
                chex.assert_trees_all_close(
                    jax.device_get(result.grads), reference["grads"], rtol=1e-4, atol=1e-6
                )
        assert_params_close(jax.device_get(params), reference["final"], train.learning_rate)
        return result

    return run


@pytest.fixture(scope="session")
def staged_like_reference(assert_params_close):
    """Step a staged `trainer` (pipelined or phased) from `state` through the
    reference's batches: every loss, then the final parameters, as one device's."""
    import numpy as np

    from shardemu.data import SyntheticCorpus

    def run(trainer, state, reference: dict) -> None:
        model, train = trainer.model, trainer.train
        corpus = SyntheticCorpus(model.cfg.vocab_size, seed=train.seed)
        for step, want in enumerate(reference["losses"]):
            result = trainer.step(state, model.batch(corpus, step, train.batch, train.seq))
            state = result.state
            np.testing.assert_allclose(result.loss, want, rtol=1e-5)
        assert_params_close(trainer.params(state), reference["final"], train.learning_rate)

    return run


@pytest.fixture(scope="session")
def xla_training_flops():
    """XLA's FLOPs of one forward and backward pass of `model` on `batch` sequences of
    `seq` tokens, compiled over shapes (a scanned layer stack counts its body once)."""

    def count(model: Model, batch: int, seq: int) -> float:
        shapes, _ = model.abstract_params()
        inputs = {
            k: jax.ShapeDtypeStruct(shape, jax.numpy.int32)
            for k, shape in model.batch_shapes(batch, seq).items()
        }
        compiled = jax.jit(jax.value_and_grad(model.loss)).lower(shapes, inputs).compile()
        return compiled.cost_analysis()["flops"]

    return count
