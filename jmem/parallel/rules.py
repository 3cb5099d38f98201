"""Logical axis names -> mesh axes: one `Rules` object for parameters and activations.

A model names each parameter dimension with a logical axis (`embed`, `mlp`,
`heads`, `kv_heads`, `vocab`, `layers`, `exp`) in a table keyed by state path
(`jmem.models.LOGICAL_AXES`); activations use `batch`, `length` and `embed`
(`ACTIVATION_AXES`, pinned by `constrain` inside an `activation_sharding`
block; `length=tensor` gives Megatron sequence parallelism). `Rules`
maps each logical name to zero or more mesh axes. The defaults give Megatron
tensor parallelism (heads, kv_heads and mlp on `tensor`: column-parallel
wq/wk/wv/w_gate/w_up, row-parallel wo/w_down, and the embedding and head split
over the vocabulary where it divides), experts on `expert` and the batch on the
data axes; ZeRO (`jmem.parallel.zero`) adds the data axes to
whatever it shards. The table names the flattened `heads x head_dim` columns
of the attention weights, so `check_heads` checks the head counts themselves
(tensor parallelism needs whole heads per device).

Example:
    >>> rules = Rules.parse("embed=fsdp,length=tensor")    # defaults + overrides
    >>> rules.spec(("layers", "embed", "mlp"), (8, 512, 1408), mesh)
    PartitionSpec(None, 'fsdp', 'tensor')
    >>> params = shard(params, rules, mesh)                  # a user's own model: logical_axes=MY_TABLE
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem.parallel.mesh import AXES, check_mesh
from jmem.pytree import key_name

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": (),
    "embed": (),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": (),
    "exp": ("expert",),
    "stage": ("stage",),
}
"""Default mapping. `length` stays whole (set `length=tensor` for sequence
sharding between blocks). `vocab` is in `WHERE_DIVISIBLE`."""

WHERE_DIVISIBLE: frozenset[str] = frozenset({"vocab"})
"""Default rules that apply only where the dimension divides by the mesh axes,
and otherwise leave it whole. The embedding and head shard their vocabulary
over `tensor` (a vocabulary-parallel head and cross-entropy: each device
computes the logits of its slice, XLA reduces the softmax statistics), except
for vocabularies such as the 259 byte-level tokens that do not divide. A
`vocab=...` rule given by the user is strict like any other."""


class ShardingError(ValueError):
    """A rule or a dimension that cannot be sharded as asked."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis name -> tuple of mesh axes (empty tuple: replicated).

    Build with `Rules.parse(spec)`: the defaults plus overrides from a string
    `"embed=fsdp,mlp=tensor,vocab=none,batch=data+fsdp"` or a dict. The logical names
    are those of `DEFAULT_RULES`; a user's own model that names its dimensions
    otherwise passes its names as `extra_names`.
    """

    table: tuple[tuple[str, tuple[str, ...]], ...]
    where_divisible: frozenset[str] = WHERE_DIVISIBLE

    @classmethod
    def parse(cls, spec: "str | Mapping[str, Any] | Rules | None" = None, *,
              extra_names: Sequence[str] = ()) -> "Rules":
        """Defaults updated by `spec` (see the class docstring).

        Args:
            spec: overrides `"logical=mesh_axes,..."`, a dict of the same, a `Rules`, or None.
            extra_names: logical names accepted beside `DEFAULT_RULES`' (a user's own table).

        Raises:
            ShardingError: a logical name or mesh axis that does not exist, a logical name
                given twice, or an entry that is not `name=axes`.

        Example:
            >>> Rules.parse("embed=fsdp,length=tensor").mesh_axes("embed")
            ('fsdp',)
        """
        if isinstance(spec, Rules):
            return spec
        table = dict(DEFAULT_RULES)
        if isinstance(spec, str):
            items = []
            for part in (p.strip() for p in spec.split(",")):
                if not part:
                    continue
                if "=" not in part:
                    raise ShardingError(f"sharding rule {part!r} is not 'logical=mesh_axes'; example: 'embed=fsdp'")
                name, axes = (s.strip() for s in part.split("=", 1))
                items.append((name, axes))
        elif spec is None:
            items = []
        elif isinstance(spec, Mapping):
            items = list(spec.items())
        else:
            raise ShardingError(f"sharding rules {spec!r}: give a string like 'embed=fsdp' or a dict")
        known = (*DEFAULT_RULES, *(n for n in extra_names if n not in DEFAULT_RULES))
        seen: set[str] = set()
        for name, axes in items:
            if name not in known:
                raise ShardingError(f"sharding rule {name}={axes}: unknown logical axis {name!r}; "
                                    f"accepted: {', '.join(known)}")
            if name in seen:
                raise ShardingError(f"sharding rule for {name!r} is given twice; give each logical axis once")
            seen.add(name)
            table[name] = _mesh_axes(name, axes)
        for name in extra_names:  # known from now on; without a rule, replicated
            table.setdefault(name, ())
        given = {name for name, _ in items}
        return cls(tuple(sorted(table.items())), WHERE_DIVISIBLE - given)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """Mesh axes of one logical name (empty for None or a name without a rule)."""
        if logical is None:
            return ()
        return dict(self.table).get(logical, ())

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
             mesh: Mesh | None = None, *, name: str = "array") -> P:
        """PartitionSpec for an array whose dims have `logical_axes`.

        A mesh axis is used at most once per array (the first dim that asks wins),
        and axes of size 1 in `mesh` are dropped. A default rule in `WHERE_DIVISIBLE`
        leaves a dimension it does not divide whole.

        Raises:
            ShardingError: `shape[i]` is not divisible by the size of its mesh axes, an unknown logical
                name (a typo would leave the dim whole without a word), or more names than dims.
        """
        known = dict(self.table)
        unknown = [a for a in logical_axes if a is not None and a not in known]
        if unknown:
            raise ShardingError(f"{name}: unknown logical axis {unknown[0]!r}; accepted: None, one of "
                                f"{', '.join(known)}, or a name of one's own given to "
                                "Rules.parse(..., extra_names=...)")
        if shape is not None and len(logical_axes) != len(shape):
            raise ShardingError(f"{name}: {len(logical_axes)} logical axes {tuple(logical_axes)} for an array of "
                                f"shape {tuple(shape)}; accepted: one name (or None) per dim")
        used: set[str] = set()
        out = []
        for i, logical in enumerate(logical_axes):
            axes = tuple(a for a in self.mesh_axes(logical) if a not in used
                         and (mesh is None or mesh.shape.get(a, 1) > 1))
            if mesh is not None and shape is not None and axes:
                size = math.prod(mesh.shape[a] for a in axes)
                if shape[i] % size and logical in self.where_divisible:
                    axes = ()
                elif shape[i] % size:
                    raise ShardingError(
                        f"{name}: dim {i} ({logical}) has size {shape[i]}, not divisible by mesh axes "
                        f"{'+'.join(axes)} of size {size}; change the mesh or the rule "
                        f"'{logical}={'+'.join(axes)}' (e.g. '{logical}=none')")
            used.update(axes)
            out.append(_entry(axes))
        return P(*out)

    def __str__(self) -> str:
        return ",".join(f"{k}={'+'.join(v) or 'none'}" for k, v in self.table)


class _Sizes:
    """A stand-in for a `Mesh` in `Rules.spec` when only the axis sizes are known."""

    def __init__(self, shape: Mapping[str, int]):
        self.shape = dict(shape)


HEAD_WEIGHTS: tuple[tuple[str, str], ...] = (("layers.wq.kernel", "heads"), ("layers.wo.kernel", "heads"),
                                              ("layers.wk.kernel", "kv_heads"), ("layers.wv.kernel", "kv_heads"))
"""The attention weights whose `heads` / `kv_heads` dim is the flattened `heads x head_dim` columns."""


def check_heads(n_heads: int, n_kv_heads: int, rules: "Rules | str | Mapping | None",
                mesh: "Mesh | Mapping[str, int]", *, logical_axes: Mapping | None = None, what: str = "") -> None:
    """Refuse a sharding that would cut an attention head across devices.

    The parameter table names the `heads x head_dim` columns of `wq`/`wo` `heads` and
    those of `wk`/`wv` `kv_heads`, so `Rules.spec` sees only the flattened width
    (`4 x 16 = 64` divides by 8). Tensor parallelism needs whole heads on every device:
    each head COUNT must divide by the size of the mesh axes that its dim gets (those
    `Rules.spec` gives it, after the axes earlier dims take). Otherwise XLA reshards
    inside attention with collective-permutes and all-to-alls, which also cannot run
    inside a 1F1B tick.

    Args:
        n_heads, n_kv_heads: the model's query and key/value head counts.
        rules: the sharding rules (a `Rules`, a rules string or dict, or None: defaults).
        mesh: a `Mesh`, or a dict of axis sizes (an axis of size -1 is not checked).
        logical_axes: the parameter table (default: jmem's Llama + MoE table).
        what: prefix of the message (e.g. the flags that chose the mesh).

    Raises:
        ShardingError: names the head count, the mesh axes and their size, and what is accepted.

    Example:
        >>> check_heads(4, 2, None, {"tensor": 4})
        Traceback (most recent call last):
        ShardingError: n_kv_heads=2 is not divisible by mesh axes tensor of size 4 ...
    """
    rules = Rules.parse(rules)
    table = default_logical_axes() if logical_axes is None else logical_axes
    sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
    unknown = {a for a, v in sizes.items() if v == -1}  # a -1 axis: checked once the mesh is made
    shape = {a: v for a, v in sizes.items() if v != -1}
    counts = {"heads": ("n_heads", n_heads), "kv_heads": ("n_kv_heads", n_kv_heads)}
    for path, logical in HEAD_WEIGHTS:
        axes_of = table.get(path)
        if axes_of is None or logical not in axes_of:
            continue
        i = list(axes_of).index(logical)
        spec = rules.spec(axes_of, None, _Sizes(shape))
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        if unknown & set(rules.mesh_axes(logical)):
            continue
        size = math.prod(shape[a] for a in axes)
        field, n = counts[logical]
        if size > 1 and n % size:
            joined = "+".join(axes)
            raise ShardingError(
                f"{what}{field}={n} is not divisible by mesh axes {joined} of size {size} (rule "
                f"{logical}={joined}): each device would hold part of an attention head; accepted: {joined} "
                f"sizes dividing {n}, or the rule '{logical}=none' (replicated {logical.replace('_', ' ')})")


def _mesh_axes(name: str, axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        axes = () if axes.lower() in ("", "none", "null") else tuple(a.strip() for a in axes.split("+"))
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) for a in axes):
        raise ShardingError(f"rule {name}={axes!r}: accepted: a string of mesh axes like 'fsdp' or 'data+fsdp', "
                            f"a tuple of mesh axis names, or None")
    axes = tuple(axes)
    for a in axes:
        if a not in AXES:
            raise ShardingError(f"rule {name}={'+'.join(axes)}: unknown mesh axis {a!r}; accepted: {', '.join(AXES)}")
    for a in axes:
        if axes.count(a) > 1:  # a sharding may map a mesh axis to one position only
            raise ShardingError(f"rule {name}={'+'.join(axes)} names mesh axis {a!r} twice; "
                                f"accepted: each mesh axis at most once per rule")
    return axes


def _entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def path_str(path) -> str:
    """A pytree key path as `"layers.wq.kernel"` (NNX `.value` / `[0]` markers kept as plain keys)."""
    keys = [key_name(k) for k in path]
    if keys and keys[-1] == "value":  # nnx.Variable leaves
        keys = keys[:-1]
    return ".".join(keys)


ADAPTER_CHILDREN = {
    "lora_a": lambda axes: (*axes[:-1], None),        # [..., in, r]
    "lora_b": lambda axes: (*axes[:-2], None, axes[-1]),  # [..., r, out]
    "base": lambda axes: axes,                          # the wrapped float kernel
}
"""Children of a LoRA weight leaf (`jmem.lora.LoRA`) at a kernel's path: their logical axes from the
kernel's, so adapters, their gradients and their optimizer state split with the weight they adapt."""


def lookup_axes(path: str, logical_axes: Mapping[str, Sequence[str | None]]) -> tuple | None:
    """Logical axes of a state path: exact match, else the longest table key that is a dotted suffix,
    else, for a LoRA child (`...kernel.lora_a`), axes derived from its kernel's (`ADAPTER_CHILDREN`).

    The suffix match lets optimizer states (`"0.mu.layers.wq.kernel"`) find their parameter.
    """
    if path in logical_axes:
        return tuple(logical_axes[path])
    best = None
    for key in logical_axes:
        if path.endswith("." + key) and (best is None or len(key) > len(best)):
            best = key
    if best is not None:
        return tuple(logical_axes[best])
    parent, _, child = path.rpartition(".")
    if child in ADAPTER_CHILDREN and parent:
        axes = lookup_axes(parent.removesuffix(".value"), logical_axes)
        if axes is not None and len(axes) >= 2:
            return ADAPTER_CHILDREN[child](axes)
    return None


def default_logical_axes() -> dict[str, tuple[str, ...]]:
    """The Llama table (`jmem.models.LOGICAL_AXES`) plus the MoE block's."""
    from jmem.models.llama import LOGICAL_AXES
    from jmem.models.moe import MOE_LOGICAL_AXES

    return {**LOGICAL_AXES, **MOE_LOGICAL_AXES}


def logical_tree(tree, logical_axes: Mapping | None = None):
    """Tree of logical-axes tuples (None where the path is unknown or the rank disagrees)."""
    table = default_logical_axes() if logical_axes is None else logical_axes

    def one(path, x):
        axes = lookup_axes(path_str(path), table)
        if axes is None or len(axes) != len(getattr(x, "shape", ())):
            return None
        return axes

    return jax.tree_util.tree_map_with_path(one, tree)


def shardings(tree, rules: "Rules | str | None", mesh: Mesh, logical_axes: Mapping | None = None):
    """A tree of `NamedSharding` for `tree` (arrays or ShapeDtypeStructs), from its logical axes.

    Leaves whose path is not in the table (or whose rank differs) are replicated.

    Raises:
        ShardingError: a dim not divisible by its mesh axes (names the path, dim, size and axes).
        MeshError: `mesh` is not a `jax.sharding.Mesh` (e.g. a spec string).
    """
    check_mesh(mesh)
    rules = Rules.parse(rules)
    table = default_logical_axes() if logical_axes is None else logical_axes

    def one(path, x):
        name = path_str(path)
        axes = lookup_axes(name, table)
        shape = tuple(getattr(x, "shape", ()))
        if axes is None or len(axes) != len(shape):
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, rules.spec(axes, shape, mesh, name=name))

    return jax.tree_util.tree_map_with_path(one, tree)


def shard(tree, rules: "Rules | str | None", mesh: Mesh, logical_axes: Mapping | None = None):
    """Place `tree` on `mesh` by its logical axes (see `shardings`); returns the sharded tree.

    Only array dims are checked: a tree holds no head counts, so a tensor axis that divides
    `n_heads * head_dim` but not the heads would cut heads apart. Check the model's config
    first with `check_heads(config.n_heads, config.n_kv_heads, rules, mesh)` (the sharded
    train step and the serving engine do).

    Example:
        >>> mesh = make_mesh("fsdp=4,tensor=2")
        >>> params = shard(nnx.to_pure_dict(nnx.state(model, nnx.Param)), "embed=fsdp", mesh)
    """
    return jax.device_put(tree, shardings(tree, rules, mesh, logical_axes))


def batch_sharding(mesh: Mesh, rules: "Rules | str | None" = None, ndim: int = 2) -> NamedSharding:
    """Sharding of a `[batch, length, ...]` input: batch on the rules' batch axes, length by `length`."""
    rules = Rules.parse(rules)
    return NamedSharding(mesh, rules.spec(("batch", "length") + (None,) * (ndim - 2), None, mesh))


_ACTIVE: contextvars.ContextVar["tuple[Rules, Mesh] | None"] = contextvars.ContextVar(
    "jmem_activation_sharding", default=None)

ACTIVATION_AXES: tuple[str, str, str] = ("batch", "length", "embed")
"""Logical axes of the residual stream `[batch, length, embed]` between blocks."""

MATMUL_INPUT_AXES: tuple[str, None, str] = ("batch", None, "embed")
"""Logical axes of a normed block input entering the column-parallel matmuls: the whole
sequence (Megatron's tensor-parallel region), so a sequence-sharded residual stream is
all-gathered there rather than the weights."""


@contextlib.contextmanager
def activation_sharding(rules: "Rules | str | None", mesh: Mesh | None):
    """Within this block, `constrain(x, logical_axes)` pins activations to `rules` on `mesh`.

    Read at trace time only: enter it inside the function that `jax.jit` traces
    (`jit_train_step` and `make_sharded_train_step` do), because jit caches a
    trace without looking at this context. `mesh=None` switches constraints off
    for the block. The setting lives in a `contextvars.ContextVar`, so it ends
    with the block and never leaks into other threads or later traces.

    With `length` mapped to a mesh axis (`"length=tensor"`) the residual stream
    between blocks is split over the sequence on that axis (Megatron sequence
    parallelism): XLA all-gathers it before the column-parallel matmuls and
    reduce-scatters after the row-parallel ones instead of all-reducing, and
    norms, residual adds and the cross-entropy work on 1/size of the tokens.

    Example:
        >>> def step(state, batch):
        ...     with activation_sharding("length=tensor", mesh):
        ...         return train_step(state, batch)
        >>> jax.jit(step)(state, batch)
    """
    token = _ACTIVE.set(None if mesh is None else (Rules.parse(rules), mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_activation_sharding() -> "tuple[Rules, Mesh] | None":
    """The `(rules, mesh)` of the innermost `activation_sharding` block, or None."""
    return _ACTIVE.get()


def constrain(x, logical_axes: Sequence[str | None], rules: "Rules | str | None" = None, mesh: Mesh | None = None):
    """`with_sharding_constraint` by logical names, e.g. `("batch", "length", "embed")` between blocks.

    With an explicit `mesh` the constraint uses `rules` (None: the defaults). Without
    one it uses the active `activation_sharding` block, and outside any block it
    returns `x` itself (no operation is traced), so a model that calls it runs
    unchanged on one device. With `Rules.parse("length=tensor")` this is sequence
    sharding of the residual stream.

    Raises:
        ShardingError: a dim of `x` not divisible by the size of its mesh axes (names both).

    Example:
        >>> x_BTE = constrain(x_BTE, ("batch", "length", "embed"))   # no-op outside activation_sharding
    """
    if mesh is None:
        if rules is not None:
            raise ShardingError("constrain: rules given without a mesh; pass both, or neither to use the "
                                "active activation_sharding(rules, mesh) block")
        active = _ACTIVE.get()
        if active is None:
            return x
        rules, mesh = active
        manual = _manual_axes()
        if manual:  # inside a shard_map: those axes are the caller's, constrain only the others
            if all(a in manual for a, n in mesh.shape.items() if n > 1):
                return x
            rules = without_axes(rules, manual)
    rules = Rules.parse(rules)
    spec = rules.spec(tuple(logical_axes), x.shape, mesh, name="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def kernel_per_device(fn, args, in_axes, out_axes):
    """`fn(*args)` for a Pallas kernel, run per device under the active `activation_sharding`.

    GSPMD has no rule to split a Pallas call (a custom call: its operands are replicated onto every
    device, and a TPU compile of one inside a sharded program fails), so inside an
    `activation_sharding` block the call goes through a `jax.shard_map`: each device runs `fn` on its
    own slice of the logical axes `in_axes` (one tuple per arg; `out_axes` for the result, sliced
    alike). Dims at the same position of the args correspond (query heads and kv heads), so a mesh
    axis splits them all or none: one that a dim's rule does not name while another arg's does (rule
    'kv_heads=none' beside 'heads=tensor'), or that does not divide a dim, is left out. Inside a
    `shard_map` manual over some axes (a 1F1B pipeline's stage axis), the others split the call the
    same way, in a nested `shard_map`. Outside a block it is `fn(*args)`.
    """
    active = _ACTIVE.get()
    if active is None:
        return fn(*args)
    rules, mesh = active
    manual = _manual_axes()
    drop: set[str] = set(manual)
    by_position: dict[int, list[set[str]]] = {}
    for x, axes in zip(args, in_axes):
        for pos, (dim, name) in enumerate(zip(x.shape, axes)):
            split = [a for a in rules.mesh_axes(name) if mesh.shape.get(a, 1) > 1 and a not in manual]
            by_position.setdefault(pos, []).append(set(split))
            if split and dim % math.prod(mesh.shape[a] for a in split):
                drop.update(split)
    for splits in by_position.values():  # an axis that splits one arg's dim splits the others' too
        drop.update(set.union(*splits) - set.intersection(*splits))
    rules = without_axes(rules, tuple(drop))
    in_specs = tuple(rules.spec(axes, x.shape, mesh, name="kernel input") for x, axes in zip(args, in_axes))
    if all(entry is None for spec in in_specs for entry in spec):
        return fn(*args)
    out_spec = rules.spec(out_axes, None, mesh, name="kernel output")
    if not manual:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)
    free = frozenset(a for a in mesh.axis_names if a not in manual)
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs, out_specs=out_spec,
                         axis_names=free, check_vma=False)(*args)


def _manual_axes() -> tuple[str, ...]:
    """Mesh axes that an enclosing `shard_map` has made manual (empty outside one)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    return tuple(getattr(get(), "manual_axes", ())) if get is not None else ()


def without_axes(rules: "Rules | str | None", drop: Sequence[str]) -> Rules:
    """`rules` with the mesh axes `drop` removed from every logical name.

    For activations inside a `vmap` whose mapped dim already sits on `drop` (the
    per-group gradient accumulators): no other dim may claim those axes.
    """
    rules = Rules.parse(rules)
    return Rules(tuple((name, tuple(a for a in axes if a not in drop)) for name, axes in rules.table))
