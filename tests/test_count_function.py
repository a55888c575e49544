"""`shardemu.count` of functions written here, not in shardemu, against hand formulas:
a row-parallel matmul's FLOPs and its ring all-reduce's bytes; a Flax module annotated
with logical axes, whose collectives follow the rules table it is counted with; and
`predict_ledger`, whose precision is said outright."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardemu
from shardemu.config import ConfigError
from shardemu.parallel.mesh import make_mesh

M, K, N = 256, 512, 1024
TENSOR, REPLICA = 4, 2


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(tensor=TENSOR, replica=REPLICA)


def row_parallel(mesh):
    """x [M, K] split by rows over replica and by K over tensor, w [K, N] by K: each
    device multiplies its K slice, and the partial sums are all-reduced over tensor."""
    x = jax.ShapeDtypeStruct(
        (M, K), jnp.float32, sharding=NamedSharding(mesh, P("replica", "tensor"))
    )
    w = jax.ShapeDtypeStruct((K, N), jnp.float32, sharding=NamedSharding(mesh, P("tensor", None)))
    out = NamedSharding(mesh, P("replica", None))
    return shardemu.count(lambda a, b: a @ b, x, w, mesh=mesh, out_shardings=out)


def test_a_row_parallel_matmul_counts_its_flops_and_its_ring_all_reduce(mesh):
    ledger = row_parallel(mesh)
    totals = ledger.step_totals(0)
    partial = (M // REPLICA) * N * 4  # bytes of one device's partial sum
    # 2 M K N for the products, and the all-reduce's sum, which XLA counts as one add
    # per element of each device's partial
    assert totals["flops"] == 2 * M * K * N + TENSOR * REPLICA * partial // 4
    (reduce,) = [e for e in ledger.events if e.kind == "collective"]
    assert (reduce.op, reduce.axis, reduce.group) == ("all-reduce", "tensor", TENSOR)
    # a ring all-reduce sends 2 (T - 1) / T of the buffer from every device
    assert reduce.bytes == TENSOR * REPLICA * 2 * (TENSOR - 1) * partial // TENSOR


class Mlp(nn.Module):
    """Written as a user writes one: Flax linen, logical axes on every kernel."""

    @nn.compact
    def __call__(self, x):
        w_in = self.param(
            "w_in", nn.with_logical_partitioning(nn.initializers.normal(), ("embed", "mlp")),
            (64, 256),
        )  # fmt: skip
        w_out = self.param(
            "w_out", nn.with_logical_partitioning(nn.initializers.normal(), ("mlp", "embed")),
            (256, 64),
        )  # fmt: skip
        h = nn.with_logical_constraint(jax.nn.relu(x @ w_in), ("batch", "mlp"))
        return h @ w_out


def count_mlp(mesh, rules):
    module, x = Mlp(), jnp.zeros((16, 64))
    abstract = jax.eval_shape(module.init, jax.random.key(0), x)
    specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.meta.unbox(abstract), nn.meta.unbox(specs),
    )  # fmt: skip
    batch = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("replica")))

    def loss(p, x):
        return jnp.sum(module.apply(p, x) ** 2)

    return shardemu.count(jax.grad(loss), params, batch, mesh=mesh, rules=rules)


def test_a_flax_module_is_counted_through_the_rules_it_is_given(mesh):
    """Megatron's rules split `mlp` over tensor: the forward's output is all-reduced over
    it, and the work is split: two forward matmuls, two weight gradients and the hidden
    layer's gradient (the input has none), 5 x 2 x 16 x 64 x 256 FLOPs and a few percent
    of elementwise work. With `mlp` replicated nothing crosses tensor, and each of its
    four devices does its replica's whole share: four times the FLOPs executed. The
    weight gradients sum over replica either way."""
    megatron = count_mlp(mesh, shardemu.megatron_rules()).step_totals(0)
    replicated = tuple((n, None if n == "mlp" else a) for n, a in shardemu.megatron_rules())
    plain = count_mlp(mesh, replicated).step_totals(0)
    assert megatron["bytes_collective"].get("tensor", 0) > 0
    assert "tensor" not in plain["bytes_collective"]
    assert "replica" in megatron["bytes_collective"] and "replica" in plain["bytes_collective"]
    matmuls = 5 * 2 * 16 * 64 * 256
    assert matmuls <= megatron["flops"] < 1.1 * matmuls
    assert TENSOR * matmuls <= plain["flops"] < 1.1 * TENSOR * matmuls


def test_predict_ledger_takes_the_precision_it_is_told(mesh):
    """The same ledger on an A100 at FP32 (19.5 TFLOP/s) and at BF16 (312): the
    computation is timed at the peak of the precision given, which has no default."""
    ledger = row_parallel(mesh)
    a100 = shardemu.get_hardware("a100-80gb")
    _, fp32 = shardemu.predict_ledger(ledger, a100, precision="fp32", mesh=mesh, tokens=M)
    _, bf16 = shardemu.predict_ledger(ledger, a100, precision="bf16", mesh=mesh, tokens=M)
    assert bf16.step_time_s < fp32.step_time_s
    assert bf16.tokens_per_s == pytest.approx(M / bf16.step_time_s)
    with pytest.raises(TypeError, match="precision"):
        shardemu.predict_ledger(ledger, a100, mesh=mesh)
    with pytest.raises(ConfigError, match="'fp64' is not one of fp32, bf16, fp16-mixed, fp8"):
        shardemu.predict_ledger(ledger, a100, precision="fp64", mesh=mesh)


def test_a_mesh_of_other_axis_names_is_refused():
    foreign = Mesh(jax.devices()[:2], ("data",))
    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    with pytest.raises(
        ConfigError, match="a mesh of shardemu's axes .* is needed; this one has 'data'"
    ):
        shardemu.count(lambda a: a * 2, x, mesh=foreign)
    with pytest.raises(ConfigError, match="takes arrays or jax.ShapeDtypeStruct arguments"):
        shardemu.count(lambda a: a, [[1.0]], mesh=make_mesh(devices=jax.devices()[:1]))


def test_flax_multi_dimensional_dense_general_is_refused_with_its_cause(mesh):
    """Flax's DenseGeneral with (heads, head_dim) features and named kernels cannot be
    traced under the global mesh count sets (google/flax#3676): said, not XLA's rank
    error."""
    dense = nn.DenseGeneral(
        (4, 16), kernel_init=nn.with_logical_partitioning(
            nn.initializers.normal(), ("embed", "heads", "head_dim"))
    )  # fmt: skip
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    params = nn.meta.unbox(jax.eval_shape(dense.init, jax.random.key(0), x))
    with pytest.raises(ConfigError, match=r"google/flax#3676.*self.param\(...\) and jnp.einsum"):
        shardemu.count(dense.apply, params, x, mesh=mesh, rules=shardemu.megatron_rules())
