"""Pullback residuals sorted by what they depend on: the data-flow analysis, and pullbacks rebuilt
from stored leaves that give the gradients of plain `jax.vjp`."""

import jax
import jax.numpy as jnp
import numpy as np

from jmem.parallel.residuals import depends_on, split_residuals


def _layers(w, x_BD):
    """Two layers under a scan: a weight itself, its bf16 cast and its transpose are residuals."""
    def layer(h, w_l):
        a = jnp.tanh(h.astype(jnp.bfloat16) @ w_l["a"].astype(jnp.bfloat16)).astype(jnp.float32)
        scale = jax.lax.cond(w_l["b"].sum() > 0, lambda: w_l["b"], lambda: -w_l["b"])  # a branch on weights only
        return h + (a * scale) @ w_l["a"].T + jnp.tanh(h) @ w_l["c"], None
    return jax.lax.scan(layer, x_BD, w)[0]


def _params(rng):
    return {"a": jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(2, 16)), jnp.float32),
            "c": jnp.asarray(rng.normal(size=(2, 8, 8)), jnp.float32)}


def test_depends_on_follows_scan_carries_and_cond_branches():
    def f(w, x):
        def body(c, w_l):
            return (c[0] * 2.0, c[1] + x.sum()), w_l * 3.0  # the second carry picks up x after one step
        (c0, c1), ys = jax.lax.scan(body, (w.sum(), 0.0), w)
        branch = jax.lax.cond(w.sum() > 0, lambda: w * 2, lambda: w)
        return c0, c1, ys, branch, x + 1, jnp.ones(3)

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 2)), jnp.ones(3))
    assert depends_on(jaxpr, [False, True]) == [False, True, False, False, True, False]
    assert depends_on(jaxpr, [True, False]) == [True, False, True, True, False, False]


def test_pullback_from_stored_leaves_equals_vjp():
    rng = np.random.default_rng(0)
    w = _params(rng)
    x1, x2 = (jnp.asarray(rng.normal(size=(4, 8)), jnp.float32) for _ in range(2))
    res = split_residuals(_layers, w, x1)
    kinds = [k for k, _ in res.kinds]
    assert set(kinds) == {"param", "micro", "shared"}, kinds
    # w["c"] is rebuilt from the params; the cast and the transpose of w["a"] are the same for every input.
    assert ("param", 2) in res.kinds, res.kinds
    assert {(a.shape, a.dtype) for a in res.shared} >= {((2, 8, 16), jnp.dtype(jnp.bfloat16)), ((2, 16, 8), jnp.dtype(jnp.float32))}
    assert all(a.shape[0] == 2 and a.shape[1] == 4 for a in res.micro), res.micro  # [layer, row, ...] activations

    ct = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    _, kept = jax.jit(res.forward)(w, x1)[1:]  # shared leaves computed from another input
    y2, micro2, _ = jax.jit(res.forward)(w, x2)
    got = jax.jit(lambda m, k, c: res.pullback(w, m, k)(c))(micro2, kept, ct)
    y_ref, vjp = jax.vjp(_layers, w, x2)
    want = vjp(ct)
    np.testing.assert_allclose(y2, y_ref, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
