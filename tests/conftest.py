"""Shared fixtures: 8 virtual CPU devices for the whole session, tiny configs."""

import jax

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
