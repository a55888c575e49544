"""Transformer building blocks with logical axis names on every parameter.

Shapes use one letter per dimension: b batch, s sequence (q query / k key positions),
d embed, h heads, k head_dim, f mlp. Parameters carry `nn.LogicallyPartitioned`
metadata, so `jax.eval_shape(module.init, ...)` yields every parameter's logical axes
without allocating it; `shardemu.parallel.rules` maps those names to mesh axes.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import flax.linen as nn
import jax
import jax.numpy as jnp

from shardemu.config import ModelConfig
from shardemu.models import fp8
from shardemu.parallel.rules import constrain

Init = Callable[..., jax.Array]

# the residual stream between matmuls (layer norms, residual adds): its sequence is
# split over `tensor` under sequence parallelism (`parallel/rules.py`)
ACT_BSD = ("batch", "residual_sequence", "embed")
# the whole sequence, as a column-parallel matmul takes its input
ACT_BSD_WHOLE = ("batch", "sequence", "embed")
ACT_BSHK = ("batch", "sequence", "heads", "head_dim")
# keys and values over the whole sequence: under context parallelism each device's
# queries attend to every position, so they are all-gathered (`parallel/rules.py`)
KV_BSHK = ("batch", None, "heads", "head_dim")
ACT_BSF = ("batch", "sequence", "mlp")


def normal(std: float, axes: tuple[str, ...]) -> Init:
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def zeros(axes: tuple[str, ...]) -> Init:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def ones(axes: tuple[str, ...]) -> Init:
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def projection_inits(
    cfg: ModelConfig, kernel_axes: tuple[str, ...], n_out: int, std: float | None = None
) -> tuple[Init, Init]:
    """A projection's kernel and bias initialisers: the kernel named `kernel_axes`, the
    bias named by their last `n_out` (output) names."""
    return normal(cfg.init_std if std is None else std, kernel_axes), zeros(kernel_axes[-n_out:])


def dense(
    cfg: ModelConfig,
    features: int | tuple[int, ...],
    kernel_axes: tuple[str, ...],
    name: str | None = None,
    in_axes: int | tuple[int, ...] = -1,
    std: float | None = None,
) -> nn.DenseGeneral:
    """A DenseGeneral whose kernel is named `kernel_axes` and whose bias is named by the
    output part of them."""
    n_out = 1 if isinstance(features, int) else len(features)
    kernel_init, bias_init = projection_inits(cfg, kernel_axes, n_out, std)
    return nn.DenseGeneral(
        features,
        axis=in_axes,
        kernel_init=kernel_init,
        bias_init=bias_init,
        param_dtype=jnp.dtype(cfg.param_dtype),
        # FP8 operands (`--precision fp8`): Flax calls the class for the product
        dot_general_cls=(lambda: fp8.dot_general) if cfg.fp8_matmuls else None,
        name=name,
    )


def layer_norm(cfg: ModelConfig, name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=cfg.layer_norm_eps,
        scale_init=ones(("embed",)),
        bias_init=zeros(("embed",)),
        param_dtype=jnp.dtype(cfg.param_dtype),
        name=name,
    )


def embed(cfg: ModelConfig, rows: int, row_axis: str, name: str | None = None) -> nn.Embed:
    return nn.Embed(
        rows,
        cfg.embed_dim,
        embedding_init=normal(cfg.init_std, (row_axis, "embed")),
        param_dtype=jnp.dtype(cfg.param_dtype),
        name=name,
    )


class Projection(nn.Module):
    """The kernel and bias of a DenseGeneral from `dense` (same names, same
    initialisers), for callers that fuse several projections into one matmul."""

    cfg: ModelConfig
    features: tuple[int, ...]
    kernel_axes: tuple[str, ...]

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.param_dtype)
        kernel_init, bias_init = projection_inits(cfg, self.kernel_axes, len(self.features))
        kernel = self.param("kernel", kernel_init, (cfg.embed_dim, *self.features), dtype)
        bias = self.param("bias", bias_init, self.features, dtype)
        return kernel, bias


class SelfAttention(nn.Module):
    """Multi-head self-attention (Vaswani et al. 2017), Megatron-sharded: Q, K, V are
    column-parallel over heads, the output projection row-parallel over heads.

    Q, K and V are one matmul, as Megatron-LM's fused `query_key_value` (Shoeybi et al.
    2019, Section 3): its backward sums the three input gradients on each device before
    the one all-reduce over `tensor`, where three matmuls would all-reduce three. The
    parameters stay three (`query`, `key`, `value`), named as the reference models'.
    """

    cfg: ModelConfig
    out_std: float

    @nn.compact
    def __call__(self, x_bsd: jax.Array, mask_bqk: jax.Array) -> jax.Array:
        cfg = self.cfg
        hk = (cfg.num_heads, cfg.head_dim)
        qkv_axes = ("embed", "heads", "head_dim")
        x_bsd = constrain(x_bsd, ACT_BSD_WHOLE)
        weights = [Projection(cfg, hk, qkv_axes, name=n)() for n in ("query", "key", "value")]
        kernel_dchk = jnp.stack([w for w, _ in weights], axis=1)
        bias_chk = jnp.stack([b for _, b in weights])
        x_bsd, kernel_dchk, bias_chk = nn.dtypes.promote_dtype(x_bsd, kernel_dchk, bias_chk)
        qkv_bschk = fp8.einsum("bsd,dchk->bschk", x_bsd, kernel_dchk, cfg.fp8_matmuls)
        qkv_bschk = qkv_bschk + bias_chk
        qkv_bschk = constrain(qkv_bschk, ("batch", "sequence", None, "heads", "head_dim"))
        q_bshk, k_bshk, v_bshk = (qkv_bschk[:, :, i] for i in range(3))
        k_bshk, v_bshk = constrain(k_bshk, KV_BSHK), constrain(v_bshk, KV_BSHK)
        scores_bhqk = jnp.einsum("bqhk,bshk->bhqs", q_bshk, k_bshk) / jnp.sqrt(cfg.head_dim)
        scores_bhqk = jnp.where(mask_bqk[:, None], scores_bhqk, jnp.finfo(scores_bhqk.dtype).min)
        # softmax in float32, then back to the activations' type (mixed precision)
        probs_bhqk = jax.nn.softmax(scores_bhqk.astype(jnp.float32), axis=-1).astype(v_bshk.dtype)
        ctx_bshk = constrain(jnp.einsum("bhqs,bshk->bqhk", probs_bhqk, v_bshk), ACT_BSHK)
        out = dense(
            cfg, cfg.embed_dim, ("heads", "head_dim", "embed"), "out", (-2, -1), self.out_std
        )
        return constrain(out(ctx_bshk), ACT_BSD)


class Mlp(nn.Module):
    """d -> d_ff -> d with GELU; column-parallel then row-parallel over `mlp`."""

    cfg: ModelConfig
    out_std: float

    @nn.compact
    def __call__(self, x_bsd: jax.Array) -> jax.Array:
        cfg = self.cfg
        h_bsf = dense(cfg, cfg.mlp_dim, ("embed", "mlp"), "fc_in")(constrain(x_bsd, ACT_BSD_WHOLE))
        h_bsf = constrain(nn.gelu(h_bsf, approximate=cfg.gelu_approximate), ACT_BSF)
        out = dense(cfg, cfg.embed_dim, ("mlp", "embed"), "fc_out", std=self.out_std)
        return constrain(out(h_bsf), ACT_BSD)


_UNROLLED = contextvars.ContextVar("shardemu_unrolled_layers", default=False)


@contextmanager
def unrolled_layers() -> Iterator[None]:
    """Trace layer stacks written out layer by layer instead of as a loop. XLA's cost
    analysis counts a loop body once whatever its trip count, so a whole model is
    counted unrolled (`resident/trainer.py`); training runs the loop."""
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)


def layer_stack(
    block: type[nn.Module], cfg: ModelConfig, length: int | None = None, name: str | None = None
) -> nn.Module:
    """`length` (default `cfg.num_layers`) copies of `block`, parameters stacked on a
    leading `layers` axis and applied with `nn.scan` (one traced body, whatever the
    depth). The block is called as `block(x, mask) -> (x, None)`. A pipeline stage is a
    stack of its own length applied to its slice of the stacked parameters."""
    length = cfg.num_layers if length is None else length
    with _SCANNING:
        scanned = _scanned(block, length, _UNROLLED.get())
    return scanned(cfg, name=name)


# `nn.scan` makes a subclass of `block`, and Flax's dataclass transform removes and puts
# back the fields of every base class while it does (flax/linen/kw_only_dataclasses.py):
# two threads tracing models at once (a search's background counts) could see a base
# class half rewritten ("dictionary changed size during iteration"). So each scanned
# class is made once, one at a time.
_SCANNING = threading.Lock()


@functools.cache
def _scanned(block: type[nn.Module], length: int, unrolled: bool) -> type[nn.Module]:
    """`block` scanned `length` times. Without `check_constancy_invariants=False` Flax
    traces the body once more, to check that broadcast variables and outputs do not
    change from layer to layer (flax/core/axes_scan.py, `scan_fn`); the stack has neither
    (its parameters are scanned, the mask is a broadcast input), so a traced layer piece
    traces its layer once: the same HLO and counts, the test suite's test time 514 -> 469
    s (one run each), `benchmarks/search.py --case gpu` 40 -> 38 s (two runs each)."""
    return nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=length,
        unroll=length if unrolled else 1,
        metadata_params={nn.PARTITION_NAME: "layers"},
        check_constancy_invariants=False,
    )
