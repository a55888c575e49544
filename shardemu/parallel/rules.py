"""Logical axis names -> mesh axes: one rules table, resolved strictly.

Models name every parameter and key activation dimension with a logical axis:

    batch     examples in the global batch           embed     model width d
    sequence  token positions of an activation       heads     attention heads A
    residual_sequence  token positions of the residual stream (sequence parallelism)
    head_dim  width of one head d/A                  mlp       feed-forward width d_ff
    kv_heads  key/value heads of grouped-query attention (Llama)
    vocab     vocabulary rows V                      layers    stacked transformer layers L
    position  rows of a learned position table       segment   rows of BERT's segment table
    classes   outputs of a small classifier head     embed_out second width of a d x d matrix
    predictions  BERT's masked positions a sequence (its masked-LM head's rows)
    experts   a mixture of experts' experts          capacity  token slots of an expert
    expert_batch  the batch of tokens dispatched to experts (split over replica only)

A rules table maps each logical name to a mesh axis (or None: replicated). The default,
`megatron_rules()`, is Megatron-LM tensor parallelism (Shoeybi et al. 2019, "Megatron-LM",
Section 3): the embedding is vocab-parallel, QKV and the first MLP matrix are
column-parallel (split on heads / mlp), the attention output and second MLP matrix are
row-parallel (split on their input heads / mlp), and the batch is split over `replica`
and `expert`. A mixture of experts' experts are split over `expert` (GShard, Lepikhin et
al. 2020): tokens are dispatched to them and combined back by all-to-alls over it.
Stacked layers are split over `pipe` in contiguous blocks: pipeline stages (GPipe-style,
Huang et al. 2019).

Resolution is strict, unlike flax's and t5x's: an unknown logical name, a mesh axis used
twice in one tensor, or an axis that does not divide a dimension is an error naming the
parameter, the dimension, the sizes and the fix.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardemu.errors import ShardingError
from shardemu.parallel.advice import Indivisible, indivisible_message, sizes_advice

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]
LogicalAxes = tuple[str | None, ...]
Sizes = Mapping[str, int]  # mesh axis name -> its size


def megatron_rules(
    sequence_parallel: bool = False,
    expert_parallel: bool = False,
    context_parallel: bool = False,
    kv_heads_split: bool = True,
) -> Rules:
    """Megatron-style tensor parallelism over `tensor`, data parallelism over `replica`.

    Grouped-query attention's key/value heads are split over `tensor` with the query
    heads; with `kv_heads_split` False (a tensor size that does not divide them) they
    are replicated on every tensor device instead, each device computing and keeping
    all of them. Megatron-Core refuses that case (`divide(num_query_groups, tp)` in its
    attention); vLLM replicates key/value heads when tensor parallelism exceeds them
    (`QKVParallelLinear`, `num_kv_head_replicas`), holding one a device where this
    holds all.

    With `expert_parallel`, a mixture of experts' experts are split over `expert`, and
    the batch over `replica` and `expert` both (expert parallelism within data
    parallelism: GShard, Lepikhin et al. 2020, Section 3.2; Megatron-Core's expert
    parallel groups); without, the experts are whole on every device and `expert` is
    unused. With `sequence_parallel`, the residual stream between the tensor-parallel matmuls
    (layer norms, residual adds) is split over `tensor` by
    sequence, as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", Section 4.2.2) do: each all-reduce over `tensor` becomes a
    reduce-scatter and an all-gather of the same bytes, and that work and its
    activations are no longer repeated on every tensor device.

    With `context_parallel`, every sequence is split over `context` (its residual
    stream too, and over `tensor` beside it under sequence parallelism): each device
    holds its share of the queries and all-gathers the keys and values of the whole
    sequence before attention (the attention layers name their keys' and values'
    sequence None), as Llama 3's all-gather context parallelism does (Dubey et al.
    2024, §3.3.2). XLA's computation is the whole masked score matrix either way, so
    each device's share of it is equal, the balance Llama 3 and Megatron-LM get from
    two chunks a rank under causal masking.
    """
    sequence = "context" if context_parallel else None
    residual = ("context", "tensor") if context_parallel else "tensor"
    return (
        ("batch", ("replica", "expert") if expert_parallel else "replica"),
        ("expert_batch", "replica"),
        ("experts", "expert" if expert_parallel else None),
        ("capacity", None),
        ("sequence", sequence),
        ("predictions", None),
        ("residual_sequence", residual if sequence_parallel else sequence),
        ("embed", None),
        ("embed_out", None),
        ("heads", "tensor"),
        ("kv_heads", "tensor" if kv_heads_split else None),
        ("head_dim", None),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
        ("layers", "pipe"),
        ("position", None),
        ("segment", None),
        ("classes", None),
    )


def rules_or_default(
    rules: Rules | None,
    sequence_parallel: bool,
    experts: int = 1,
    context: int = 1,
    *,
    tensor: int = 1,
    kv_heads: int = 0,
) -> Rules:
    """`rules` as given, or the default table with the run's sequence parallelism and,
    on a mesh of `experts` > 1 expert-parallel groups, expert parallelism, and of
    `context` > 1 context-parallel groups, context parallelism; a model's `kv_heads`
    key/value heads (0: not known) split over `tensor` where it divides them and
    replicated where it does not (`megatron_rules`)."""
    if rules is not None:
        return rules
    split = kv_heads == 0 or kv_heads % tensor == 0
    return megatron_rules(sequence_parallel, experts > 1, context > 1, split)


def axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple: () for None, (axis,) for one."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def validate_rules(
    rules: Rules, mesh_axis_names: Sequence[str] | None
) -> dict[str, tuple[str, ...]]:
    """Check a rules table and return it as a dict; duplicates raise, and so do mesh
    axes `mesh_axis_names` lacks (unchecked when it is None: no mesh at hand)."""
    table: dict[str, tuple[str, ...]] = {}
    for logical, axes in rules:
        if logical in table:
            raise ShardingError(
                f"rules table maps logical axis {logical!r} twice; keep one entry per name"
            )
        for axis in axes_tuple(axes):
            if mesh_axis_names is not None and axis not in mesh_axis_names:
                raise ShardingError(
                    f"rule {logical!r} -> {axes!r} names mesh axis {axis!r}, "
                    f"but the mesh has only {tuple(mesh_axis_names)}"
                )
        table[logical] = axes_tuple(axes)
    return table


def logical_to_spec(
    logical_axes: LogicalAxes,
    rules: Rules,
    what: str = "tensor",
    mesh_axis_names: Sequence[str] | None = None,
) -> PartitionSpec:
    """The PartitionSpec for one tensor's logical axes (no size checks), as strict as
    the rest: a name mapped twice is an error, not the last entry winning, and so is a
    mesh axis `mesh_axis_names` (when given) lacks."""
    table = validate_rules(rules, mesh_axis_names)
    used: dict[str, str] = {}
    entries: list[MeshAxes] = []
    for name in logical_axes:
        if name is None:
            entries.append(None)
            continue
        if name not in table:
            raise ShardingError(
                f"{what}: logical axis {name!r} has no rule; add ({name!r}, mesh_axis or None) "
                f"to the rules table (known: {', '.join(table)})"
            )
        mesh_axes = table[name]
        for axis in mesh_axes:
            if axis in used:
                raise ShardingError(
                    f"{what}: mesh axis {axis!r} would shard both {used[axis]!r} and {name!r}; "
                    f"a mesh axis can split only one dimension of a tensor; change one rule"
                )
            used[axis] = name
        entries.append(
            None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
        )
    return PartitionSpec(*entries)


def check_divisible(
    what: str,
    shape: Sequence[int],
    logical_axes: LogicalAxes,
    spec: PartitionSpec,
    axis_sizes: Mapping[str, int],
) -> None:
    """Raise if a sharded dimension is not divisible by its mesh axes' total size."""
    for bad in indivisible(shape, logical_axes, spec, axis_sizes)[:1]:
        raise ShardingError(f"{what}: {bad.sentence()}")


def indivisible(
    shape: Sequence[int], logical_axes: LogicalAxes, spec: PartitionSpec, axis_sizes: Sizes
) -> list[Indivisible]:
    """The dimensions of a tensor that its mesh axes' total size does not divide."""
    out = []
    for dim, (size, name, axes) in enumerate(zip(shape, logical_axes, spec, strict=True)):
        n = math.prod(axis_sizes[a] for a in axes_tuple(axes))
        if size % n:
            out.append(Indivisible(dim, name, size, axes, n))
    return out


def path_str(path: tuple) -> str:
    """'blocks/attn/query/kernel' for a pytree key path."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def resolve_specs(
    shapes: object,
    logical: object,
    rules: Rules,
    axis_sizes: Mapping[str, int],
) -> object:
    """A PartitionSpec per leaf of `shapes` (arrays or ShapeDtypeStructs), with `logical`
    the matching tree of logical-axis tuples. Checks every rule and every divisibility,
    and reports all parameters that fail in one error, so they can be fixed at once."""
    validate_rules(rules, tuple(axis_sizes))
    problems: list[tuple[str, str, Indivisible]] = []  # path, name, its first failure
    splits: dict[str, list[int]] = {}  # mesh axis -> the sizes of the dimensions it splits alone

    def one(path: tuple, shape_leaf: jax.ShapeDtypeStruct, axes: LogicalAxes) -> PartitionSpec:
        what = f"parameter {path_str(path)!r} {tuple(shape_leaf.shape)}"
        if len(axes) != len(shape_leaf.shape):
            raise ShardingError(
                f"{what}: has {len(axes)} logical axes {axes} for its {len(shape_leaf.shape)} "
                f"dimensions; name every dimension (None for one that is never split) in its "
                f"nn.with_logical_partitioning"
            )
        spec = logical_to_spec(axes, rules, what)
        for size, mesh_axes in zip(shape_leaf.shape, spec, strict=True):
            if len(split := axes_tuple(mesh_axes)) == 1:
                splits.setdefault(split[0], []).append(size)
        for bad in indivisible(shape_leaf.shape, axes, spec, axis_sizes)[:1]:
            problems.append((path_str(path), what, bad))
        return spec

    specs = jax.tree_util.tree_map_with_path(one, shapes, logical, is_leaf=is_logical_axes)
    failing = [a for a, sizes in splits.items() if any(n % axis_sizes[a] for n in sizes)]
    advice = f". {sizes_advice(splits, failing)}" if failing else ""
    if len(problems) == 1:
        _, what, bad = problems[0]
        raise ShardingError(f"{what}: {bad.sentence()}{advice}")
    if problems:
        raise ShardingError(indivisible_message([(p, bad) for p, _, bad in problems]) + advice)
    return specs


def is_logical_axes(x: object) -> bool:
    """Whether `x` is one tensor's logical axes (a tree leaf of them)."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def named_shardings(mesh: Mesh, specs: object) -> object:
    """`NamedSharding(mesh, spec)` for every spec in a tree."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


# ---- activations ---------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "shardemu_activation_rules", default=None
)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """While tracing inside this context, `constrain` pins activations to the mesh.

    Flax's own `nn.with_logical_constraint` needs a global mesh, and Flax's
    `DenseGeneral` cannot take one: with a mesh set, its parameter shape check unboxes
    a multi-dimensional kernel at its flat init shape against the kernel's full-rank
    names, and fails. So a model of your own pins its activations with `constrain`."""
    validate_rules(rules, mesh.axis_names)
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


_NAMED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "shardemu_named_activations", default=None
)


@contextlib.contextmanager
def recording_names() -> Iterator[set[str]]:
    """While tracing inside this context, every logical name an activation is given
    (`constrain`, `named`) is collected into the set it yields: what a model names."""
    names: set[str] = set()
    token = _NAMED.set(names)
    try:
        yield names
    finally:
        _NAMED.reset(token)


def named(*logical_axes: LogicalAxes) -> None:
    """Note activations' logical names for `recording_names`: what a layer that
    resolves its own specs (`shard_map`) calls, as `constrain` does for itself."""
    names = _NAMED.get()
    if names is not None:
        names.update(a for axes in logical_axes for a in axes if a is not None)


def active_rules() -> tuple[Mesh, Rules] | None:
    """The mesh and rules `activation_rules` set while tracing, or None outside it: what
    a layer that writes its own collectives (`shard_map`) needs."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """Annotate an activation with its logical axes; a no-op outside `activation_rules`."""
    named(logical_axes)
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(logical_axes, rules, f"activation {logical_axes}", mesh.axis_names)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ---- the parameter table -------------------------------------------------------------


@dataclass(frozen=True)
class ParamRow:
    """One parameter as sharded: what `shardemu describe` prints."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: LogicalAxes
    spec: PartitionSpec
    bytes_per_device: int

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "logical_axes": list(self.logical_axes),
            "spec": [list(axes_tuple(a)) if isinstance(a, tuple) else a for a in self.spec],
            "bytes_per_device": self.bytes_per_device,
        }


def shard_shape(shape: Sequence[int], spec: PartitionSpec, axis_sizes: Mapping[str, int]):
    """The per-device block shape of an evenly sharded array."""
    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(
        size // math.prod(axis_sizes[a] for a in axes_tuple(axes))
        for size, axes in zip(shape, padded, strict=True)
    )


def param_table(
    shapes: object, logical: object, specs: object, axis_sizes: Mapping[str, int]
) -> list[ParamRow]:
    """Rows for every parameter, in tree order."""
    rows = []
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_logical = jax.tree.leaves(logical, is_leaf=is_logical_axes)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), axes, spec in zip(flat_shapes, flat_logical, flat_specs, strict=True):
        block = shard_shape(leaf.shape, spec, axis_sizes)
        rows.append(
            ParamRow(
                path=path_str(path),
                shape=tuple(leaf.shape),
                dtype=str(leaf.dtype),
                logical_axes=axes,
                spec=spec,
                bytes_per_device=math.prod(block) * leaf.dtype.itemsize,
            )
        )
    return rows
