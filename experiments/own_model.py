"""A model of your own on shardemu: written here in Flax linen, registered nowhere.

The model is a PaLM-style decoder (Chowdhery et al. 2022, "PaLM", Section 2): one
LayerNorm feeding attention and the MLP in parallel (x + attn(ln(x)) + mlp(ln(x))),
multi-query attention (one key/value head for all query heads), a SwiGLU MLP, no
biases, learned positions here instead of RoPE, an untied output layer. Its parameters
and activations carry logical names of its own (`kv` the head width, `ffn` the MLP,
`length` the sequence of an activation), and `RULES` maps them to the mesh.

1. Real: a few steps trained on 8 virtual devices (tensor 2 x replica 2 x pipe 2,
   pipelined 1F1B) and on one device; the losses agree.
2. Counted: one jitted loss-and-gradient of the model on tensor 2 x replica 2,
   `shardemu.count`: XLA's FLOPs against the analytic count, and its collectives per
   mesh axis.
3. Planned at full size (an 8B of this shape) on two profiles, H100 SXM and TPU v5p.

    python experiments/own_model.py [--out DIR] [--steps 3]

Prints the tables and writes DIR (the sharded run's directory, with own_model.json;
default runs/own_model-<time>).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from shardemu import use_virtual_devices

use_virtual_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import shardemu  # noqa: E402
from shardemu.accounting import flops  # noqa: E402
from shardemu.models.layers import unrolled_layers  # noqa: E402
from shardemu.report.rundir import default_run_dir  # noqa: E402


def named(axes: tuple, std: float = 0.02) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def layer_norm(dtype: jnp.dtype, name: str | None = None) -> nn.LayerNorm:
    ones = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    return nn.LayerNorm(use_bias=False, param_dtype=dtype, scale_init=ones, name=name)


class ParallelBlock(nn.Module):
    """x + attention(ln(x)) + mlp(ln(x)); multi-query attention; SwiGLU."""

    cfg: shardemu.ModelConfig

    @nn.compact
    def __call__(self, x, mask):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.param_dtype)
        d, heads, k, f = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
        # kernels as params and einsums: Flax's DenseGeneral with multi-dimensional
        # features cannot be counted under a mesh (google/flax#3676)
        kernel = lambda name, axes, shape: self.param(name, named(axes), shape, dtype)  # noqa: E731
        h = shardemu.constrain(layer_norm(dtype)(x), ("batch", "length", "embed"))
        q = jnp.einsum("bsd,dhk->bshk", h, kernel("query", ("embed", "heads", "kv"), (d, heads, k)))
        kv = jnp.einsum("bsd,dtk->bstk", h, kernel("key_value", ("embed", None, "kv"), (d, 2, k)))
        scores = jnp.einsum("bqhd,bkd->bhqk", q, kv[:, :, 0]) / math.sqrt(k)  # one K, V head
        probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e9), axis=-1)
        ctx = jnp.einsum("bhqk,bkd->bqhd", probs, kv[:, :, 1])
        ctx = shardemu.constrain(ctx, ("batch", "length", "heads", "kv"))
        attn = jnp.einsum(
            "bshk,hkd->bsd", ctx, kernel("out", ("heads", "kv", "embed"), (heads, k, d))
        )
        gate_up = jnp.einsum(
            "bsd,dtf->bstf", h, kernel("gate_up", ("embed", None, "ffn"), (d, 2, f))
        )
        act = shardemu.constrain(
            nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], ("batch", "length", "ffn")
        )
        mlp = jnp.einsum("bsf,fd->bsd", act, kernel("down", ("ffn", "embed"), (f, d)))
        return shardemu.constrain(x + attn + mlp, ("batch", "length", "embed")), None


class PaLMish(nn.Module):
    cfg: shardemu.ModelConfig

    def setup(self):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.param_dtype)
        self.tokens = nn.Embed(cfg.vocab_size, cfg.embed_dim, param_dtype=dtype,
                               embedding_init=named(("vocab", "embed"), 1.0))  # fmt: skip
        self.positions = self.param(
            "positions", named((None, "embed")), (cfg.max_positions, cfg.embed_dim), dtype
        )
        self.layers = shardemu.layer_stack(ParallelBlock, cfg)
        self.final_ln = layer_norm(dtype)
        self.output = nn.Dense(cfg.vocab_size, use_bias=False, param_dtype=dtype,
                               kernel_init=named(("embed", "vocab")))  # fmt: skip

    def embed(self, tokens):
        seq = tokens.shape[1]
        x = self.tokens(tokens) + self.positions[None, :seq]
        x = shardemu.constrain(x, ("batch", "length", "embed"))
        return x, jnp.tril(jnp.ones((1, seq, seq), dtype=bool))

    def head(self, x):
        return self.output(self.final_ln(x))

    def __call__(self, tokens):
        x, mask = self.embed(tokens)
        return self.head(self.layers(x, mask)[0])


# What the engines, planners and analytic count need beyond the modules: its layer
# stack's name, the activations between layers, and that its attention reads
# `num_kv_heads` key/value heads and its MLP has two input matrices. The batch, loss
# and head's matmuls are `Family`'s defaults: next-token prediction.
FAMILY = shardemu.Family(
    name="palmish",
    module=PaLMish,
    layer=ParallelBlock,
    stack_key="layers",
    activation_axes=("batch", "length", "embed"),
    gated_mlp=True,
    grouped_query=True,
)
RULES = (
    ("batch", "replica"), ("sequence", None), ("length", None), ("embed", None),
    ("heads", "tensor"), ("kv", None), ("ffn", "tensor"), ("vocab", "tensor"),
    ("layers", "pipe"),
)  # fmt: skip
TINY = shardemu.ModelConfig("palmish-tiny", "palmish", 256, 4, 64, 4, 128, 64, num_kv_heads=1)
# PaLM 8B's shape (Chowdhery et al. 2022, Table 1: 32 layers, d 4096, 16 heads, d_ff 16384,
# a 256k vocabulary) with an untied output layer (PaLM ties it): 9.69B parameters
FULL = shardemu.ModelConfig(
    "palmish-8b", "palmish", 256_000, 32, 4096, 16, 16384, 2048, num_kv_heads=1
)


def train_real(out: Path, steps: int) -> dict:
    """The tiny model trained pipelined and sharded on 8 devices, and on one."""
    model = shardemu.Model(TINY, FAMILY)
    train = shardemu.TrainConfig(batch=8, seq=32, steps=steps, microbatches=2)
    sharded = shardemu.train(model, shardemu.Parallelism(pipe=2, tensor=2, replica=2), train,
                             out=out, rules=RULES)  # fmt: skip
    one = shardemu.train(model, shardemu.Parallelism(), train, out=out / "one-device",
                         devices=jax.devices()[:1], rules=RULES)  # fmt: skip
    losses = list(zip(sharded.losses, one.losses, strict=True))
    return {
        "losses_sharded_vs_one_device": losses,
        "max_rel_diff": max(abs(a - b) / abs(b) for a, b in losses),
    }


def count_step() -> dict:
    """One loss-and-gradient of the tiny model counted on tensor 2 x replica 2."""
    model = shardemu.Model(TINY, FAMILY)
    mesh = shardemu.make_mesh(tensor=2, replica=2, devices=jax.devices()[:4])
    shapes, logical = model.abstract_params()
    specs = shardemu.resolve_specs(shapes, logical, RULES, dict(mesh.shape))
    shardings = shardemu.named_shardings(mesh, specs)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)  # fmt: skip
    batch_spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
    batch = {k: jax.ShapeDtypeStruct(s, jnp.int32, sharding=batch_spec)
             for k, s in model.batch_shapes(8, 32).items()}  # fmt: skip
    with unrolled_layers():  # XLA counts a scanned loop's body once: unroll it to count
        ledger = shardemu.count(
            jax.value_and_grad(model.loss), params, batch, mesh=mesh, rules=RULES
        )
    compute = sum(e.flops for e in ledger.events if e.kind == "compute")
    collectives: dict[str, int] = {}
    for e in ledger.events:
        if e.kind == "collective":
            key = f"{e.op} over {e.axis}"
            collectives[key] = collectives.get(key, 0) + e.bytes
    return {
        "xla_flops": compute,
        "analytic_flops": flops.training_step(model, 8, 32),  # matmuls only
        "collective_bytes": collectives,
    }


def plan_full() -> list[dict]:
    """The 8B shape planned on 64 H100s and 64 TPU v5p chips (pipe 2, tensor 8,
    replica 4), bf16, 256 sequences of 2048, full recomputation."""
    model = shardemu.Model(FULL, FAMILY)
    par = shardemu.Parallelism(pipe=2, tensor=8, replica=4)
    train = shardemu.TrainConfig(batch=256, seq=2048, precision="bf16")
    rows = []
    for name in ("h100-sxm", "tpu-v5p"):
        planned = shardemu.plan(model, par, train, shardemu.get_hardware(name), rules=RULES)
        r = planned.report
        rows.append({
            "hardware": name,
            "param_count": r["param_count"],
            "microbatch_size": r["microbatch_size"],
            "step_time_s": r["step_time_s"],
            "mfu": r["utilisation"],
            "device_gb": r["memory_per_device"]["device"]["bytes"] / 1e9,
            "fits": r["memory_per_device"]["device"]["fits"],
            "model_flops_rel_err": r["model_flops_rel_err"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out = args.out or default_run_dir("own_model")
    console = Console()
    real = train_real(out, args.steps)
    console.print(
        f"sharded vs one device: largest relative loss difference {real['max_rel_diff']:.2e}"
    )
    counted = count_step()
    console.print(
        f"one loss-and-gradient counted: XLA {counted['xla_flops']:,.0f} FLOPs, the analytic "
        f"matmuls {counted['analytic_flops']:,} (XLA's adds the elementwise work)"
    )
    table = Table(title="its collectives (tensor 2 x replica 2)")
    table.add_column("collective")
    table.add_column("bytes", justify="right")
    for key, value in sorted(counted["collective_bytes"].items()):
        table.add_row(key, f"{value:,}")
    console.print(table)
    planned = plan_full()
    table = Table(title=f"{FULL.name} planned: pipe 2 x tensor 8 x replica 4, bf16")
    for column in ("hardware", "params", "microbatch", "step s", "MFU", "GB/device", "fits"):
        table.add_column(column)
    for r in planned:
        table.add_row(r["hardware"], f"{r['param_count'] / 1e9:.2f}B", str(r["microbatch_size"]),
                      f"{r['step_time_s']:.3f}", f"{r['mfu']:.1%}", f"{r['device_gb']:.1f}",
                      str(r["fits"]))  # fmt: skip
    console.print(table)
    (out / "own_model.json").write_text(
        json.dumps({"real": real, "counted": counted, "planned": planned}, indent=2)
    )
    console.print(f"wrote {out / 'own_model.json'}")


if __name__ == "__main__":
    main()
