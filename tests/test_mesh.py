"""Virtual devices and the mesh: shapes, axis names, and the errors users will hit."""

import platform
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import AxisType, Mesh

from shardemu.config import ConfigError, Parallelism
from shardemu.devices import DeviceError, use_virtual_devices
from shardemu.parallel.mesh import make_mesh


def test_mesh_has_named_axes_over_all_devices():
    mesh = make_mesh(tensor=2, replica=4)
    assert isinstance(mesh, Mesh)
    assert dict(mesh.shape) == {"pipe": 1, "replica": 4, "expert": 1, "tensor": 2}
    assert set(mesh.devices.flat) == set(jax.devices())
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_tensor_is_the_innermost_axis():
    mesh = make_mesh(tensor=2, replica=4)
    ids = [[d.id for d in row] for row in mesh.devices[0, :, 0]]
    assert ids[0] == [jax.devices()[0].id, jax.devices()[1].id]  # neighbours share tensor


def test_expert_sits_between_replica_and_tensor():
    mesh = make_mesh(tensor=2, expert=2, replica=2)
    assert mesh.axis_names == ("pipe", "replica", "expert", "tensor")
    ids = [d.id for d in mesh.devices[0, 0, :, 0]]
    assert ids == [jax.devices()[0].id, jax.devices()[2].id]  # past one tensor group


def test_mesh_over_a_subset():
    assert make_mesh(tensor=2, devices=jax.devices()[:2]).size == 2


def test_mesh_size_mismatch_names_both_numbers():
    with pytest.raises(DeviceError, match=r"needs 4 device\(s\) but 8 were given"):
        make_mesh(tensor=2, replica=2)


def test_virtual_devices_cannot_grow_after_start():
    assert use_virtual_devices(8) == jax.devices()  # same count: all of them
    assert use_virtual_devices(4) == jax.devices()[:4]  # fewer: the first ones
    with pytest.raises(DeviceError, match=r"already started with 8 CPU device.*\(16\)"):
        use_virtual_devices(16)


def test_mesh_strings_parse_and_bad_ones_explain():
    assert Parallelism.parse("pipe=2,tensor=4,replica=8").num_devices == 64
    assert Parallelism.parse("tensor=2") == Parallelism(tensor=2)
    for bad, msg in [
        ("tensr=2", "bad mesh item"),
        ("tensor=x", "integer"),
        ("tensor=2,tensor=2", "twice"),
        ("replica=0", "positive"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            Parallelism.parse(bad)


@pytest.mark.skipif(
    not Path("/proc/self/maps").exists() or platform.libc_ver()[0] != "glibc",
    reason="glibc on Linux only: elsewhere reuse_host_memory sets nothing",
)
@pytest.mark.parametrize("reuse", [True, False])
def test_large_host_buffers_come_from_the_reused_heap(reuse):
    """With reuse_memory, use_virtual_devices tells glibc to serve large blocks from its
    heap (kept mapped for reuse) instead of a fresh mmap per block: a 64 MiB buffer,
    far past glibc's default mmap threshold, then lies inside the [heap] mapping, and
    without it outside. In a fresh process: this one's backend has started."""
    script = f"""
import numpy as np
from pathlib import Path
from shardemu.devices import use_virtual_devices
use_virtual_devices(2, reuse_memory={reuse})
address = np.ones(1 << 24, np.float32).ctypes.data
maps = Path("/proc/self/maps").read_text().splitlines()
heaps = [[int(x, 16) for x in m.split()[0].split("-")] for m in maps if m.endswith("[heap]")]
print(any(lo <= address < hi for lo, hi in heaps))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stdout.strip() == str(reuse), out.stderr
