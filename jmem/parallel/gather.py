"""ZeRO-3 weights that are all-gathered exactly where they are used.

With parameters sharded over the data axes, XLA may pick any way to compute
`x @ w` (all-gather the weight, or reshard the activations and all-reduce a
partial product). FSDP/ZeRO-3 means the first: gather one layer's weight just
before its matmul and drop it after. `GatheredWeight` is a weight leaf (see
`jmem.models.dot`) that pins that choice: its `__jmem_dot__` constrains the
weight to its model-parallel layout (data axes removed) and multiplies, and
gathers it again in the backward pass rather than keeping it as a residual.
Inside the model's layer scan the leaf holds one layer's slice, so the
all-gather runs per layer, inside the loop. The MoE expert weights, which
`moe_mlp` multiplies with grouped matmuls rather than `dot`, are read through
`__jmem_array__` (the same constraint) at the same place. A quantized or packed
leaf (QLoRA's base) is gathered the same way, child by child, each child to the
split the leaf gives it for its kernel's model-parallel layout.

Example:
    >>> wrapped = gather_on_use(params, mesh, rules)   # kernels -> GatheredWeight
    >>> loss, _ = loss_fn(wrapped, batch)              # a loss whose model calls `dot` on them
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem.models.dot import dot, recompute_weight_in_backward
from jmem.models.config import EXPERT_WEIGHTS
from jmem.parallel.mesh import DATA_AXES
from jmem.parallel.rules import Rules, default_logical_axes, lookup_axes, path_str
from jmem.parallel.zero import is_packed_leaf


@jax.tree_util.register_pytree_node_class
class GatheredWeight:
    """A kernel `[..., in, out]` (an array, or a packed weight leaf) gathered before `dot`: each array
    of `w` (the array itself, or each child of a packed leaf, in flatten order) to its `entries`.

    `entries` holds one tuple per array, describing only its trailing dims (no stacked `layers` size
    in static data), so the leaf survives `lax.scan` slicing of its leading axis.
    """

    def __init__(self, w, mesh: Mesh, entries: tuple):
        self.w, self.mesh, self.entries = w, mesh, tuple(entries)

    def tree_flatten(self):
        return (self.w,), (self.mesh, self.entries)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def shape(self):
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    def gathered(self):
        """`w` with every array constrained to its model-parallel layout (data axes removed)."""
        arrays, treedef = jax.tree.flatten(self.w)

        def one(x, entries):
            spec = P(*((None,) * max(0, x.ndim - len(entries)) + entries[max(0, len(entries) - x.ndim):]))
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        return treedef.unflatten([one(x, e) for x, e in zip(arrays, self.entries)])

    def __jmem_array__(self):
        """The weight gathered (a packed leaf's decoded), for code that does not call `dot`, such as the
        MoE experts' grouped matmuls."""
        w = self.gathered()
        return w if isinstance(w, jax.Array) else w.__jmem_array__()

    def __jmem_dot__(self, x):
        return _gathered_dot(x, self)


@recompute_weight_in_backward
def _gathered_dot(x, g: GatheredWeight):
    return dot(x, g.gathered())


def gather_on_use(params, mesh: Mesh, rules=None, logical_axes: Mapping | None = None, *,
                  suffix: str = "kernel", data_axes=DATA_AXES, expert_weights: tuple[str, ...] = EXPERT_WEIGHTS):
    """ZeRO-3 params ready for the forward pass.

    Every `*.kernel` leaf (used through `dot`) and every MoE expert weight (names ending
    in `expert_weights`, used by `moe_mlp` through `__jmem_array__`), or the base of a
    LoRA leaf at such a path, becomes a `GatheredWeight`, gathered per use (per layer
    inside the scan). Other leaves
    (embedding, norm scales) are gathered once, here, to their model-parallel layout,
    so activations keep their batch sharding instead of following a data-axis split of
    a weight.

    Example:
        >>> wrapped = gather_on_use(params, make_mesh("fsdp=8"))
        >>> type(wrapped["layers"]["moe"]["expert_up"]).__name__
        'GatheredWeight'
    """
    rules = Rules.parse(rules)
    table = default_logical_axes() if logical_axes is None else logical_axes

    def one(path, x):
        name = path_str(path)
        weight = name.removesuffix(".base")  # a LoRA leaf's base is used as the weight it wraps
        ndim = len(x.shape)  # packed leaves give their kernel's shape
        axes = lookup_axes(name, table)
        if axes is None or len(axes) != ndim:
            axes = (None,) * ndim
        spec = rules.spec(axes, x.shape, mesh, name=name)
        entries = []
        for i in range(ndim):
            e = spec[i] if i < len(spec) else None
            e = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
            e = tuple(a for a in e if a not in data_axes)
            entries.append(None if not e else (e[0] if len(e) == 1 else e))
        trailing = 2 if weight.endswith(suffix) else 3 if weight.split(".")[-1] in expert_weights else 0
        if _is_packed(x):  # gathered child by child, each as the leaf splits it for the kernel's entries
            if not trailing:
                raise ValueError(f"ZeRO-3: {name!r} holds a {type(x).__name__}; accepted: packed weights at a "
                                 f"kernel or an expert weight")
            return GatheredWeight(x, mesh, _child_entries(x, entries, mesh))
        if trailing and ndim >= trailing:  # a kernel [(layers,) in, out] or experts [(layers,) exp, in, out]
            return GatheredWeight(x, mesh, (tuple(entries[-trailing:]),))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_packed)


def _is_packed(x) -> bool:
    """A quantized or packed weight leaf (`jmem.parallel.zero.is_packed_leaf`), gathered whole; a LoRA
    leaf is walked into: its base is the weight, its adapters are small."""
    from jmem.lora import LoRA

    return is_packed_leaf(x) and not isinstance(x, LoRA)


def _child_entries(leaf, entries: list, mesh: Mesh) -> tuple:
    """Each child's entries (flatten order) for the kernel's model-parallel `entries`; a split of the
    input rows that would cut a packing unit keeps them whole."""
    from jmem.models.dot import partition_specs

    lead, rows, cols = tuple(entries[:-2]), entries[-2], entries[-1]
    pieces = 1 if rows is None else math.prod(mesh.shape[a] for a in ((rows,) if isinstance(rows, str) else rows))
    try:
        specs = partition_specs(leaf, lead, rows, cols, pieces)
    except ValueError:
        specs = partition_specs(leaf, lead, None, cols)
    return tuple(tuple(spec) + (None,) * (x.ndim - len(spec)) for spec, x in
                 zip(jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)), jax.tree.leaves(leaf)))


def is_weight_leaf(x) -> bool:
    """A leaf of a params tree `gather_on_use` may replace whole: a `GatheredWeight`, or the packed weight
    it wraps. Flatten the model's params and the gathered ones with it, so both give the same leaves."""
    return isinstance(x, GatheredWeight) or _is_packed(x)
