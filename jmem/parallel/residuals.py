"""A stage's backward pass as stored residuals: the pullback of `jax.vjp`, split by what it depends on.

The 1F1B schedule runs a microbatch's forward tick and its backward tick far
apart, so what the backward tick needs must be stored in between. `jax.vjp`
returns the pullback as a pytree whose leaves are its residuals: storing those
leaves and rebuilding the pullback later runs no forward twice. Not every leaf
belongs to the microbatch, though: the parameters themselves (a matmul's
backward needs its weight), values computed from the parameters alone (their
bf16 casts under mixed precision) and constants (RoPE tables, causal masks)
are the same for every microbatch. `split_residuals` finds which leaves depend
on the stage input by following the data flow of the traced program (through
`scan`, `cond`, `jit` and `checkpoint` bodies), so a stage stores the
activation residuals once per microbatch in flight and the rest once.

Example:
    >>> res = split_residuals(stage_fn, w, x)
    >>> y, per_micro, shared = res.forward(w, x)
    >>> g_w, g_x = res.pullback(w, per_micro, shared)(ct_y)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax


def _as_jaxpr(j):
    return getattr(j, "jaxpr", j)  # a ClosedJaxpr's open jaxpr, or the Jaxpr itself


def _is_var(v) -> bool:
    return not hasattr(v, "val")  # Literals carry a value; Vars do not


def depends_on(jaxpr, in_mask: list[bool]) -> list[bool]:
    """Which outputs of `jaxpr` (a Jaxpr or ClosedJaxpr) depend on the inputs marked in `in_mask`.

    Exact through the bodies of `scan` (a fixpoint over the carry), `cond` and call-like
    primitives whose body maps inputs and outputs one to one (`jit`, `checkpoint`,
    `custom_jvp_call`, `custom_vjp_call`); any other primitive is assumed to make every
    output depend on every input (safe: it can only mark more).
    """
    jaxpr = _as_jaxpr(jaxpr)
    marked = {v for v, m in zip(jaxpr.invars, in_mask, strict=True) if m}
    for eqn in jaxpr.eqns:
        ins = [_is_var(v) and v in marked for v in eqn.invars]
        if any(ins):
            outs = _eqn_depends_on(eqn, ins)
            marked.update(v for v, m in zip(eqn.outvars, outs) if m)
    return [_is_var(v) and v in marked for v in jaxpr.outvars]


def _eqn_depends_on(eqn, ins: list[bool]) -> list[bool]:
    n_out = len(eqn.outvars)
    params = eqn.params
    name = eqn.primitive.name
    if name == "scan":
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        carry = ins[n_consts:n_consts + n_carry]
        while True:  # a carry that depends on the input makes the next iteration depend on it
            outs = depends_on(params["jaxpr"], ins[:n_consts] + carry + ins[n_consts + n_carry:])
            new_carry = [a or b for a, b in zip(carry, outs[:n_carry])]
            if new_carry == carry:
                return outs
            carry = new_carry
    if name == "cond" and not ins[0]:
        per_branch = [depends_on(b, ins[1:]) for b in params["branches"]]
        return [any(col) for col in zip(*per_branch)]
    if name != "while":
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            body = params.get(key)
            if body is not None and hasattr(_as_jaxpr(body), "eqns"):
                inner = _as_jaxpr(body)
                if len(inner.invars) == len(ins) and len(inner.outvars) == n_out:
                    return depends_on(inner, ins)
    return [True] * n_out


@dataclass(frozen=True)
class StageResiduals:
    """How to store and rebuild the pullback of `fn(params, x)` (see `split_residuals`)."""

    fn: Callable
    treedef: Any
    kinds: tuple[tuple[str, int], ...]  # per pullback leaf: ("param", i) | ("micro", j) | ("shared", k)
    micro: tuple[jax.ShapeDtypeStruct, ...]  # leaves stored once per microbatch
    shared: tuple[jax.ShapeDtypeStruct, ...]  # leaves that depend on the parameters or on nothing

    def forward(self, params, x):
        """`(y, micro leaves, shared leaves)`: the output and what the pullback needs."""
        y, vjp = jax.vjp(self.fn, params, x)
        leaves = jax.tree.leaves(vjp)
        micro = tuple(leaves[i] for i, (k, _) in enumerate(self.kinds) if k == "micro")
        shared = tuple(leaves[i] for i, (k, _) in enumerate(self.kinds) if k == "shared")
        return y, micro, shared

    def pullback(self, params, micro, shared) -> Callable:
        """The pullback `ct_y -> (ct_params, ct_x)` rebuilt from stored leaves and the params."""
        sources = {"param": jax.tree.leaves(params), "micro": micro, "shared": shared}
        leaves = [sources[k][i] for k, i in self.kinds]
        return jax.tree.unflatten(self.treedef, leaves)


def split_residuals(fn: Callable, params, x) -> StageResiduals:
    """Trace `jax.vjp(fn, params, x)` once and sort its pullback's leaves.

    Args:
        fn: `(params, x) -> y`.
        params, x: arrays or `jax.ShapeDtypeStruct`s of the actual arguments.

    Returns:
        A `StageResiduals`: leaves that are parameters are rebuilt from the params
        (never stored), leaves that do not depend on `x` are "shared" (the same for
        every `x`), the rest "micro" (one set per input).
    """
    out = {}

    def leaves_of_pullback(p, x_):
        _, vjp = jax.vjp(fn, p, x_)
        leaves, out["treedef"] = jax.tree.flatten(vjp)
        p_leaves = jax.tree.leaves(p)
        out["param"] = [next((i for i, q in enumerate(p_leaves) if q is leaf), None) for leaf in leaves]
        return leaves

    closed = jax.make_jaxpr(leaves_of_pullback)(params, x)
    n_params = len(jax.tree.leaves(params))
    n_x = len(closed.jaxpr.invars) - n_params
    on_x = depends_on(closed, [False] * n_params + [True] * n_x)
    kinds, micro, shared = [], [], []
    for leaf_param, dep, aval in zip(out["param"], on_x, closed.out_avals, strict=True):
        spec = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        if leaf_param is not None:
            kinds.append(("param", leaf_param))
        elif dep:
            kinds.append(("micro", len(micro)))
            micro.append(spec)
        else:
            kinds.append(("shared", len(shared)))
            shared.append(spec)
    return StageResiduals(fn, out["treedef"], tuple(kinds), tuple(micro), tuple(shared))
