"""The rules table: golden specs for GPT and BERT on a tensor=2 x replica=4 mesh, and
the specific errors for conflicts, unknown names and non-dividing axes."""

import math

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from shardemu.config import Parallelism
from shardemu.models import get_preset
from shardemu.parallel.advice import dividing_sizes
from shardemu.parallel.rules import (
    ShardingError,
    logical_to_spec,
    megatron_rules,
    param_table,
    resolve_specs,
    shard_shape,
    validate_rules,
)
from shardemu.report.describe import describe

MESH_2x4 = Parallelism(tensor=2, replica=4)
T = "tensor"

# Megatron: vocab-parallel embedding, column-parallel QKV / fc_in, row-parallel out / fc_out;
# stacked layers split over pipe (contiguous blocks of layers = pipeline stages).
L = "pipe"
BLOCK_SPECS = {
    "attn/query/kernel": P(L, None, T, None),
    "attn/key/kernel": P(L, None, T, None),
    "attn/value/kernel": P(L, None, T, None),
    "attn/query/bias": P(L, T, None),
    "attn/key/bias": P(L, T, None),
    "attn/value/bias": P(L, T, None),
    "attn/out/kernel": P(L, T, None, None),
    "attn/out/bias": P(L, None),
    "mlp/fc_in/kernel": P(L, None, T),
    "mlp/fc_in/bias": P(L, T),
    "mlp/fc_out/kernel": P(L, T, None),
    "mlp/fc_out/bias": P(L, None),
}
LN = {"scale": P(None), "bias": P(None)}
STACKED_LN = {"scale": P(L, None), "bias": P(L, None)}

GPT_SPECS = {
    "wte/embedding": P(T, None),
    "wpe/embedding": P(None, None),
    **{f"blocks/{k}": v for k, v in BLOCK_SPECS.items()},
    **{f"blocks/{ln}/{k}": v for ln in ("ln_1", "ln_2") for k, v in STACKED_LN.items()},
    **{f"ln_f/{k}": v for k, v in LN.items()},
}
BERT_SPECS = {
    "word_embeddings/embedding": P(T, None),
    "position_embeddings/embedding": P(None, None),
    "token_type_embeddings/embedding": P(None, None),
    **{f"embeddings_ln/{k}": v for k, v in LN.items()},
    **{f"layers/{k}": v for k, v in BLOCK_SPECS.items()},
    **{f"layers/{ln}/{k}": v for ln in ("attn_ln", "mlp_ln") for k, v in STACKED_LN.items()},
    "pooler/kernel": P(None, None),
    "pooler/bias": P(None),
    "nsp/kernel": P(None, None),
    "nsp/bias": P(None),
    "mlm_transform/kernel": P(None, None),
    "mlm_transform/bias": P(None),
    **{f"mlm_ln/{k}": v for k, v in LN.items()},
    "mlm_bias": P(T),
}


def spec_table(model: str) -> dict[str, P]:
    report = describe(get_preset(model), MESH_2x4)
    return {row["path"]: P(*row["spec"]) for row in report["params"]}


@pytest.mark.parametrize(("model", "golden"), [("gpt-tiny", GPT_SPECS), ("bert-tiny", BERT_SPECS)])
def test_megatron_specs_on_2x4_mesh(model, golden):
    assert spec_table(model) == golden


def test_bytes_per_device_follow_the_specs():
    report = describe(get_preset("gpt-tiny"), MESH_2x4)
    rows = {r["path"]: r for r in report["params"]}
    # wte 512 x 64 float32 split in two over tensor; wpe 128 x 64 replicated.
    assert rows["wte/embedding"]["bytes_per_device"] == 512 * 64 * 4 // 2
    assert rows["wpe/embedding"]["bytes_per_device"] == 128 * 64 * 4
    assert report["bytes_per_device"] == sum(r["bytes_per_device"] for r in rows.values())
    assert report["bytes_per_device"] < report["param_bytes"]


def test_batch_goes_over_replica():
    assert logical_to_spec(("batch", "sequence", "embed"), megatron_rules()) == P(
        "replica", None, None
    )


def test_non_dividing_axis_names_parameter_dimension_and_sizes():
    # gpt2-small has 12 heads: tensor=8 does not divide them (its vocab is padded here,
    # so the heads are the only failure).
    cfg = get_preset("gpt2-small").pad_vocab(128)
    with pytest.raises(ShardingError) as err:
        describe(cfg, Parallelism(tensor=8))
    msg = str(err.value)
    assert "'heads' dimension 12 is not divisible by mesh axis 'tensor' (size 8) in " in msg
    assert "blocks/attn/key/bias" in msg and "use a model whose head count" in msg


def test_every_failing_parameter_is_reported_at_once():
    """Grouped by the dimension that fails them, each fix said once: GPT-2 small's seven
    head-split parameters and its unpadded vocabulary at tensor=8."""
    with pytest.raises(ShardingError) as err:
        describe(get_preset("gpt2-small"), Parallelism(tensor=8))
    msg = str(err.value)
    assert msg.startswith("8 parameters cannot be sharded")  # q,k,v kernels+biases, out, wte
    heads, vocab = msg.split("; ")
    for name in ("query", "key", "value"):
        assert f"blocks/attn/{name}/kernel" in heads and f"blocks/attn/{name}/bias" in heads
    assert "blocks/attn/out/kernel" in heads and heads.count("head count") == 1
    assert "'vocab' dimension 50257" in vocab and "in wte/embedding: pad the" in vocab


def test_unpadded_vocab_suggests_padding():
    with pytest.raises(ShardingError, match=r"'vocab', size 50257.*ModelConfig.pad_vocab"):
        describe(get_preset("gpt2-small"), Parallelism(tensor=2))
    assert describe(get_preset("gpt2-small").pad_vocab(128), Parallelism(tensor=2))


def test_one_mesh_axis_cannot_shard_two_dimensions():
    rules = (("embed", "tensor"), ("mlp", "tensor"))
    with pytest.raises(ShardingError, match="would shard both 'embed' and 'mlp'"):
        logical_to_spec(("embed", "mlp"), rules)


def test_unknown_logical_axis_is_an_error():
    with pytest.raises(ShardingError, match="'moe_groups' has no rule"):
        logical_to_spec(("moe_groups",), megatron_rules())


def test_rules_table_is_validated():
    with pytest.raises(ShardingError, match="maps logical axis 'embed' twice"):
        validate_rules((("embed", None), ("embed", "tensor")), ("pipe", "replica", "tensor"))
    with pytest.raises(ShardingError, match="names mesh axis 'model'"):
        validate_rules((("mlp", "model"),), ("pipe", "replica", "tensor"))
    # logical_to_spec alone is as strict: the last duplicate does not win
    with pytest.raises(ShardingError, match="maps logical axis 'mlp' twice"):
        logical_to_spec(("mlp",), (("mlp", None), ("mlp", "tensor")))
    with pytest.raises(ShardingError, match="names mesh axis 'model'"):
        logical_to_spec(("mlp",), (("mlp", "model"),), "w", ("pipe", "replica", "tensor"))


def test_multi_axis_rule_divides_by_the_product():
    shapes = {"w": jax.ShapeDtypeStruct((12, 6), "float32")}
    logical = {"w": ("mlp", "embed")}
    rules = (("mlp", ("tensor", "replica")), ("embed", None))
    specs = resolve_specs(shapes, logical, rules, {"pipe": 1, "tensor": 2, "replica": 3})
    assert specs == {"w": P(("tensor", "replica"), None)}
    with pytest.raises(ShardingError, match="size 8"):
        resolve_specs(shapes, logical, rules, {"pipe": 1, "tensor": 2, "replica": 4})


@given(
    dims=st.lists(st.integers(1, 48), min_size=1, max_size=4),
    tensor=st.sampled_from([1, 2, 3, 4, 8]),
    replica=st.sampled_from([1, 2, 4, 6]),
)
def test_resolution_succeeds_exactly_when_shards_tile_the_array(dims, tensor, replica):
    names = ("batch", "heads", "embed", "mlp")[: len(dims)]  # replica, tensor, -, tensor
    if "mlp" in names:  # heads and mlp both map to tensor: keep one per tensor
        names = names[:1] + ("head_dim",) + names[2:]
    shapes = {"w": jax.ShapeDtypeStruct(tuple(dims), "float32")}
    sizes = {"pipe": 1, "tensor": tensor, "replica": replica}
    spec = logical_to_spec(names, megatron_rules())
    splits = [1 if a is None else sizes[a] for a in spec]
    divisible = all(d % n == 0 for d, n in zip(dims, splits, strict=True))
    try:
        specs = resolve_specs(shapes, {"w": names}, megatron_rules(), sizes)
    except ShardingError:
        assert not divisible
        return
    assert divisible
    block = shard_shape(dims, specs["w"], sizes)
    assert [b * n for b, n in zip(block, splits, strict=True)] == dims
    row = param_table(shapes, {"w": names}, specs, sizes)[0]
    assert row.bytes_per_device * math.prod(splits) == 4 * math.prod(dims)


def test_a_short_logical_spec_is_refused_in_one_whole_sentence():
    """A 3-D kernel annotated with two names (a user's `('embed', 'kv')`): the error
    names the parameter, both counts and the fix."""
    shapes = {"k": jax.ShapeDtypeStruct((64, 4, 16), "float32")}
    with pytest.raises(ShardingError) as err:
        resolve_specs(shapes, {"k": ("embed", "kv")}, megatron_rules(), MESH_2x4.axis_sizes())
    assert str(err.value) == (
        "parameter 'k' (64, 4, 16): has 2 logical axes ('embed', 'kv') for its 3 dimensions; "
        "name every dimension (None for one that is never split) in its "
        "nn.with_logical_partitioning"
    )


def test_a_mesh_that_does_not_divide_is_told_the_sizes_that_would():
    """Once for all the parameters: the divisors of the dimensions the axis splits (GPT-2
    small's 12 heads, 3,072-wide MLP and padded 50,304-row vocabulary: 12), or that none
    above 1 does (its 50,257 rows unpadded)."""
    assert dividing_sizes([32, 14336]) == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ShardingError) as err:
        describe(get_preset("gpt2-small").pad_vocab(128), Parallelism(tensor=8))
    assert str(err.value).endswith(
        "Sizes of 'tensor' that divide every parameter dimension it splits: 1, 2, 3, 4, 6, 12"
    )
    assert describe(get_preset("gpt2-small").pad_vocab(128), Parallelism(tensor=6))
    with pytest.raises(ShardingError, match="No size of 'tensor' above 1 divides"):
        describe(get_preset("gpt2-small"), Parallelism(tensor=8))


def test_copies_counts_the_devices_holding_each_byte():
    """An activation [b, s, d] on a replica 2 x tensor 4 stage: split over replica by
    batch and whole on each tensor rank, 4 copies of each byte; split over tensor by
    sequence too (sequence parallelism), one; a tree, its fewest; replicated, all 8."""
    from jax.sharding import NamedSharding

    from shardemu.accounting.sizes import copies
    from shardemu.parallel.mesh import make_mesh

    mesh = make_mesh(tensor=4, replica=2)

    def act(spec):
        return jax.ShapeDtypeStruct((8, 16, 32), "float32", sharding=NamedSharding(mesh, spec))

    assert copies(act(P("replica"))) == 4
    assert copies(act(P("replica", "tensor"))) == 1
    assert copies({"x": act(P("replica")), "mask": act(P("replica", "tensor"))}) == 1
    assert copies(act(P())) == 8
