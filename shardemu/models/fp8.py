"""FP8 matmuls with per-tensor current scaling (`--precision fp8`).

Transformer Engine's "hybrid" FP8 format (NVIDIA, Transformer Engine user guide, "FP8
Current Scaling"; `recipe.Float8CurrentScaling(fp8_format=Format.HYBRID)`): a linear
layer's input and weight are cast to E4M3 (largest value 448) for the forward matmul,
the gradient of its output to E5M2 (largest 57344, more range for gradients) for the two
backward matmuls, each tensor scaled first by one FP32 factor, fp8_max / amax(|tensor|),
so that its largest element lands on the format's largest value. The matmul accumulates
in FP32 and its result is divided by the two factors. The saved input and weight are
the FP8 copies, as TE saves them for the backward.

The amax is the whole tensor's, over every device it is split across (a scalar max
all-reduce, which the ledger counts), so a sharded run quantizes exactly as one device
does. TE's current scaling reduces the amax over the tensor-parallel group only.
TE's other per-tensor recipe, delayed scaling (a scale from an amax history of earlier
steps), is not built: it needs state threaded through every engine's step.

On a CPU, XLA converts the FP8 operands to FP32 before the dot (`accounting/matmuls.py`
finds such a dot by its FP8 operands and times it at the profile's `fp8_tflops`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(x scaled into `dtype`'s range and cast to it, the FP32 scale): x ~ q / scale.
    An all-zero tensor keeps scale 1."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    limit = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, limit / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny), 1.0)
    q = jnp.clip(x.astype(jnp.float32) * scale, -limit, limit).astype(dtype)
    return q, scale


def scaled(
    product: Callable[[jax.Array, jax.Array], jax.Array],
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`product(x, w)` (a bilinear map: an einsum or dot_general whose result is x's
    dtype, accumulated in FP32) computed on FP8 operands: x and w in E4M3 forward, the
    output gradient in E5M2 backward. The operands are widened to x's dtype, which holds
    every FP8 value exactly, and the products stay in it, so that a tensor-parallel
    partial sum is reduced in 16 bits, as TE's BF16-output FP8 GEMM leaves it."""

    def forward(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple]:
        if x.dtype != w.dtype:  # the layers promote both to the compute dtype first
            raise TypeError(f"FP8 matmul of {x.dtype} by {w.dtype}: promote them to one dtype")
        (xq, sx), (wq, sw) = quantize(x, E4M3), quantize(w, E4M3)
        y = product(xq.astype(x.dtype), wq.astype(x.dtype)) / (sx * sw).astype(x.dtype)
        return y, (xq, sx, wq, sw)

    def backward(saved: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        xq, sx, wq, sw = saved  # the output's dtype, g's, is the operands'
        gq, sg = quantize(g, E5M2)
        _, vjp = jax.vjp(product, xq.astype(g.dtype), wq.astype(g.dtype))
        dx, dw = vjp(gq.astype(g.dtype))
        return dx / (sg * sw).astype(g.dtype), dw / (sg * sx).astype(g.dtype)

    @jax.custom_vjp
    def fp8_product(x: jax.Array, w: jax.Array) -> jax.Array:
        return forward(x, w)[0]

    fp8_product.defvjp(forward, backward)
    return fp8_product


def einsum(spec: str, x: jax.Array, w: jax.Array, fp8: bool) -> jax.Array:
    """`jnp.einsum(spec, x, w)`, on FP8 operands when `fp8` (the layer's matmul)."""
    if not fp8:
        return jnp.einsum(spec, x, w)
    dtype = x.dtype
    product = lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=dtype)  # noqa: E731
    return scaled(product)(x, w)


def dot_general(
    x: jax.Array, w: jax.Array, dimension_numbers: Any, precision: Any = None, **kwargs: Any
) -> jax.Array:
    """`jax.lax.dot_general` on FP8 operands, for `nn.DenseGeneral(dot_general_cls=...)`."""
    del kwargs  # the result type is the operands' (`scaled`)
    dtype = x.dtype

    def product(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.dot_general(a, b, dimension_numbers, precision, preferred_element_type=dtype)

    return scaled(product)(x, w)
