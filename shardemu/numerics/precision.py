"""Numerical precision of a run: `fp32`, `bf16` or `fp16-mixed` (`--precision`).

Mixed precision as Micikevicius et al. 2018 ("Mixed Precision Training", ICLR, section
3) define it and Megatron-LM and ZeRO run it: the weights the model computes with, its
activations and its gradients are 16-bit; the optimizer keeps an FP32 master copy of
the weights and its state in FP32, updates the master, and the 16-bit weights are the
master rounded. With Adam that is 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter (ZeRO,
Rajbhandari et al. 2020, section 3.1), against 16 for FP32 training (4 + 4 + 8), but
with half the bytes streamed, gathered and reduced.

- `bf16`: bfloat16 has FP32's exponent range, so no loss scaling (Kalamkar et al.
  2019, "A Study of BFLOAT16 for Deep Learning Training").
- `fp16-mixed`: float16 gradients underflow without it, so dynamic loss scaling
  (Micikevicius et al. 2018, section 3.2) with PyTorch's `GradScaler` defaults: start at
  2**16, halve on a step whose gradients are not finite (and skip that step's update),
  double after 2000 finite steps in a row.
- `fp8`: `bf16`, with each layer's matmuls on FP8 operands (`models/fp8.py`: E4M3
  forward, E5M2 gradients, per-tensor current scaling), as Transformer Engine runs them
  with BF16 weights and FP32 master weights (Megatron-LM's `--fp8-format hybrid`). The
  attention core, a mixture's router and the logits' matmul stay in BF16, as TE's
  defaults keep them. No loss scaling: each gradient tensor is scaled on its own.

Softmax and LayerNorm statistics run in FP32 whatever the precision (`models/layers.py`;
flax's LayerNorm computes its statistics in FP32), as do the losses (`models/gpt.py`,
`models/bert.py`).

Engines see one transformation (`with_master_weights`) and one update
(`apply_update`): the state an engine stores beside its weights is a `MasterState`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shardemu.config import ModelConfig, TrainConfig
from shardemu.errors import ConfigError
from shardemu.models import Model
from shardemu.parallel.rules import path_str

COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16-mixed": "float16", "fp8": "bfloat16"}
INITIAL_SCALE = 2.0**16  # torch.amp.GradScaler(init_scale=2.**16)
GROWTH_INTERVAL = 2000  # GradScaler(growth_interval=2000); growth 2.0, backoff 0.5


class MasterState(NamedTuple):
    master: Any  # the FP32 weights
    inner: optax.OptState  # the wrapped optimizer's state, over the master weights
    scale: jax.Array  # the loss scale (1 without loss scaling)
    good_steps: jax.Array  # finite steps since the scale last changed


def is_mixed(train: TrainConfig) -> bool:
    return train.precision != "fp32"


def arithmetic(cfg: ModelConfig, precision: str) -> str:
    """The precision whose peak a device computes at: `precision`, or, for `fp32` with a
    16-bit `param_dtype` (pure 16-bit training, no master weights), that width's."""
    if precision != "fp32":
        return precision
    if cfg.fp8_matmuls:
        return "fp8"
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16-mixed"}[cfg.param_dtype]


@functools.lru_cache(maxsize=256)
def compute_model(model: Model, precision: str) -> Model:
    """The model an engine computes with: 16-bit weights for a mixed precision, else
    `model` as given (whose own `param_dtype` then holds everywhere); the same family
    either way. A model whose parameters are not made in its `param_dtype` is refused:
    counted or trained, it would be another precision than the one asked for. Made once
    per model and precision: a grown search asks 22,974 times for 12 answers, and a
    new `Model` builds its Flax module."""
    if precision != "fp32":
        model = model.replace(param_dtype=COMPUTE_DTYPES[precision], fp8_matmuls=precision == "fp8")
    want = jnp.dtype(model.cfg.param_dtype)
    shapes = model.abstract_params()[0]
    ignored = [
        f"{path_str(path)} ({leaf.dtype})"
        for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != want
    ]
    if precision == "fp8" and not _computes_in_fp8(model):
        raise ConfigError(
            f"{model.name} (family {model.family.name!r}): precision 'fp8' runs the layers' "
            f"matmuls on FP8 operands, but its module computes none in FP8 (it ignores "
            f"ModelConfig.fp8_matmuls); compute its projections with "
            f"shardemu.models.fp8.einsum(spec, x, w, cfg.fp8_matmuls), or pass "
            f"dot_general_cls=lambda: fp8.dot_general to its nn.DenseGeneral layers"
        )
    if ignored:
        more = ", ..." if len(ignored) > 4 else ""
        raise ConfigError(
            f"{model.name} (family {model.family.name!r}): precision {precision!r} keeps its "
            f"weights in {want.name} (ModelConfig.param_dtype), but its module makes "
            f"{len(ignored)} parameter(s) in another dtype: {', '.join(ignored[:4])}{more}; "
            f"pass param_dtype=jnp.dtype(cfg.param_dtype) to each of its Flax layers"
        )
    return model


@functools.lru_cache(maxsize=16)
def _computes_in_fp8(model: Model) -> bool:
    """Whether `model`'s forward pass (its initialisation's, traced, nothing
    allocated) casts anything to E4M3."""
    return "f8_e4m3fn" in str(jax.make_jaxpr(model.init_params)(jax.random.key(0)))


def as_compute(params: Any, model: Model) -> Any:
    """`params` (FP32 from an FP32 init or checkpoint, say) in the dtype `model`
    computes with: what an engine stores as its weights."""
    dtype = jnp.dtype(model.cfg.param_dtype)
    return jax.tree.map(lambda x: x.astype(dtype), params)


def with_master_weights(
    tx: optax.GradientTransformation, train: TrainConfig
) -> optax.GradientTransformation:
    """`tx` (clipping included, or not) on FP32 master weights; `tx` itself for `fp32`.

    `update(grads, state, params, finite=None)` takes the gradients of the 16-bit
    weights *already unscaled* to FP32 (`unscale`); `finite` says whether every
    gradient of the model is finite (an engine that updates in pieces passes the
    global answer; None: decided from `grads`). A step that is not finite changes
    neither the master weights nor `tx`'s state, only the loss scale."""
    if not is_mixed(train):
        return tx
    scaled = train.precision == "fp16-mixed"

    def init(params: Any) -> MasterState:
        master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        first = INITIAL_SCALE if scaled else 1.0
        return MasterState(master, tx.init(master), jnp.float32(first), jnp.int32(0))

    def update(
        grads: Any, state: MasterState, params: Any = None, finite: jax.Array | None = None
    ) -> tuple[Any, MasterState]:
        del params  # the update is the master's
        if finite is None:
            finite = all_finite(grads)
        updates, inner = tx.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        scale, good = state.scale, state.good_steps
        if scaled:
            grow = finite & (good + 1 >= GROWTH_INTERVAL)
            scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), scale / 2)
            good = jnp.where(finite & ~grow, good + 1, 0)
        return keep(updates, jax.tree.map(jnp.zeros_like, updates)), MasterState(
            keep(master, state.master), keep(inner, state.inner), scale, good
        )

    return optax.GradientTransformationExtraArgs(init, update)


def scale_fields(opt_state: Any, train: TrainConfig) -> dict[str, float]:
    """A loss-scaled run's metric: `loss_scale`, the scale after the step (halved after
    a step it skipped); empty for other precisions."""
    if train.precision != "fp16-mixed":
        return {}
    return {"loss_scale": float(opt_state.scale)}


def all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def to_fp32(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def host_scale(opt_state: Any) -> float:
    """The loss scale of a staged engine's step, read once to the host (1 without
    loss scaling, or while planning over shapes)."""
    scale = loss_scale(opt_state)
    return float(scale) if isinstance(scale, jax.Array) else 1.0


def loss_scale(opt_state: Any) -> jax.Array | float:
    """What the loss is multiplied by before the backward pass."""
    return opt_state.scale if isinstance(opt_state, MasterState) else 1.0


def unscale(grads: Any, opt_state: Any) -> Any:
    """Gradients of the scaled loss as FP32 gradients of the loss (unchanged for FP32
    training): what `with_master_weights`'s update takes."""
    if not isinstance(opt_state, MasterState):
        return grads
    return jax.tree.map(lambda g: g / opt_state.scale, to_fp32(grads))


def apply_update(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    finite: jax.Array | None = None,
) -> tuple[Any, Any]:
    """(new weights, new state): `tx`'s update applied; with master weights, the new
    weights are the master rounded to the weights' dtype (exactly, not p + (m' - p)),
    and `finite` is passed on (see `with_master_weights`)."""
    if isinstance(opt_state, MasterState):
        _, opt_state = tx.update(grads, opt_state, params, finite=finite)
        return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, params), opt_state
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
