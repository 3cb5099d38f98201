"""ZeRO-3 weights that are all-gathered exactly where they are used.

With parameters sharded over the data axes, XLA may pick any way to compute
`x @ w` (all-gather the weight, or reshard the activations and all-reduce a
partial product). FSDP/ZeRO-3 means the first: gather one layer's weight just
before its matmul and drop it after. `GatheredWeight` is a weight leaf (see
`jmem.models.dot`) that pins that choice: its `__jmem_dot__` constrains the
weight to its model-parallel layout (data axes removed) and multiplies. Inside
the model's layer scan the leaf holds one layer's slice, so the all-gather runs
per layer, inside the loop. The MoE expert weights, which `moe_mlp` multiplies
with einsums rather than `dot`, are read through `__jmem_array__` (the same
constraint) at the same place.

Example:
    >>> wrapped = gather_on_use(params, mesh, rules)   # kernels -> GatheredWeight
    >>> loss, _ = loss_fn(wrapped, batch)              # a loss whose model calls `dot` on them
"""

from __future__ import annotations

from typing import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem.models.dot import dot
from jmem.models.config import EXPERT_WEIGHTS
from jmem.parallel.mesh import DATA_AXES
from jmem.parallel.rules import Rules, default_logical_axes, lookup_axes, path_str


@jax.tree_util.register_pytree_node_class
class GatheredWeight:
    """A kernel `[..., in, out]` whose trailing dims are gathered to `entries` before `dot`.

    `entries` describes only the trailing dims (no stacked `layers` size in static
    data), so the leaf survives `lax.scan` slicing of its leading axis.
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

    def __jmem_array__(self):
        """The weight gathered to its model-parallel layout (for code that does not call `dot`,
        such as the MoE experts' einsums)."""
        n = self.w.ndim
        spec = P(*((None,) * max(0, n - len(self.entries)) + self.entries[-n:]))
        return jax.lax.with_sharding_constraint(self.w, NamedSharding(self.mesh, spec))

    def __jmem_dot__(self, x):
        return dot(x, self.__jmem_array__())


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
        axes = lookup_axes(name, table)
        if axes is None or len(axes) != x.ndim:
            axes = (None,) * x.ndim
        spec = rules.spec(axes, x.shape, mesh, name=name)
        entries = []
        for i in range(x.ndim):
            e = spec[i] if i < len(spec) else None
            e = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
            e = tuple(a for a in e if a not in data_axes)
            entries.append(None if not e else (e[0] if len(e) == 1 else e))
        if weight.endswith(suffix) and x.ndim >= 2:
            return GatheredWeight(x, mesh, tuple(entries[-2:]))
        if weight.split(".")[-1] in expert_weights and x.ndim >= 3:  # [(layers,) exp, in, out]
            return GatheredWeight(x, mesh, tuple(entries[-3:]))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))

    return jax.tree_util.tree_map_with_path(one, params)


def is_weight_leaf(x) -> bool:
    return isinstance(x, GatheredWeight)
