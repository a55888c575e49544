"""The counter (`accounting/count.py`): each piece compiled once per signature, however
many threads ask for it and whichever path (kept or recomputed layers) reaches it."""

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shardemu.accounting.count import Counted, Counter, abstract
from shardemu.models import Model, get_preset
from shardemu.parallel.mesh import make_mesh
from shardemu.predict.resident_count import count_microbatch


class SlowCounter(Counter):
    """A counter whose compiles take long enough for a second thread to ask meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.compiles = 0

    def _compile(self, key, fn, mesh, args) -> None:
        self.compiles += 1
        time.sleep(0.3)
        super()._compile(key, fn, mesh, args)


def test_two_threads_asking_for_one_piece_compile_it_once():
    mesh = make_mesh(tensor=1, replica=1, devices=jax.devices()[:1])
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    fn = jax.jit(lambda a: jnp.tanh(a @ a))
    counter, got = SlowCounter(), []
    threads = [
        threading.Thread(target=lambda: got.append(counter.count("piece", fn, mesh, (x,))))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.compiles == 1 and len(counter) == 1
    assert got[0] is got[1] and got[0].flops_per_device > 0


def test_the_head_compiles_once_for_kept_and_recomputed_layers():
    """`fwd-keep` declares its output's layout as `fwd` does, so the head that takes it
    has one signature, and a counter given to `count_microbatch` is the one it fills
    (an empty counter, falsy by its length, once fell back to the process's)."""
    counter = Counter()
    model = Model(get_preset("gpt-tiny"))
    for full in (True, False):
        count_microbatch(model, 2, 2, 16, full, counter=counter)
    names = [key[0] for key in counter._counted]
    assert names.count("head") == 1
    assert names.count("fwd") == names.count("fwd-keep") == 1


def test_models_alike_in_shape_are_counted_apart():
    """Two GPTs that differ only in their GELU (tanh or erf form: the same weights and
    activations) compile different layers: a resident plan's count of one must not be
    the other's (the pieces' context names the model)."""
    from shardemu.config import Parallelism
    from shardemu.models import custom_model
    from shardemu.predict.resident_count import count_key, counted_microbatch

    cfg = custom_model("gpt", 2, 32, 4, 64, 32)
    forward = [
        counted_microbatch(count_key(
            Model(cfg.replace(gelu_approximate=tanh)), Parallelism(tensor=2), 1, 32, "none", "fp32",
            "materialized",
        )).pieces["forward"][0]
        for tanh in (True, False)
    ]  # fmt: skip
    assert forward[0].flops != forward[1].flops
    assert forward[0].memory_bytes != forward[1].memory_bytes


def _flat(counted: Counted) -> Counted:
    """`counted` with its outputs' shardings a list (a vjp's tree structure holds the
    jaxpr of a trace, which compares by identity)."""
    return dataclasses.replace(counted, out_shardings=jax.tree.leaves(counted.out_shardings))


class RecordingCounter(Counter):
    """Notes each piece it counts."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[tuple] = []

    def _compile(self, key, fn, mesh, args) -> None:
        self.pieces.append((key[0], fn, mesh, args, key[1]))
        super()._compile(key, fn, mesh, args)


def test_a_count_stopped_after_the_hlo_passes_is_the_whole_compiles():
    """Every field of a count made without machine code (`accounting/optimized.py`)
    equals that of the whole compile (`count_compiled`): each piece of a
    tensor-parallel microbatch, among them a forward that keeps residuals JAX lays out
    itself (`Counter.outputs`) and the backward from them; and a piece whose outputs
    are declared in pinned host memory, or not declared. The program still compiles
    whole and runs after it (the hook stops only the counts' compiles)."""
    counter = RecordingCounter()
    count_microbatch(Model(get_preset("gpt-tiny")), 2, 2, 16, False, counter=counter)
    mesh = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    sharded = NamedSharding(mesh, PartitionSpec("replica", "tensor"))
    host = NamedSharding(mesh, PartitionSpec("replica"), memory_kind="pinned_host")
    fn = jax.jit(
        lambda a, b: (jnp.tanh(a @ b), (a * 2).sum(0), a + 1),
        out_shardings=(host, None, None),
    )
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sharded)
    counter.count("host", fn, mesh, (x, x))
    assert {"fwd-keep", "bwd-keep", "head", "update-layers-device"} < {p[0] for p in counter.pieces}
    for name, piece, on, args, context in counter.pieces:
        compiled = piece.lower(*abstract(args)).compile()
        whole = _flat(Counter().count_compiled(name, compiled, on, args, context))
        assert _flat(counter.count(name, piece, on, args, context)) == whole, name
    fast = counter.count("host", fn, mesh, (x, x))
    assert fast.collectives and fast.matmuls
    shardings = fast.out_shardings
    assert [s.memory_kind for s in shardings] == ["pinned_host", "device", "device"]
    assert shardings[2] is x.sharding  # the argument's, as JAX writes it
    ones = jnp.ones((8, 8), jnp.float32, device=sharded)
    assert float(fn(ones, ones)[1].sum()) == 128.0


def test_the_recomputation_is_the_backward_less_the_backward_from_residuals():
    """With full recomputation a layer's recomputed FLOPs are its counted backward's less
    those of its backward from kept residuals (`recompute_flops`), counted over the
    residuals its forward lays out; each of those pieces compiled once."""
    counter = RecordingCounter()
    mb = count_microbatch(Model(get_preset("gpt-tiny")), 2, 2, 16, True, counter=counter)
    names = [p[0] for p in counter.pieces]
    assert names.count("fwd-keep") == names.count("bwd-keep") == 1
    kept = counter.count(*next(p for p in counter.pieces if p[0] == "bwd-keep"))
    events = mb.pieces["backward"]
    backward = next(e for e in events if e.recompute_flops)
    recomputed = backward.run_flops - kept.flops_per_device
    assert sum(e.recompute_flops for e in events) == recomputed * backward.devices > 0
