"""Shared fixtures: 8 virtual CPU devices for the whole session, tiny configs.

Tests compile with XLA's CPU backend optimisation off: it halves compile time, which
dominates this suite on 2 cores. It changes only LLVM code generation, after the SPMD
partitioning that the tests exercise, and reference and sharded runs use it alike.
Subprocesses started by the tests inherit it.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
).strip()

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from shardemu.config import TrainConfig, get_preset  # noqa: E402
from shardemu.models import Model  # noqa: E402

NUM_DEVICES = 8
TINY = {"gpt": "gpt-tiny", "bert": "bert-tiny"}


@pytest.fixture(scope="session")
def tiny_train() -> TrainConfig:
    return TrainConfig(batch=8, seq=16, seed=0)


@pytest.fixture(scope="session", params=sorted(TINY))
def tiny_model(request) -> Model:
    return Model(get_preset(TINY[request.param]))
