"""Splitting a global batch into chunks (accumulation steps) without moving data between
replicas, and accumulating their gradients.

Chunk k holds examples k, k+n, k+2n, ...: with the batch split over `replica` in
contiguous blocks of B/r, each block holds B/(r n) examples of every chunk, so the split
is a local reshape on every device (no communication) as long as n divides B/r.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from shardemu.models import LossTerms


def split(tree: Any, n: int) -> Any:
    """[B, ...] leaves -> [n, B/n, ...]: chunk k gets examples k, k+n, k+2n, ..."""

    def one(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)

    return jax.tree.map(one, tree)


def accumulate(
    loss_sums: Callable[[Any, dict], tuple[LossTerms, Any]],
    counts: LossTerms,
    params: Any,
    batch: dict,
    steps: int,
    scale: jax.Array | float = 1.0,
) -> tuple[jax.Array, Any, Any]:
    """Loss, gradients and auxiliary output over `steps` accumulation chunks of `batch`,
    the loss multiplied by `scale` (mixed precision's loss scale) before the backward.

    Each chunk's loss is its summed terms divided by the *whole* batch's counts, so the
    chunks' losses and gradients add up to exactly the big batch's (the mean over all
    examples, or over all masked tokens for BERT), not to a mean of chunk means.
    """

    def chunk_loss(p: Any, chunk: dict) -> tuple[jax.Array, Any]:
        sums, aux = loss_sums(p, chunk)
        return sum(s / c for s, c in zip(sums, counts, strict=True)) * scale, aux

    grad_fn = jax.value_and_grad(chunk_loss, has_aux=True)
    if steps == 1:
        (loss, aux), grads = grad_fn(params, batch)
        return loss, grads, aux

    def body(carry: tuple[jax.Array, Any], chunk: dict) -> tuple[tuple[jax.Array, Any], Any]:
        loss, grads = carry
        (chunk_l, aux), chunk_g = grad_fn(params, chunk)
        return (
            loss + chunk_l,
            jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads, chunk_g),
        ), aux

    # 16-bit gradients add up in FP32, as Megatron-LM's `main_grad` buffers do
    zero = (
        jnp.zeros((), jnp.float32),
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params),
    )
    (loss, grads), aux = jax.lax.scan(body, zero, split(batch, steps))
    return loss, grads, aux
