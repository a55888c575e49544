"""The `shardemu` command's compilation cache (`cli/compile_cache.py`): where it goes,
when it is left alone, and that a plan loaded from it predicts what the compiling plan
did."""

import json
import os
import subprocess
import sys
from pathlib import Path

from shardemu.cli.compile_cache import CacheSettings, cache_settings, use_compile_cache

PLAN = ["plan", "--model", "gpt-tiny", "--mesh", "tensor=2", "--batch", "8", "--seq", "16"]
PLAN += ["--hardware", "a100-80gb", "--json"]


def test_the_folder_follows_the_environment_and_a_users_jax_cache_is_theirs():
    home = Path.home() / ".cache" / "shardemu" / "xla"
    assert cache_settings({}, None) == CacheSettings(home)
    assert cache_settings({"XDG_CACHE_HOME": "/c"}, None) == CacheSettings(Path("/c/shardemu/xla"))
    assert cache_settings({"SHARDEMU_CACHE": "/d", "XDG_CACHE_HOME": "/c"}, None).folder == Path(
        "/d"
    )
    assert cache_settings({"SHARDEMU_CACHE": "Off"}, None) is None
    assert cache_settings({"SHARDEMU_CACHE": " "}, None) == CacheSettings(home)  # unset
    # JAX's own cache, configured by the user in the environment or in JAX: left as it is
    assert cache_settings({"JAX_COMPILATION_CACHE_DIR": "/j"}, None) is None
    assert cache_settings({"SHARDEMU_CACHE": "/d"}, "/j") is None
    assert cache_settings({}, None).min_compile_time_s == 0.0  # every compile is kept


def command(tmp_path: Path, cache: str, *argv: str) -> subprocess.CompletedProcess:
    """`shardemu ARGV` in a fresh process with `SHARDEMU_CACHE=cache` and no JAX cache
    (the suite's own, which the command would leave alone, taken out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["SHARDEMU_CACHE"] = cache
    return subprocess.run(
        [sys.executable, "-m", "shardemu", *argv], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=300,
    )  # fmt: skip


def test_a_second_plan_loads_the_firsts_compiles_and_predicts_the_same(tmp_path):
    folder = tmp_path / "cache"
    first = command(tmp_path, str(folder), *PLAN)
    assert first.returncode == 0, first.stderr
    entries = set(folder.iterdir())
    assert entries  # the counted pieces' executables
    second = command(tmp_path, str(folder), *PLAN)
    assert second.returncode == 0, second.stderr
    assert set(folder.iterdir()) == entries  # nothing compiled anew
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    for key in ("step_time_s", "flops", "model_flops", "memory_per_device", "breakdown"):
        assert a[key] == b[key], key


def test_a_folder_that_cannot_be_written_is_one_warning_and_nothing_is_set(tmp_path, caplog):
    import jax

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    before = jax.config.jax_compilation_cache_dir
    assert not use_compile_cache(CacheSettings(blocked / "xla"))
    assert jax.config.jax_compilation_cache_dir == before
    (record,) = caplog.records
    assert "cannot write the compilation cache" in record.getMessage()
    assert "SHARDEMU_CACHE" in record.getMessage()


def test_one_program_on_another_set_of_devices_loads_the_firsts_compile():
    """`share_across_device_sets` (turned on with the command's cache, and by this
    suite's conftest): a program jitted on devices 0-1 and again, the same, on devices
    2-3 (a pipeline's next stage) is compiled once; the second set loads the entry onto
    its own devices and computes the same."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    hits = []

    def listen(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    def step(x):  # a program no other test compiles
        return jnp.tanh(x @ x.T * 0.8125).sum(axis=0)

    x = np.arange(32, dtype=np.float32).reshape(4, 8) / 32
    outs = []
    jax.monitoring.register_event_listener(listen)
    try:
        for devices in (jax.devices()[0:2], jax.devices()[2:4]):
            mesh = jax.sharding.Mesh(np.array(devices), ("stage",))
            arg = jax.device_put(x, NamedSharding(mesh, PartitionSpec("stage")))
            outs.append(jax.jit(step)(arg))
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert len(hits) == 1  # the second set of devices, from the first's entry
    assert {d.id for d in outs[1].devices()} == {2, 3}
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
