"""Virtual devices and the mesh: shapes, axis names, and the errors users will hit."""

import platform
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from shardemu.config import ConfigError, Parallelism
from shardemu.devices import DeviceError, use_virtual_devices
from shardemu.parallel.mesh import make_mesh


def test_mesh_has_named_axes_over_all_devices():
    mesh = make_mesh(tensor=2, replica=4)
    assert isinstance(mesh, Mesh)
    assert dict(mesh.shape) == {"pipe": 1, "replica": 4, "tensor": 2}
    assert set(mesh.devices.flat) == set(jax.devices())
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_tensor_is_the_innermost_axis():
    mesh = make_mesh(tensor=2, replica=4)
    ids = [[d.id for d in row] for row in mesh.devices[0]]
    assert ids[0] == [jax.devices()[0].id, jax.devices()[1].id]  # neighbours share tensor


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
def test_large_host_buffers_come_from_the_reused_heap():
    """conftest started the devices through use_virtual_devices, which told glibc to
    serve large blocks from its heap (kept mapped for reuse) instead of a fresh mmap
    per block. A 64 MiB buffer, far past glibc's default mmap threshold, lies inside
    the process's [heap] mapping."""
    buffer = np.ones(1 << 24, np.float32)
    address = buffer.ctypes.data
    heaps = [
        tuple(int(x, 16) for x in line.split()[0].split("-"))
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.endswith("[heap]")
    ]
    assert any(lo <= address < hi for lo, hi in heaps)
