"""Several LoRA adapters served at once: one stacked weight leaf, one jitted step for any mix.

`MultiLoRA` wraps a base weight leaf (a float array or a quantized leaf) with
the adapters of every served LoRA module stacked on a slot axis, zero-padded to
the largest rank, with each adapter's `alpha / r` folded into its B:
`lora_a [*lead, S, in, R]`, `lora_b [*lead, S, R, out]`. Each row of the input
carries a slot id (`slots`, -1 for the base model), set per step inside the
jitted program by `with_slots`; the leaf then computes, for every row n,
`y[n] = x[n] @ W + (x[n] @ A[slot[n]]) @ B[slot[n]]`, and exactly `x[n] @ W`
for base rows.

Two formulations of the adapter term (`impl`), both free of any per-token copy
of the A or B matrices (that gather would hold tokens x in x R values):

* `"onehot"` (default): `h = x @ [A_0 | ... | A_{S-1}]` is `[N, S*R]`, rows
  keep only their own slot's R columns, and `h @ [B_0; ...; B_{S-1}]` adds the
  update: two dense matmuls, temporaries of N x S x R values (far below the
  stacked weights' S x R x (in + out) while N < in + out).
* `"ragged"`: rows sorted by slot go through `jax.lax.ragged_dot` with group
  sizes (as the dropless MoE path). FLOPs of exactly the routed rows where the
  backend has a grouped matmul; XLA's CPU expansion of it holds S x N x in, so
  it is opt-in.

An expert weight `[experts, in, out]` of a mixture-of-experts model stacks
its slots the same way (`lora_a [*lead, experts, S, in, R]`); inside
`jmem.models.moe.moe_mlp` each routed row takes the slot of its input row, and
the adapter term runs one-hot through the MLP's own grouped matmul (whatever
`impl`). Every expert holds its own slots, so runtime-loading slots on an MoE
model (which cover its experts) take about `experts` times the bytes of a
dense MLP's.

`stack_adapters` reads adapter files written by `jmem.lora.save_adapters`,
checks that they fit the model, and wraps its kernels. With `runtime_loading`
the slots hold every target of the model (its linears, or its attention linears
and experts) at `max_lora_rank`, so that adapters read later (`read_adapter`)
fit whatever they target.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem.lora import LoRA, check_base, read_adapters
from jmem.models.config import EXPERT_TARGETS, EXPERT_WEIGHTS, LINEARS
from jmem.models.moe import expert_matmul
from jax.sharding import PartitionSpec as P

from jmem.models.dot import dot, partition_specs

IMPLS = ("onehot", "ragged")
SERVABLE = LINEARS + EXPERT_TARGETS  # the weights served adapters may target
BASE_SLOT = -1  # slot id of rows served by the base model (and of padding rows)


class MultiLoRA:
    """A weight leaf `[..., in, out]` plus S stacked adapters, one chosen per input row.

    Children: base (any weight leaf), lora_a [..., S, in, R], lora_b [..., S, R, out] (scale folded in),
    slots (i32[..., N] slot id per row, -1: base; or None: every row is a base row).
    Static: impl ("onehot" | "ragged").

    Example:
        >>> w = MultiLoRA(w0, a_SDR, b_SRO)
        >>> y_NO = dot(x_ND, w.with_slots(jnp.array([0, -1, 1, 0])))
    """

    def __init__(self, base, lora_a, lora_b, slots=None, impl: str = "onehot"):
        if impl not in IMPLS:
            raise ValueError(f"MultiLoRA impl={impl!r}; accepted: {', '.join(IMPLS)}")
        self.base, self.lora_a, self.lora_b, self.slots, self.impl = base, lora_a, lora_b, slots, impl

    def tree_flatten_with_keys(self):
        k = jax.tree_util.GetAttrKey
        return ((k("base"), self.base), (k("lora_a"), self.lora_a), (k("lora_b"), self.lora_b),
                (k("slots"), self.slots)), (self.impl,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, impl=aux[0])

    @property
    def num_slots(self) -> int:
        return self.lora_a.shape[-3]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def adapter_nbytes(self) -> int:
        return int(self.lora_a.nbytes + self.lora_b.nbytes)

    @property
    def nbytes(self) -> int:
        base = self.base.nbytes if hasattr(self.base, "dequantize") else self.base.size * self.base.dtype.itemsize
        return int(base) + self.adapter_nbytes

    def __getitem__(self, index) -> "MultiLoRA":
        """Index the leading (stacked-layers) axes of every child alike."""
        return jax.tree_util.tree_map(lambda c: c[index], self)

    def with_slots(self, slots_N) -> "MultiLoRA":
        """This leaf routing rows by `slots_N` (i32[N]), broadcast over its stacked-layers axes."""
        lead = self.lora_a.shape[:-3]
        slots = jnp.broadcast_to(jnp.asarray(slots_N, jnp.int32), (*lead, slots_N.shape[-1]))
        return MultiLoRA(self.base, self.lora_a, self.lora_b, slots, self.impl)

    def __jmem_partition__(self, lead, rows, cols, row_pieces):
        """The base as it splits, A `[S, in, R]` on the input rows, B `[S, R, out]` on the output columns
        (a row-parallel weight's `x @ A` is then a partial sum, reduced like the base's), slots whole."""
        slots = None if self.slots is None else P()
        return MultiLoRA(partition_specs(self.base, lead, rows, cols, row_pieces), P(*lead, None, rows, None),
                         P(*lead, None, None, cols), slots, self.impl)

    def __jmem_dot__(self, x: jax.Array) -> jax.Array:
        y = dot(x, self.base)
        if self.slots is None:
            return y
        *lead, D = x.shape
        x_ND = x.reshape(-1, D)
        slots_N = self.slots.reshape(-1)
        if slots_N.shape[0] != x_ND.shape[0]:
            raise ValueError(f"MultiLoRA has {slots_N.shape[0]} slot ids for {x_ND.shape[0]} input rows")
        delta = _delta_onehot if self.impl == "onehot" else _delta_ragged
        u_NO = delta(x_ND, self.lora_a, self.lora_b, slots_N)
        y_NO = y.reshape(x_ND.shape[0], -1)
        # Base rows keep the base output bit for bit (no + 0.0 round trip through f32).
        out = jnp.where((slots_N >= 0)[:, None], (y_NO.astype(jnp.float32) + u_NO).astype(y.dtype), y_NO)
        return out.reshape(*lead, -1)

    def __jmem_expert_dot__(self, x, matmul, tokens=None):
        """An expert weight `[experts, in, out]` with adapters `A [experts, S, in, R]`, `B [experts, S, R, out]`
        in `jmem.models.moe.moe_mlp`: each routed row of `x` takes the slot of its input row (`tokens`).
        The slots' A (and B) go through `matmul` side by side, `[experts, in, S*R]`, and each row keeps its
        own slot's R columns (the one-hot form of `__jmem_dot__`): two grouped matmuls."""
        y = expert_matmul(x, self.base, matmul)
        if self.slots is None:
            return y
        if tokens is None:
            raise ValueError("a MultiLoRA expert weight needs the input row of each routed row (tokens)")
        slots_N = self.slots.reshape(-1, self.slots.shape[-1])[0]  # the same slot ids for every expert
        slot_R = jnp.where(tokens >= 0, slots_N[jnp.maximum(tokens, 0)], BASE_SLOT)  # each routed row's
        X, S, D, R = self.lora_a.shape
        a = self.lora_a.swapaxes(1, 2).reshape(X, D, S * R)
        h = matmul(x, a.astype(x.dtype))  # [..., S * R]
        keep = slot_R[..., None] == jnp.repeat(jnp.arange(S), R)
        u = matmul(jnp.where(keep, h, 0).astype(x.dtype), self.lora_b.reshape(X, S * R, -1).astype(x.dtype))
        return jnp.where((slot_R >= 0)[..., None], (y.astype(jnp.float32) + u.astype(jnp.float32)).astype(y.dtype),
                         y)


jax.tree_util.register_pytree_with_keys_class(MultiLoRA)


def _delta_onehot(x_ND, a_SDR, b_SRO, slots_N):
    S, _, R = a_SDR.shape
    h_NSR = jnp.einsum("nd,sdr->nsr", x_ND, a_SDR.astype(x_ND.dtype), preferred_element_type=jnp.float32)
    keep_NS = slots_N[:, None] == jnp.arange(S)[None, :]  # slot -1: no column kept
    # A select, not a product with the one-hot: another slot's overflow (inf * 0) cannot reach this row.
    h_NSR = jnp.where(keep_NS[:, :, None], h_NSR, 0.0).astype(x_ND.dtype)
    return jnp.einsum("nsr,sro->no", h_NSR, b_SRO.astype(x_ND.dtype), preferred_element_type=jnp.float32)


def _delta_ragged(x_ND, a_SDR, b_SRO, slots_N):
    S = a_SDR.shape[0]
    group_N = jnp.where(slots_N < 0, S, slots_N)  # base rows sort last, past every group
    order_N = jnp.argsort(group_N, stable=True)
    sizes_S = jnp.bincount(group_N, length=S + 1)[:S].astype(jnp.int32)
    xs_ND = jnp.take(x_ND, order_N, axis=0)
    h_NR = jax.lax.ragged_dot(xs_ND, a_SDR.astype(x_ND.dtype), sizes_S, preferred_element_type=jnp.float32)
    u_NO = jax.lax.ragged_dot(h_NR.astype(x_ND.dtype), b_SRO.astype(x_ND.dtype), sizes_S,
                              preferred_element_type=jnp.float32)
    return jnp.zeros_like(u_NO).at[order_N].set(u_NO)  # rows past the groups came out zero


def _is_multi(x) -> bool:
    return isinstance(x, MultiLoRA)


def with_slots(tree, slots_N):
    """`tree` (a model state or any pytree) with every `MultiLoRA` leaf routing rows by `slots_N`.

    Call it inside the jitted function, on the state it merges, with one slot id per flattened
    input row of the model's matmuls (`[batch * seq]`).

    Example:
        >>> model = nnx.merge(graphdef, with_slots(state, slots_T))
    """
    return jax.tree_util.tree_map(lambda x: x.with_slots(slots_N) if _is_multi(x) else x, tree, is_leaf=_is_multi)


def has_multi_lora(tree) -> bool:
    return any(_is_multi(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_multi))


# ---------------------------------------------------------------------------- adapter files
@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """One served adapter: its name, its slot at startup (None: it waits in host memory until a request
    uses it), file, rank per target, bytes as stored (all layers), and its host copy as the slots hold it
    (`arrays`: target -> (A [..., in, R], B [..., R, out]), padded to the slots' rank, scale folded into B).
    `version` tells apart adapters loaded under the same name at different times (0 at startup)."""

    name: str
    slot: int | None
    path: str
    ranks: dict[str, int]
    alpha: dict[str, float]
    nbytes: int
    arrays: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    version: int = 0

    @property
    def rank(self) -> int:
        return max(self.ranks.values())


def check_adapter_files(modules: dict[str, str], max_lora_rank: int,
                        n_layers: int | None = None) -> dict[str, tuple[dict, dict]]:
    """{name: (per-target metadata, arrays)} of every adapter file (`jmem.lora.read_adapters`, given the
    served model's `n_layers`), checked for readability, servable targets and rank; one ValueError
    naming the file and what is wrong."""
    read = {}
    for name, path in modules.items():
        meta, stored = read_adapters(path, n_layers)
        for target, m in meta.items():
            if target not in SERVABLE:
                raise ValueError(f"adapter {os.fspath(path)!r} targets {target!r}; served adapters may target: "
                                 f"{', '.join(SERVABLE)} (serve one on the head merged into the model: "
                                 "jmem.lora.merge)")
            if m["rank"] > max_lora_rank:
                raise ValueError(f"adapter {name!r} has rank {m['rank']} on {target}, above --max-lora-rank="
                                 f"{max_lora_rank}; accepted: ranks up to --max-lora-rank")
        read[name] = meta, stored
    return read


def stack_adapters(model, modules: dict[str, str], *, max_loras: int | None = None, max_lora_rank: int = 16,
                   impl: str = "onehot", runtime_loading: bool = False):
    """A copy of `model` whose adapted kernels are `MultiLoRA` leaves holding every adapter in `modules`.

    Args:
        model: a `jmem.models.Llama` (kernels may be quantized leaves).
        modules: adapter name -> file written by `jmem.lora.save_adapters` or PEFT LoRA directory; slots
            follow this order.
        max_loras: adapter slots on the device (None: one per module, at least one). With fewer slots than
            modules the first `max_loras` modules start resident and the others wait in host memory
            (`jmem.serve.lora_slots`).
        max_lora_rank: the largest rank accepted; slots are zero-padded to the largest rank loaded.
        impl: "onehot" or "ragged" (see the module docstring).
        runtime_loading: slots for adapters read later (`read_adapter`): every target of the model (its
            `config.weight_names()`), at rank `max_lora_rank`; `modules` may then be empty.

    Returns:
        (model copy, {name: AdapterInfo}).

    Example:
        >>> served, infos = stack_adapters(lm.model, {"sql": "sql.npz", "chat": "chat.npz"})
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; accepted: {', '.join(IMPLS)}")
    if not modules and not runtime_loading:
        raise ValueError("no LoRA modules given; accepted: at least one name=path")
    bad = [n for n in modules if not isinstance(n, str) or not n.strip()]
    if bad:
        raise ValueError(f"LoRA module name {bad[0]!r}; accepted: a non-empty string (requests select it by name)")
    if max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank={max_lora_rank}; accepted: >= 1")
    slots = max(len(modules), 1) if max_loras is None else max_loras
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"--max-loras={max_loras!r}; accepted: an integer >= 1")
    read = check_adapter_files(modules, max_lora_rank, model.config.n_layers)
    layers, present = model.layers, model.config.weight_names()
    if runtime_loading:
        targets = list(present)
        R = max_lora_rank
    else:
        targets = sorted({t for meta, _ in read.values() for t in meta}, key=SERVABLE.index)
        R = max(m["rank"] for meta, _ in read.values() for m in meta.values())
    bases = {}
    for t in targets:
        if t not in present:
            raise ValueError(f"LoRA target {t!r} is not a weight of this model; accepted: {', '.join(present)}")
        base = layers.weight_var(t).get_value()
        if isinstance(base, (LoRA, MultiLoRA)):
            raise ValueError(f"the model's {t} kernel already carries an adapter; serve the base model "
                             f"(jmem.lora.remove_adapters or merge first)")
        bases[t] = base
    layout = {t: (tuple(b.shape), b.dtype if jnp.issubdtype(b.dtype, jnp.floating) else jnp.float32, R)
              for t, b in bases.items()}
    infos = {name: _adapter_info(name, i if i < slots else None, modules[name], *read[name], layout, bases)
             for i, name in enumerate(modules)}
    served = nnx.clone(model)
    resident = list(infos.values())[:slots]
    for t, (shape, dtype, _) in layout.items():
        *lead, n_in, n_out = shape
        free = slots - len(resident)  # free slots: zeros
        a_list = [info.arrays[t][0] for info in resident] + [np.zeros((*lead, n_in, R), dtype)] * free
        b_list = [info.arrays[t][1] for info in resident] + [np.zeros((*lead, R, n_out), dtype)] * free
        a = jnp.asarray(np.stack(a_list, axis=-3))  # [*lead, S, in, R]
        b = jnp.asarray(np.stack(b_list, axis=-3))  # [*lead, S, R, out]
        served.layers.weight_var(t).set_value(MultiLoRA(bases[t], a, b, impl=impl))
    return served, infos


def target_of(path) -> str:
    """The target (wq, ..., w_down, moe.expert_gate, ...) a `MultiLoRA` leaf's key path in a model state
    passes through."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return next(n if n in LINEARS else f"moe.{n}" for n in names if n in LINEARS or n in EXPERT_WEIGHTS)


def _multi_leaves(state) -> dict[str, MultiLoRA]:
    """target -> the `MultiLoRA` leaf of `state` (a model state) for it."""
    leaves = {}

    def visit(path, leaf):
        if isinstance(leaf, MultiLoRA):
            leaves[target_of(path)] = leaf
        return leaf

    jax.tree_util.tree_map_with_path(visit, state, is_leaf=_is_multi)
    return leaves


def slot_layout(state) -> dict[str, tuple]:
    """target -> (weight shape, slot dtype, slot rank) of the `MultiLoRA` leaves in `state` (a model state)."""
    return _layout(_multi_leaves(state))


def _layout(leaves: dict[str, MultiLoRA]) -> dict[str, tuple]:
    return {t: (tuple(leaf.base.shape), leaf.lora_a.dtype, leaf.rank) for t, leaf in leaves.items()}


def read_adapter(name: str, path: str, state, max_lora_rank: int, version: int = 0) -> AdapterInfo:
    """The adapter file `path` as an `AdapterInfo` waiting in host memory (slot None), laid out for the
    slots of `state` (a served model's state); one ValueError naming the file and what does not fit."""
    leaves = _multi_leaves(state)
    n_layers = next(iter(leaves.values())).base.shape[0]  # every served target is a stacked layer weight
    meta, stored = check_adapter_files({name: path}, max_lora_rank, n_layers)[name]
    return _adapter_info(name, None, path, meta, stored, _layout(leaves), {t: v.base for t, v in leaves.items()},
                         version)


def _adapter_info(name, slot, path, meta, stored, layout, bases, version=0) -> AdapterInfo:
    """`AdapterInfo` of one read adapter file, its arrays laid out as `layout` (`slot_layout`) says, checked
    against the served base weights `bases` (target -> weight leaf)."""
    host = {}
    for t in meta:  # ranks are checked against max_lora_rank when read (check_adapter_files)
        if t not in layout:
            raise ValueError(f"adapter {name!r} ({path}) targets {t}, which the served adapter slots do not hold; "
                             f"accepted: adapters targeting {', '.join(layout)}")
    for t, (shape, dtype, R) in layout.items():
        *lead, n_in, n_out = shape
        if t not in meta:
            a, b = np.zeros((*lead, n_in, R), np.float32), np.zeros((*lead, R, n_out), np.float32)
        else:
            a, b, m = stored[f"{t}.lora_a"], stored[f"{t}.lora_b"], meta[t]
            if a.shape[:-1] != (*lead, n_in) or b.shape[:-2] != tuple(lead) or b.shape[-1] != n_out \
                    or b.shape[-2] != a.shape[-1]:
                raise ValueError(f"adapter {name!r} ({path}) has {t} A {a.shape}, B {b.shape}, which do not "
                                 f"fit the model's {t} weight {shape}")
            check_base(path, t, m, bases[t])
            r = a.shape[-1]
            scale = m["alpha"] / (r ** 0.5 if m["rslora"] else r)
            pad = [(0, 0)] * (a.ndim - 1)
            a = np.pad(a.astype(np.float32), pad + [(0, R - r)])
            with np.errstate(over="ignore"):  # an overflow is refused below, by name
                b = np.pad(b.astype(np.float32) * scale, pad[:-1] + [(0, R - r), (0, 0)])
        with np.errstate(over="ignore"):
            host[t] = a.astype(dtype), b.astype(dtype)
        for side, x in zip(("A", "B x alpha/rank"), host[t]):  # one inf in a slot turns every row's delta NaN
            if not np.isfinite(x.astype(np.float32)).all():
                raise ValueError(f"adapter {name!r} ({path}): its {t} {side} is not finite in the slots' "
                                 f"{np.dtype(dtype).name}; accepted: weights whose scaled values are finite there")
    return AdapterInfo(name, slot, os.fspath(path), {t: m["rank"] for t, m in meta.items()},
                       {t: m["alpha"] for t, m in meta.items()}, int(sum(v.nbytes for v in stored.values())), host,
                       version)


def adapter_bytes(tree) -> int:
    """Device bytes of every stacked adapter array in `tree` (a model or a state)."""
    leaves = jax.tree_util.tree_leaves(nnx.state(tree) if isinstance(tree, nnx.Module) else tree, is_leaf=_is_multi)
    return sum(x.adapter_nbytes for x in leaves if _is_multi(x))


__all__ = ["MultiLoRA", "AdapterInfo", "stack_adapters", "read_adapter", "slot_layout", "target_of", "with_slots",
           "has_multi_lora", "adapter_bytes", "check_adapter_files", "BASE_SLOT", "IMPLS"]
