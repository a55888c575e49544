"""A model of your own (issue 34, item 1): a small causal language model written here in
Flax linen, with its own logical axis names and rules, registered nowhere in shardemu,
runs on the resident, pipelined and phased engines equal to one device, is planned and
searched with its rules, and is refused, not swapped, where it cannot honour a setting."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import shardemu
from shardemu.config import ConfigError, ModelConfig, Parallelism, PhasedConfig, TrainConfig
from shardemu.errors import ShardingError
from shardemu.parallel.mesh import make_mesh


def _init(axes: tuple, std: float = 0.02):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


class Block(nn.Module):
    """Pre-LN attention and a GELU MLP, its axes named as Flax's lm1b example names them
    (`kv` the head width, `length` the sequence of an activation)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, mask):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.param_dtype)
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        zeros = nn.with_logical_partitioning(nn.initializers.zeros, ("embed",))
        norm = lambda: nn.LayerNorm(scale_init=ones, bias_init=zeros, param_dtype=dtype)  # noqa: E731
        h = norm()(x)
        qkv = nn.DenseGeneral(
            (3, cfg.num_heads, cfg.head_dim), kernel_init=_init(("embed", None, "heads", "kv")),
            use_bias=False, param_dtype=dtype, name="qkv",
        )(h)  # fmt: skip
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
        probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e9), axis=-1)
        ctx = shardemu.constrain(
            jnp.einsum("bhqk,bkhd->bqhd", probs, v), ("batch", "length", "heads", "kv")
        )
        x = x + nn.DenseGeneral(
            cfg.embed_dim, axis=(-2, -1), kernel_init=_init(("heads", "kv", "embed")),
            use_bias=False, param_dtype=dtype, name="out",
        )(ctx)  # fmt: skip
        h = nn.Dense(cfg.mlp_dim, kernel_init=_init(("embed", "mlp")), param_dtype=dtype,
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)))(
            norm()(x)
        )  # fmt: skip
        h = shardemu.constrain(nn.gelu(h), ("batch", "length", "mlp"))
        x = x + nn.Dense(cfg.embed_dim, kernel_init=_init(("mlp", "embed")), param_dtype=dtype,
                         bias_init=zeros)(h)  # fmt: skip
        return shardemu.constrain(x, ("batch", "length", "embed")), None


class MiniLM(nn.Module):
    cfg: ModelConfig
    layer = Block

    def setup(self):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.param_dtype)
        self.tok = nn.Embed(cfg.vocab_size, cfg.embed_dim, param_dtype=dtype,
                            embedding_init=_init(("vocab", "embed")))  # fmt: skip
        self.pos = self.param("pos", _init((None, "embed")), (cfg.max_positions, cfg.embed_dim),
                              dtype)  # fmt: skip
        self.stack = shardemu.layer_stack(self.layer, cfg)
        self.lm_head = nn.Dense(cfg.vocab_size, kernel_init=_init(("embed", "vocab")),
                                use_bias=False, param_dtype=dtype)  # fmt: skip

    def embed(self, tokens):
        seq = tokens.shape[1]
        x = self.tok(tokens) + self.pos[None, :seq]
        return x, jnp.tril(jnp.ones((1, seq, seq), dtype=bool))

    def head(self, x):
        return self.lm_head(x)

    def __call__(self, tokens):
        x, mask = self.embed(tokens)
        return self.head(self.stack(x, mask)[0])


MINI = shardemu.Family(name="mini", module=MiniLM, layer=Block, stack_key="stack")
CFG = ModelConfig("mini-lm", "mini", 128, 2, 32, 4, 64, 32)
MODEL = shardemu.Model(CFG, MINI)
RULES = (
    ("batch", "replica"), ("sequence", None), ("length", None), ("embed", None),
    ("heads", "tensor"), ("kv", None), ("mlp", "tensor"), ("vocab", "tensor"), ("layers", "pipe"),
)  # fmt: skip
TRAIN = TrainConfig(batch=8, seq=16, seed=0)
STEPS = 2


@pytest.fixture(scope="module")
def reference(single_device_reference):
    return single_device_reference(MODEL, TRAIN, STEPS)


def test_the_model_is_its_own_and_is_read_from_its_annotations():
    """No registry holds the family; the model's parameters and their names come from
    its module, and the layer stack's leading axis is `layers`."""
    assert "mini" not in shardemu.models.FAMILIES
    shapes, logical = MODEL.abstract_params()
    assert logical["stack"]["qkv"]["kernel"] == ("layers", "embed", None, "heads", "kv")
    assert shapes["stack"]["qkv"]["kernel"].shape == (2, 32, 3, 4, 8)
    assert shardemu.logical_params(MiniLM(CFG), jnp.zeros((1, 8), jnp.int32))[1] == logical


def test_resident_tensor_and_replica_equal_one_device(reference, train_and_compare):
    """Its own rules split heads and the MLP over `tensor`, the batch over `replica`; its
    `shardemu.constrain` calls resolve through the same rules."""
    mesh = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    train_and_compare(shardemu.Trainer(MODEL, mesh, TRAIN, RULES), reference)


def test_pipelined_equals_one_device(reference, staged_like_reference):
    train = dataclasses.replace(TRAIN, microbatches=2)
    mesh = make_mesh(pipe=2, tensor=2, devices=jax.devices()[:4])
    trainer = shardemu.PipelinedTrainer(MODEL, mesh, train, RULES)
    staged_like_reference(trainer, trainer.place(reference["init"]), reference)


def test_phased_with_rts_equals_one_device(reference, staged_like_reference):
    mesh = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    trainer = shardemu.PhasedTrainer(MODEL, mesh, TRAIN, PhasedConfig(phases=2, rts=2), RULES)
    staged_like_reference(trainer, trainer.init(reference["init"]), reference)


def test_planned_and_searched_with_its_rules():
    """Resident and phased plans of the model at a larger size on a profile, with its
    rules; the analytic FLOPs (its layers shaped as a transformer's, its head the
    default logits) within 2% of the counted ones; a search ranks the small model's
    layouts on one device."""
    big = shardemu.Model(CFG.replace(num_layers=4, embed_dim=512, mlp_dim=2048, vocab_size=1024,
                                     max_positions=128), MINI)  # fmt: skip
    train = TrainConfig(batch=8, seq=128, precision="bf16")
    hw = shardemu.get_hardware("h100-sxm")
    resident = shardemu.plan(big, Parallelism(tensor=2), train, hw, rules=RULES)
    phased = shardemu.plan(big, Parallelism(tensor=2), train, hw, phased=PhasedConfig(),
                           rules=RULES)  # fmt: skip
    for planned in (resident, phased):
        assert planned.report["model"] == "mini-lm"
        assert abs(planned.report["model_flops_rel_err"]) < 0.02
        assert planned.step_time_s > 0
    space = shardemu.Space(("bf16",), "resident", max_tensor=1, max_microbatch=1)
    found = shardemu.search(MODEL, hw, 1, 4, 16, space, top=1, rules=RULES)
    assert found.model == "mini-lm" and found.best.step_time_s > 0


def test_settings_it_cannot_honour_are_refused():
    """A module that makes its parameters in FP32 whatever `param_dtype` says is refused
    under bf16 (it would train and be counted in FP32), and one whose matmuls ignore
    `fp8_matmuls` under fp8 (it would be a BF16 run); a config naming another family;
    a kernel named with fewer names than dimensions, with the whole message."""

    class Stubborn(nn.Module):
        cfg: ModelConfig

        @nn.compact
        def __call__(self, x, mask):
            w = self.param("w", _init(("embed", "embed_out")), (self.cfg.embed_dim,) * 2)
            return x @ w.astype(x.dtype), None  # computes in bf16, stores FP32

    class StubbornLM(MiniLM):
        layer = Stubborn

    fp32_only = shardemu.Family(name="mini", module=StubbornLM, layer=Stubborn, stack_key="stack")
    mesh = make_mesh(devices=jax.devices()[:1])
    bf16 = dataclasses.replace(TRAIN, precision="bf16")
    with pytest.raises(
        ConfigError, match=r"mini-lm .*precision 'bf16' keeps .* bfloat16.*: stack/w \(float32\)"
    ):
        shardemu.Trainer(shardemu.Model(CFG, fp32_only), mesh, bf16, RULES)
    fp8 = dataclasses.replace(TRAIN, precision="fp8")  # its Dense layers ignore fp8_matmuls
    with pytest.raises(ConfigError, match=r"mini-lm .*precision 'fp8' .* computes none in FP8"):
        shardemu.Trainer(MODEL, mesh, fp8, RULES)
    with pytest.raises(ConfigError, match="ModelConfig.family is 'gpt' but the family given"):
        shardemu.Model(CFG.replace(family="gpt"), MINI)
    with pytest.raises(ConfigError, match=r"module \(Block\) has no embed or head method"):
        shardemu.Model(CFG, shardemu.Family("mini", Block, Block, "stack"))

    class Short(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.einsum("bd,dhk->bhk", x, self.param("k", _init(("embed", "kv")), (4, 2, 3)))

    with pytest.raises(ShardingError, match=r"k \(4, 2, 3\) named \('embed', 'kv'\)\. Give every"):
        shardemu.logical_params(Short(), jnp.zeros((1, 4)))


class NnxMlp(nnx.Module):
    """A residual MLP in Flax NNX, its parameters named with `nnx.with_partitioning`."""

    def __init__(self, d: int, f: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        named = lambda axes: nnx.with_partitioning(nnx.initializers.normal(0.02), axes)  # noqa: E731
        self.up = nnx.Linear(d, f, kernel_init=named(("embed", "mlp")), param_dtype=dtype,
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
                             rngs=rngs)  # fmt: skip
        self.down = nnx.Linear(f, d, kernel_init=named(("mlp", "embed")), use_bias=False,
                               param_dtype=dtype, rngs=rngs)  # fmt: skip

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class NnxLayer(nn.Module):
    """The NNX module as a linen layer (Flax's bridge), which `layer_stack` stacks."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, mask):
        dtype = jnp.dtype(self.cfg.param_dtype)
        mlp = nnx.bridge.to_linen(NnxMlp, self.cfg.embed_dim, self.cfg.mlp_dim, dtype)
        return mlp(x), None


class NnxLM(MiniLM):
    layer = NnxLayer


def test_an_nnx_layer_trains_sharded_equal_to_one_device(single_device_reference,
                                                          train_and_compare):  # fmt: skip
    """Through Flax's bridge, with eager sharding off (NNX would otherwise want a mesh
    to create each named variable): the stacked specs gain `layers`, and tensor x
    replica training equals one device."""
    model = shardemu.Model(CFG, shardemu.Family("mini", NnxLM, NnxLayer, "stack"))
    with nnx.use_eager_sharding(False):
        assert model.abstract_params()[1]["stack"]["ToLinen_0"]["up"]["kernel"] == (
            "layers", "embed", "mlp"
        )  # fmt: skip
        reference = single_device_reference(model, TRAIN, STEPS)
        mesh = make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
        train_and_compare(shardemu.Trainer(model, mesh, TRAIN, RULES), reference)


def test_an_nnx_module_is_read_the_same_way():
    """`nnx.with_partitioning` names read without a mesh and without allocating; an
    unnamed parameter is refused like a short spec."""

    class Mlp(nnx.Module):
        def __init__(self, d: int, f: int, rngs: nnx.Rngs):
            part = nnx.with_partitioning
            self.up = nnx.Linear(d, f, kernel_init=part(nnx.initializers.lecun_normal(),
                                 ("embed", "mlp")), bias_init=part(nnx.initializers.zeros,
                                 ("mlp",)), rngs=rngs)  # fmt: skip
            self.down = nnx.Linear(f, d, kernel_init=part(nnx.initializers.lecun_normal(),
                                   ("mlp", "embed")), use_bias=False, rngs=rngs)  # fmt: skip

    shapes, logical = shardemu.logical_params(lambda: Mlp(8, 32, nnx.Rngs(0)))
    assert logical == {"up": {"kernel": ("embed", "mlp"), "bias": ("mlp",)},
                       "down": {"kernel": ("mlp", "embed")}}  # fmt: skip
    assert shapes["up"]["kernel"].shape == (8, 32)
    specs = shardemu.resolve_specs(shapes, logical, RULES, {"pipe": 1, "replica": 1, "tensor": 4})
    assert specs["up"]["kernel"] == jax.sharding.PartitionSpec(None, "tensor")
    with pytest.raises(ShardingError, match=r"kernel \(32, 8\) named \(\)"):
        shardemu.logical_params(lambda: nnx.Linear(32, 8, use_bias=False, rngs=nnx.Rngs(0)))


def test_a_rule_for_an_axis_the_model_does_not_name_is_refused():
    """Its own rules with a typo, `ffn` for its `mlp`: the rule would split nothing and
    the MLP would run whole on every tensor device; refused by the engines and the
    planners, naming the rule and the model's names. Names of shardemu's vocabulary
    (`megatron_rules`) may go unused."""
    typo = (*RULES, ("ffn", "tensor"))
    mesh = make_mesh(tensor=2, devices=jax.devices()[:2])
    with pytest.raises(ConfigError, match=r"split 'ffn' -> 'tensor', but mini-lm .* its names: "):
        shardemu.Trainer(MODEL, mesh, TRAIN, typo)
    with pytest.raises(ConfigError, match="'ffn' -> 'tensor'"):
        shardemu.plan(MODEL, Parallelism(tensor=2), TRAIN, shardemu.get_hardware("h100-sxm"),
                      rules=typo)  # fmt: skip
    MODEL.check_rules((*RULES, ("kv_heads", "tensor")))  # Llama's name, unused here
