"""ZeRO stages 0-3 as shardings over the data-parallel mesh axes (`data`, `fsdp`, `expert`).

A stage only decides which of the three model-state trees get the data axes
added to their sharding (on top of the model-parallel sharding from `Rules`):

    stage  params      grads       optimizer state     bytes/device (Psi params, K opt bytes/param)
    0      replicated  replicated  replicated          (P + G + K) Psi
    1      replicated  replicated  sharded             (P + G) Psi + K Psi / N
    2      replicated  sharded     sharded             P Psi + (G + K) Psi / N
    3      sharded     sharded     sharded             (P + G + K) Psi / N

The collectives follow from the layouts. `jmem.parallel.step` with `accum > 1`
reduces the gradient explicitly: an all-reduce into replicated grads (0-1) or a
reduce-scatter into sharded grads (2-3); with `accum == 1` the compiler chooses
(see `jmem.parallel.step`). With sharded optimizer state the
update is computed on the shard and the new params are all-gathered (1-2).
With sharded params (3) the stacked `layers` axis stays whole and another dim
is split, so the layer scan slices a sharded layer and the weight is
all-gathered inside the loop body, one layer at a time
(`jmem.parallel.gather.GatheredWeight` pins that choice).

The data axes go on one dimension per array: the one with the largest shard
whose size stays divisible (after any model-parallel split of the same dim),
never the scanned `layers` axis. Arrays with no such dimension (scalars, odd
sizes) stay replicated; a stage that so keeps most of the optimizer state whole
(a device count such as 3 that divides none of the model's sizes) warns.

Example:
    >>> sh = zero_shardings(params, opt_state, mesh, stage=2)
    >>> sh.grads["layers"]["wq"]["kernel"].spec
    PartitionSpec(None, ('data', 'fsdp'), 'tensor')
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Mapping

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem.checks import check_int, is_int, is_number
from jmem.memory.measure import bytes_per_device
from jmem.parallel.mesh import ZERO_AXES
from jmem.parallel.rules import Rules, default_logical_axes, lookup_axes, path_str

ZERO_STAGES = (0, 1, 2, 3)
_NEVER_ZERO = ("layers", "stage")  # scanned / pipelined axes are never split by ZeRO


class ZeroStageError(ValueError):
    """A ZeRO stage outside 0-3."""


def check_stage(stage) -> int:
    """`stage` as an int in 0..3, else one clear error."""
    if not is_int(stage) or stage not in ZERO_STAGES:
        raise ZeroStageError(f"zero={stage!r} is not a ZeRO stage; accepted: 0, 1, 2, 3")
    return int(stage)


def _spec_entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    out = []
    for i in range(ndim):
        e = spec[i] if i < len(spec) else None
        out.append(() if e is None else ((e,) if isinstance(e, str) else tuple(e)))
    return out


def leaf_spec(name: str, shape, mesh: Mesh, rules: Rules, table: Mapping, *, zero: bool,
              data_axes=ZERO_AXES, param_shape=None) -> P:
    """PartitionSpec of one array: the rules' model-parallel spec, plus the data axes when `zero`.

    `param_shape`: the shape of the parameter whose axes the array takes (an optimizer state leaf);
    a dim of another size is not that parameter's dim and keeps no logical axis (GaLore's rank-r
    basis and moments: `[L, E, r]` beside the kernel `[L, E, F]`)."""
    shape = tuple(shape)
    axes = lookup_axes(name, table)
    if axes is None or len(axes) != len(shape):
        axes = (None,) * len(shape)
    elif param_shape is not None and len(param_shape) == len(shape):
        axes = tuple(a if n == m else None for a, n, m in zip(axes, shape, param_shape))
    entries = _spec_entries(rules.spec(axes, shape, mesh, name=name), len(shape))
    return _with_data_axes(entries, shape, axes, mesh, zero, data_axes)


def _with_data_axes(entries, shape, axes, mesh: Mesh, zero: bool, data_axes) -> P:
    """`entries` (mesh axes per dim) as a spec, with the data axes added on the best dim when `zero`."""
    if not zero:
        return P(*[e[0] if len(e) == 1 else (e or None) for e in entries])
    used = {a for e in entries for a in e}
    dp = tuple(a for a in data_axes if mesh.shape.get(a, 1) > 1 and a not in used)
    dp_size = math.prod(mesh.shape[a] for a in dp)
    if dp_size > 1:
        best = None
        for i, n in enumerate(shape):
            if axes[i] in _NEVER_ZERO:
                continue
            have = math.prod(mesh.shape[a] for a in entries[i])
            if n % (have * dp_size) == 0 and (best is None or n // have > shape[best] // math.prod(
                    mesh.shape[a] for a in entries[best])):
                best = i
        if best is not None:
            entries[best] = entries[best] + dp
    return P(*[(e[0] if len(e) == 1 else e) if e else None for e in entries])


def _entry(axes: tuple[str, ...]):
    return (axes[0] if len(axes) == 1 else axes) if axes else None


def is_packed_leaf(x) -> bool:
    """A whole weight leaf that says how it splits (quantized, GGUF-packed, LoRA, several adapters).
    Trees holding part of one (the adapters of a trainable split, with None for the frozen base)
    have no shape: they are walked into, and the adapter arrays find their axes by path."""
    if isinstance(x, nnx.Variable) or not hasattr(x, "__jmem_partition__"):
        return False
    try:
        return len(x.shape) >= 2
    except AttributeError:  # a child is None
        return False


def _packed_shardings(name: str, leaf, mesh: Mesh, rules: Rules, table: Mapping, *, zero: bool, data_axes,
                      strict: bool):
    """Shardings of a packed weight leaf's children: as the leaf splits them for its float kernel's
    model-parallel spec (`jmem.models.dot.partition_specs`), plus ZeRO's data axes on each child.
    Where splitting the input rows would cut a packing unit, the rows stay whole (results are the
    same under GSPMD, the leaf just is not split on that axis), or with `strict` one ShardingError
    names the weight (tensor-parallel serving, where the split is the point)."""
    from jmem.models.dot import partition_specs
    from jmem.parallel.rules import ShardingError

    kernel = _spec_entries(leaf_spec(name, leaf.shape, mesh, rules, table, zero=False), len(leaf.shape))
    lead, cols = tuple(map(_entry, kernel[:-2])), _entry(kernel[-1])
    try:
        specs = partition_specs(leaf, lead, _entry(kernel[-2]), cols, math.prod(mesh.shape[a] for a in kernel[-2]))
    except ValueError as e:  # a row split would cut a pack word / group / block
        if strict:
            raise ShardingError(f"{name!r} ({type(leaf).__name__}): {e}") from None
        specs = partition_specs(leaf, lead, None, cols)
    n_lead = len(leaf.shape) - 2

    def child(spec, x):
        shape = tuple(x.shape)
        axes = ("layers",) * min(n_lead, len(shape)) + (None,) * max(0, len(shape) - n_lead)
        return NamedSharding(mesh, _with_data_axes(_spec_entries(spec, len(shape)), shape, axes, mesh, zero,
                                                   data_axes))

    return jax.tree.map(child, specs, leaf, is_leaf=lambda s: isinstance(s, P))


def tree_shardings(tree, mesh: Mesh, rules=None, logical_axes: Mapping | None = None, *, zero: bool,
                   data_axes=ZERO_AXES, strict_packing: bool = False, params=None):
    """NamedShardings for every array leaf of `tree` (see `leaf_spec`); packed weight leaves split
    their children as they say (`_packed_shardings`; `strict_packing`: refuse a split that would cut
    a packing unit instead of keeping those rows whole). `params`: for an optimizer state, the
    parameter tree: a leaf whose path ends with a parameter's keeps that parameter's axes only on
    dims of the parameter's size."""
    rules = Rules.parse(rules)
    table = default_logical_axes() if logical_axes is None else logical_axes
    param_shapes = {} if params is None else {
        path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_packed_leaf)
        if hasattr(x, "shape")}

    def shape_of_param(name: str):
        keys = name.split(".")
        return next((param_shapes[k] for k in (".".join(keys[i:]) for i in range(len(keys))) if k in param_shapes),
                    None)

    def one(path, x):
        name = path_str(path)
        if is_packed_leaf(x):
            return _packed_shardings(name, x, mesh, rules, table, zero=zero, data_axes=data_axes,
                                     strict=strict_packing)
        return NamedSharding(mesh, leaf_spec(name, getattr(x, "shape", ()), mesh, rules, table, zero=zero,
                                             data_axes=data_axes, param_shape=shape_of_param(name)))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_packed_leaf)


@dataclasses.dataclass(frozen=True)
class ZeroShardings:
    """NamedSharding trees for params, grads (same structure as params) and optimizer state."""

    params: Any
    grads: Any
    opt_state: Any
    stage: int


def zero_shardings(params, opt_state, mesh: Mesh, *, stage: int, rules=None,
                   logical_axes: Mapping | None = None, data_axes=ZERO_AXES) -> ZeroShardings:
    """Shardings of the three model-state trees for a ZeRO `stage` (0-3).

    Args:
        params: parameter tree (arrays or `jax.ShapeDtypeStruct`s), paths matching `logical_axes`.
        opt_state: the optimizer state tree (its leaves find their parameter by path suffix;
            others, such as factored second moments, are sharded on their largest divisible dim).
        mesh: a mesh from `make_mesh`.
        stage: 0, 1, 2 or 3.
        rules: `Rules`, a rules string or None (defaults).
        logical_axes: path -> logical axes table (default: `jmem.models.LOGICAL_AXES` + MoE).
        data_axes: the mesh axes ZeRO partitions the state over (default: data, fsdp, expert).

    Returns:
        `ZeroShardings(params, grads, opt_state, stage)`.

    Raises:
        ZeroStageError: stage outside 0-3.
        ShardingError: a dimension not divisible by its model-parallel mesh axes.
    """
    stage = check_stage(stage)
    kw = dict(mesh=mesh, rules=rules, logical_axes=logical_axes, data_axes=data_axes)
    out = ZeroShardings(
        params=tree_shardings(params, zero=stage >= 3, **kw),
        grads=tree_shardings(params, zero=stage >= 2, **kw),
        opt_state=tree_shardings(opt_state, zero=stage >= 1, params=params, **kw),
        stage=stage,
    )
    if stage:
        _warn_if_mostly_replicated(opt_state, out.opt_state, mesh, data_axes, stage)
    return out


def _warn_if_mostly_replicated(tree, shardings, mesh: Mesh, data_axes, stage: int) -> None:
    """A warning when ZeRO leaves most of the optimizer state whole: the data axes' size divides no
    dimension of those leaves (an odd device count), so the stage saves little or nothing."""
    axes = [a for a in data_axes if mesh.shape.get(a, 1) > 1]
    if not axes:
        return
    total = kept = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        size = math.prod(np.shape(x)) * np.dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x)).itemsize
        total += size
        used = {a for e in s.spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
        kept += 0 if used & set(axes) else size
    if total and kept > total / 2:
        n = math.prod(mesh.shape[a] for a in axes)
        warnings.warn(f"ZeRO-{stage} over {'x'.join(axes)} ({n} devices) keeps {kept / total:.0%} of the optimizer "
                      f"state whole on every device: no dimension of those arrays divides by {n}; a device count "
                      "that divides the model's sizes (e.g. a power of two) shards it", stacklevel=3)


def state_shardings(state, mesh: Mesh, *, stage: int, rules=None, logical_axes: Mapping | None = None):
    """Shardings for a train-state NamedTuple with `params` and `opt_state` fields
    (`jmem.train.TrainState` or `jmem.parallel.ParallelState`); other fields replicated."""
    zs = zero_shardings(state.params, state.opt_state, mesh, stage=stage, rules=rules, logical_axes=logical_axes)
    rep = jax.tree.map(lambda _: NamedSharding(mesh, P()), state)
    return rep._replace(params=zs.params, opt_state=zs.opt_state)


def grad_shardings_for(params, mesh: Mesh, *, stage: int, rules=None, logical_axes: Mapping | None = None):
    """Gradient shardings for `stage` (sharded over the data axes from stage 2)."""
    return tree_shardings(params, mesh, rules, logical_axes, zero=check_stage(stage) >= 2)


def constrain_gradients(tx: optax.GradientTransformation, mesh: Mesh, *, stage: int, rules=None,
                        logical_axes: Mapping | None = None) -> optax.GradientTransformation:
    """Wrap `tx` so its incoming gradients carry the ZeRO-`stage` sharding.

    For a step whose gradient reduction is left to XLA (plain `jit` of a
    `value_and_grad`), this is what asks for sharded gradients at stage 2-3: the
    compiler then reduce-scatters or all-reduces and slices (the CPU compiler
    always the latter; see `jmem.parallel.step`). `dp_accumulate_value_and_grad` makes the
    reduce-scatter explicit on every backend. The optimizer state's structure is
    unchanged, so checkpoints and shardings of `tx.init` still fit.

    Example:
        >>> tx = constrain_gradients(optax.adamw(1e-3), mesh, stage=2)
    """
    stage = check_stage(stage)

    def update(updates, state, params=None, **extra):
        sh = grad_shardings_for(updates, mesh, stage=stage, rules=rules, logical_axes=logical_axes)
        updates = jax.lax.with_sharding_constraint(updates, sh)
        return tx.update(updates, state, params, **extra)

    return optax.GradientTransformation(tx.init, update)


def zero_model_bytes(n_params: int, *, stage: int, n: int, param_bytes: int = 4, grad_bytes: int = 4,
                     opt_bytes: int = 8) -> dict[str, float]:
    """The ZeRO paper's per-device model-state bytes: Psi=n_params, K=opt_bytes, N=n devices."""
    stage = check_stage(stage)
    check_int("n", n, 1)
    for name, value in (("n_params", n_params), ("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("opt_bytes", opt_bytes)):
        if not is_number(value) or not 0 <= value < math.inf:
            raise ValueError(f"{name}={value!r}; accepted: a finite number >= 0")
    return {
        "params": n_params * param_bytes / (n if stage >= 3 else 1),
        "grads": n_params * grad_bytes / (n if stage >= 2 else 1),
        "opt_state": n_params * opt_bytes / (n if stage >= 1 else 1),
    }


def model_state_bytes(abstract_state, mesh: Mesh, *, stage: int, rules=None,
                      logical_axes: Mapping | None = None, trainable=None) -> dict[str, int]:
    """Per-device bytes of a train state's params, grads and optimizer state under ZeRO `stage`.

    `abstract_state` has `params` and `opt_state` fields (e.g.
    `jax.eval_shape(lambda: fns.init_state(model))`). The keys are the
    `memory_sweep` record fields. `trainable`: `params -> (trainable, frozen)`
    (`TrainFns.trainable`, LoRA: the adapters), whose first part alone has gradients.

    Example:
        >>> model_state_bytes(abstract, make_mesh("data=8"), stage=2)
        {'param_bytes_per_device': ..., 'grad_bytes_per_device': ..., 'opt_bytes_per_device': ...}
    """
    zs = zero_shardings(abstract_state.params, abstract_state.opt_state, mesh, stage=stage, rules=rules,
                        logical_axes=logical_axes)
    grads = abstract_state.params if trainable is None else trainable(abstract_state.params)[0]
    grad_shardings = zs.grads if trainable is None else tree_shardings(
        grads, mesh, rules, logical_axes, zero=stage >= 2)
    return {
        "param_bytes_per_device": bytes_per_device(abstract_state.params, zs.params),
        "grad_bytes_per_device": bytes_per_device(grads, grad_shardings),
        "opt_bytes_per_device": bytes_per_device(abstract_state.opt_state, zs.opt_state),
    }
