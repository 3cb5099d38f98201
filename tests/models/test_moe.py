"""MoE block: routing with capacity against a dense per-token reference, losses, sharding on `expert`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.models.moe import MOE_LOGICAL_AXES, MoEMLP, capacity, moe_mlp, moe_mlp_dropless, route


def reference(x_NE, router, gate, up, down, top_k, cap):
    """Per-token loop: top-k experts, gates renormalised, places in token order (`x_NE` in priority order),
    each token's choices in rank order."""
    x_NE, router, gate, up, down = (np.asarray(a, np.float64) for a in (x_NE, router, gate, up, down))
    N, X = x_NE.shape[0], router.shape[1]
    logits = x_NE @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    used = [0] * X
    keep = np.zeros((N, top_k), bool)
    for n in range(N):
        for k in range(top_k):
            e = order[n, k]
            if used[e] < cap:
                keep[n, k] = True
                used[e] += 1
    y = np.zeros_like(x_NE)
    for n in range(N):
        g = probs[n, order[n]]
        g = g / g.sum() if top_k > 1 else g
        for k in range(top_k):
            if keep[n, k]:
                e = order[n, k]
                h = x_NE[n] @ gate[e]
                hid = h / (1 + np.exp(-h)) * (x_NE[n] @ up[e])
                y[n] += g[k] * (hid @ down[e])
    load = np.bincount(order.ravel(), minlength=X) / (N * top_k)
    aux = X * np.sum(load * probs.mean(0))
    return y, int((~keep).sum()), load, aux


@pytest.mark.parametrize("top_k,cf", [(1, 1.0), (2, 0.75), (2, 4.0)])
def test_moe_matches_per_token_reference(top_k, cf):
    moe = MoEMLP(16, 24, n_experts=4, top_k=top_k, capacity_factor=cf, rngs=nnx.Rngs(top_k))
    x = jax.random.normal(jax.random.key(7 + top_k), (2, 12, 16), jnp.float32)
    y, stats = moe(x)
    w = moe.weights()
    cap = capacity(24, 4, top_k, cf)
    by_position = lambda a: np.asarray(a).swapaxes(0, 1).reshape(24, -1)  # noqa: E731 - the routing priority
    y_ref, dropped, load, aux = reference(by_position(x), w["router"], w["gate"], w["up"], w["down"], top_k, cap)
    np.testing.assert_allclose(by_position(y), y_ref, rtol=2e-5, atol=2e-5)
    assert int(stats.dropped) == dropped
    np.testing.assert_allclose(np.asarray(stats.load), load, rtol=1e-6)
    np.testing.assert_allclose(float(stats.aux_loss), aux, rtol=1e-5)
    if cf >= 4.0:
        assert dropped == 0
    if cf < 1.0:
        assert dropped > 0


@pytest.mark.parametrize("top_k,cf,dropless", [(1, 0.5, False), (2, 0.75, False), (2, 1.0, True)])
def test_padding_takes_no_place_and_counts_in_no_statistic(top_k, cf, dropless):
    """With `token_mask_BT`, padded tokens route nowhere (output 0): the real tokens get what the
    per-token reference gives them alone, with the capacity of the whole batch, and the statistics are
    theirs (padding took places and dropped real tokens of other rows, and entered the losses)."""
    moe = MoEMLP(16, 24, n_experts=4, top_k=top_k, capacity_factor=cf, rngs=nnx.Rngs(top_k))
    x = jax.random.normal(jax.random.key(3), (3, 10, 16), jnp.float32)
    mask = np.ones((3, 10), np.float32)
    mask[0, 4:], mask[2, 7:] = 0, 0
    w = moe.weights()
    y, stats = moe_mlp(x, w["router"], w["gate"], w["up"], w["down"], top_k=top_k, capacity_factor=cf,
                       dropless=dropless, token_mask_BT=jnp.asarray(mask))
    by_position = lambda a: np.asarray(a).swapaxes(0, 1).reshape(30, -1)  # noqa: E731 - the routing priority
    real = by_position(mask)[:, 0] > 0
    cap = 10**6 if dropless else capacity(30, 4, top_k, cf)
    y_ref, dropped, load, aux = reference(by_position(x)[real], w["router"], w["gate"], w["up"], w["down"], top_k, cap)
    np.testing.assert_allclose(by_position(y)[real], y_ref, rtol=2e-5, atol=2e-5)
    assert not np.asarray(by_position(y)[~real]).any() or dropless
    assert int(stats.dropped) == dropped and (dropped > 0) == (cf < 1 and not dropless)
    np.testing.assert_allclose(np.asarray(stats.load), load, rtol=1e-6)
    np.testing.assert_allclose(float(stats.aux_loss), aux, rtol=1e-5)
    logits = by_position(x)[real] @ np.asarray(w["router"], np.float64)
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(float(stats.z_loss), z, rtol=1e-5)


def one_hot_moe(x_BTE, w, top_k, cf):
    """GShard's dispatch and combine as one-hot einsums over [tokens, experts, capacity] (the plain
    reference of the scatter/gather in `moe_mlp`; memory grows with the square of the tokens)."""
    B, T, E = x_BTE.shape
    X = w["router"].shape[-1]
    cap = capacity(B * T, X, top_k, cf)
    x_NE = x_BTE.swapaxes(0, 1).reshape(T * B, E)
    probs = jax.nn.softmax(x_NE @ w["router"], axis=-1)
    gate, idx = jax.lax.top_k(probs, top_k)
    gate = gate / jnp.sum(gate, axis=-1, keepdims=True) if top_k > 1 else gate
    flat_QX = jax.nn.one_hot(idx, X).reshape(-1, X)
    pos_Q = jnp.sum((jnp.cumsum(flat_QX, axis=0) - 1.0) * flat_QX, axis=-1).astype(jnp.int32)
    slot_QC = jax.nn.one_hot(pos_Q, cap) * (pos_Q < cap)[:, None]
    disp_NKXC = (flat_QX[:, :, None] * slot_QC[:, None, :]).reshape(T * B, top_k, X, cap)
    dispatch, combine = disp_NKXC.sum(1), (disp_NKXC * gate[:, :, None, None]).sum(1)
    h_XCE = jnp.einsum("nxc,ne->xce", dispatch, x_NE)
    hid = jax.nn.silu(jnp.einsum("xce,xef->xcf", h_XCE, w["gate"])) * jnp.einsum("xce,xef->xcf", h_XCE, w["up"])
    y_NE = jnp.einsum("nxc,xce->ne", combine, jnp.einsum("xcf,xfe->xce", hid, w["down"]))
    return y_NE.reshape(T, B, E).swapaxes(0, 1)


@pytest.mark.parametrize("top_k,cf", [(1, 0.5), (2, 0.75), (2, 2.0)])
def test_scatter_gather_dispatch_equals_one_hot_einsums_with_gradients(top_k, cf):
    """`moe_mlp`'s scatter to places and gather back against the one-hot einsums: outputs and the
    gradients of the input and of every weight (router included, through the gates)."""
    moe = MoEMLP(16, 24, n_experts=4, top_k=top_k, capacity_factor=cf, rngs=nnx.Rngs(5))
    w = moe.weights()
    x = jax.random.normal(jax.random.key(11), (2, 12, 16), jnp.float32)

    def ours(x, w):
        return moe_mlp(x, w["router"], w["gate"], w["up"], w["down"], top_k=top_k, capacity_factor=cf)[0]

    def loss(f):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))

    (val, grads), (val_ref, grads_ref) = loss(ours)(x, w), loss(lambda x, w: one_hot_moe(x, w, top_k, cf))(x, w)
    np.testing.assert_allclose(float(val), float(val_ref), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ours(x, w)), np.asarray(one_hot_moe(x, w, top_k, cf)), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_train_step_memory_is_linear_in_the_tokens():
    """No [tokens, experts, capacity] tensor: 4x the tokens costs under 5x the step's temporaries
    (the one-hot einsums: over 8x, growing with the square of the tokens)."""
    from jmem.memory.measure import measure

    w = MoEMLP(32, 64, n_experts=4, top_k=2, rngs=nnx.Rngs(0)).weights()
    ours = lambda x, w: moe_mlp(x, w["router"], w["gate"], w["up"], w["down"], top_k=2)[0]  # noqa: E731

    def temp(f, tokens):
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))
        return measure(grad, jax.ShapeDtypeStruct((2, tokens, 32), jnp.float32), w).temp_bytes

    assert temp(ours, 1024) < 5 * temp(ours, 256)
    one_hot = lambda x, w: one_hot_moe(x, w, 2, 1.25)  # noqa: E731
    assert temp(one_hot, 1024) > 8 * temp(one_hot, 256)
    assert temp(ours, 1024) < temp(one_hot, 1024) / 10


@pytest.mark.parametrize("top_k,cf", [(1, 0.5), (2, 0.75)])
def test_tokens_keep_their_place_whatever_comes_after_them(top_k, cf):
    """Causal: with places short, outputs at positions < 6 do not change when later tokens do."""
    moe = MoEMLP(16, 24, n_experts=4, top_k=top_k, capacity_factor=cf, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(1), (2, 12, 16), jnp.float32)
    x2 = x.at[:, 6:].set(jax.random.normal(jax.random.key(2), (2, 6, 16), jnp.float32))
    (y, stats), (y2, _) = moe(x), moe(x2)
    assert int(stats.dropped) > 0
    np.testing.assert_array_equal(np.asarray(y[:, :6]), np.asarray(y2[:, :6]))


@pytest.mark.parametrize("top_k", [1, 3])
def test_dropless_matches_reference_without_capacity_and_its_gradients(top_k):
    """Grouped matmuls over expert-sorted assignments = every token's top-k experts (the
    reference with room for all), and the same gradients as the one-hot path with cap = tokens."""
    moe = MoEMLP(16, 24, n_experts=5, top_k=top_k, rngs=nnx.Rngs(10 + top_k))
    w = moe.weights()
    x = jax.random.normal(jax.random.key(20 + top_k), (3, 7, 16), jnp.float32)
    y, stats = jax.jit(moe_mlp_dropless, static_argnames="top_k")(x, w["router"], w["gate"], w["up"], w["down"],
                                                                  top_k=top_k)
    by_position = lambda a: np.asarray(a).swapaxes(0, 1).reshape(21, -1)  # noqa: E731
    y_ref, dropped, load, aux = reference(by_position(x), w["router"], w["gate"], w["up"], w["down"], top_k, 21)
    assert dropped == 0 and int(stats.dropped) == 0
    np.testing.assert_allclose(by_position(y), y_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(stats.load), load, rtol=1e-6)
    np.testing.assert_allclose(float(stats.aux_loss), aux, rtol=1e-5)

    def loss(ws, x, dropless):
        y, st = moe_mlp(x, *ws, top_k=top_k, capacity_factor=5 / top_k, dropless=dropless)
        return jnp.sum(jnp.sin(y)) + st.aux_loss

    ws = (w["router"], w["gate"], w["up"], w["down"])
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    g_sparse, g_onehot = grads(ws, x, True), grads(ws, x, False)
    for a, b in zip(jax.tree.leaves(g_sparse), jax.tree.leaves(g_onehot)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_z_loss_and_bad_settings():
    logits = jax.random.normal(jax.random.key(1), (10, 4)) * 3
    _, _, stats = route(logits, 2, 5)
    expect = np.mean(np.square(np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))))
    np.testing.assert_allclose(float(stats.z_loss), expect, rtol=1e-5)
    with pytest.raises(ValueError, match="top_k=5"):
        MoEMLP(8, 8, n_experts=4, top_k=5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEMLP(8, 8, n_experts=4, capacity_factor=0.0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dropless", [False, True])
def test_bf16_inputs_route_on_f32_logits(dropless):
    """Experts 0 and 1 score within a bf16 rounding of each other: the choice follows the f32 logits of the
    bf16 input (bf16 logits tied them, and the tie went to expert 0 for every token)."""
    rng = np.random.default_rng(0)
    w = MoEMLP(16, 8, 4, rngs=nnx.Rngs(0)).weights()
    r = np.asarray(rng.normal(size=(16, 4)), np.float32)
    r[:, 1] = r[:, 0] * (1 + 2**-10)  # expert 1 beats expert 0 where expert 0's logit is positive
    x = jnp.asarray(rng.normal(size=(1, 64, 16)), jnp.bfloat16)
    logits = np.asarray(x[0], np.float32) @ r
    want = np.bincount(np.argmax(logits, -1), minlength=4) / 64
    rounded = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32)
    assert (np.argmax(rounded, -1) != np.argmax(logits, -1)).sum() >= 5  # bf16 logits choose otherwise
    fn = moe_mlp_dropless if dropless else moe_mlp
    _, stats = fn(x, jnp.asarray(r), *(w[k].astype(jnp.bfloat16) for k in ("gate", "up", "down")), top_k=1)
    np.testing.assert_array_equal(np.asarray(stats.load), want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=1.5), r"^moe top_k=1\.5; accepted: an integer in 1\.\.n_experts=4$"),
    (dict(top_k=True), r"^moe top_k=True; accepted: an integer in 1\.\.n_experts=4$"),
    (dict(top_k=0), r"^moe top_k=0; accepted"),
    (dict(capacity_factor=float("inf")), r"^moe capacity_factor=inf; accepted: a finite number > 0$"),
    (dict(capacity_factor=float("nan")), r"^moe capacity_factor=nan; accepted"),
    (dict(capacity_factor="1"), r"^moe capacity_factor='1'; accepted"),
    (dict(capacity_factor=True), r"^moe capacity_factor=True; accepted"),
])
def test_bad_settings_are_one_clear_error_in_both_paths(kwargs, match):
    """The same check for the pure function and the module (was a TypeError, an OverflowError, or accepted)."""
    moe = MoEMLP(8, 6, 4, rngs=nnx.Rngs(0))
    w = moe.weights()
    x = jnp.ones((1, 4, 8))
    with pytest.raises(ValueError, match=match):
        moe_mlp(x, w["router"], w["gate"], w["up"], w["down"], **kwargs)
    with pytest.raises(ValueError, match=match):
        MoEMLP(8, 6, 4, rngs=nnx.Rngs(0), **kwargs)
    if "top_k" in kwargs:
        with pytest.raises(ValueError, match=match):
            moe_mlp_dropless(x, w["router"], w["gate"], w["up"], w["down"], **kwargs)


def test_mismatched_shapes_and_helper_arguments_are_one_clear_error():
    """Raw einsum / ragged_dot / top_k errors (or silence: route with cap 0 dropped everything) before."""
    w = MoEMLP(8, 6, 4, rngs=nnx.Rngs(0)).weights()
    x = jnp.ones((1, 4, 8))
    three = {k: v[:3] for k, v in w.items() if k != "router"}  # 3 experts' weights, a 4-expert router
    for fn in (moe_mlp, moe_mlp_dropless):
        with pytest.raises(ValueError, match=r"^moe gate weight of shape \(3, 8, 6\); accepted: \[4, 8, 6\] for 4 "
                                             r"experts \(the router's\)"):
            fn(x, w["router"], three["gate"], three["up"], three["down"])
        with pytest.raises(ValueError, match=r"^moe input of shape \(4, 8\); accepted: \[batch, seq, embed\]"):
            fn(x[0], w["router"], w["gate"], w["up"], w["down"])
        with pytest.raises(ValueError, match=r"^moe input of shape \(1, 0, 8\); accepted: at least one token$"):
            fn(x[:, :0], w["router"], w["gate"], w["up"], w["down"])  # ZeroDivisionError before
        # A [seq, batch] mask of the same size masked the wrong tokens without a word.
        for mask in (jnp.ones((4, 1)), jnp.ones((1, 5)), jnp.ones((4,))):
            with pytest.raises(ValueError, match=rf"^token_mask_BT of shape {re.escape(str(mask.shape))}; accepted: "
                                                 r"\[batch, seq\] = \[1, 4\], the input's$"):
                fn(x, w["router"], w["gate"], w["up"], w["down"], token_mask_BT=mask)
    logits = jnp.zeros((6, 4))
    with pytest.raises(ValueError, match=r"^moe top_k=5; accepted: an integer in 1\.\.n_experts=4$"):
        route(logits, 5, 2)
    with pytest.raises(ValueError, match=r"^moe route cap=0; accepted: an integer >= 1"):
        route(logits, 2, 0)
    with pytest.raises(ValueError, match=r"^moe capacity_factor=0\.0; accepted: a finite number > 0$"):
        capacity(10, 4, 2, 0.0)
    for n in (0, -3):  # 1 place for no tokens, past the documented bound
        with pytest.raises(ValueError, match=rf"^moe n_tokens={n}; accepted: an integer >= 1"):
            capacity(n, 4, 2, 1.0)
    # A huge factor ("never drop") gives every expert a place per token, no more (it overflowed int32 in route).
    assert capacity(10, 4, 2, 1e30) == 10 and capacity(10, 4, 2, 1.0) == 5
    with pytest.raises(ValueError, match=r"^LlamaConfig\.moe_dropless='no'; accepted: True or False$"):
        from jmem.models import LlamaConfig

        LlamaConfig.tiny_moe(moe_dropless="no")


@pytest.mark.parametrize("args, match", [
    ((8, 6, 2.5), r"^moe n_experts=2\.5; accepted: an integer >= 1$"),
    ((8, 6, True), r"^moe n_experts=True; accepted: an integer >= 1$"),
    ((8, 6, 0), r"^moe n_experts=0; accepted: an integer >= 1$"),
    ((0, 6, 4), r"^MoEMLP dim=0; accepted: an integer >= 1$"),
    ((8, 0, 4), r"^MoEMLP ffn_dim=0; accepted: an integer >= 1$"),
    ((8, 6.0, 4), r"^MoEMLP ffn_dim=6\.0; accepted: an integer >= 1$"),
])
def test_bad_module_sizes_are_one_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        MoEMLP(*args, top_k=1, rngs=nnx.Rngs(0))
    MoEMLP(np.int64(8), 6, np.int32(4), top_k=np.int64(2), rngs=nnx.Rngs(0))  # NumPy integers are integers


def test_balancing_loss_moves_skewed_router_toward_uniform():
    X, E = 4, 16
    x = jax.random.normal(jax.random.key(3), (256, E)) + 1.0  # shared mean direction
    router = 0.05 * jax.random.normal(jax.random.key(4), (E, X))
    router = router.at[:, 0].add(0.1)  # every token's first choice is expert 0

    def aux(r):
        _, _, s = route(x @ r, 2, capacity(256, X, 2, 1.0))
        return s.aux_loss, s

    grad = jax.jit(jax.value_and_grad(aux, has_aux=True))
    (a0, s0), _ = grad(router)
    r = router
    for _ in range(80):
        (_, _), g = grad(r)
        r = r - 1.0 * g
    (a1, s1), _ = grad(r)
    assert float(jnp.max(s0.load)) > 0.45  # skewed start
    assert float(a1) < float(a0)
    assert float(jnp.max(s1.load)) < 0.35  # near uniform (0.25)
    assert int(s1.dropped) < int(s0.dropped)


def test_experts_sharded_on_expert_axis_same_output():
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jmem.parallel import Rules, constrain, make_mesh, shard

    mesh = make_mesh("data=2,expert=4")
    moe = MoEMLP(16, 32, n_experts=4, top_k=2, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(moe, nnx.Param))
    sharded = shard(params, Rules.parse(), mesh, logical_axes=MOE_LOGICAL_AXES)
    assert sharded["expert_gate"].sharding.spec == P("expert", None, None)
    x = jax.random.normal(jax.random.key(2), (8, 6, 16))
    fix = lambda v: constrain(v, ("exp", None, None), Rules.parse(), mesh)  # noqa: E731

    def f(p, x):
        return moe_mlp(x, p["router"]["kernel"], p["expert_gate"], p["expert_up"], p["expert_down"], top_k=2,
                       expert_constraint=fix)[0]

    x_sh = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    got = jax.jit(f)(sharded, x_sh)
    want = moe(x)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_expert_sharded_step_memory_per_device():
    """Experts on `expert` (data=2, expert=4): the scatter/gather step against the one-hot einsums,
    per device, both with the expert buffer pinned to the experts' axis."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jmem.memory.measure import measure
    from jmem.parallel import Rules, constrain, make_mesh, shard

    mesh = make_mesh("data=2,expert=4")
    moe = MoEMLP(64, 128, n_experts=8, top_k=2, rngs=nnx.Rngs(0))
    params = shard(nnx.to_pure_dict(nnx.state(moe, nnx.Param)), Rules.parse(), mesh, logical_axes=MOE_LOGICAL_AXES)
    fix = lambda v: constrain(v, ("exp", None, None), Rules.parse(), mesh)  # noqa: E731
    x = jax.device_put(jax.random.normal(jax.random.key(2), (16, 256, 64)), NamedSharding(mesh, P(("data", "expert"))))

    def ours(p, x):
        return moe_mlp(x, p["router"]["kernel"], p["expert_gate"], p["expert_up"], p["expert_down"], top_k=2,
                       expert_constraint=fix)[0]

    def one_hot(p, x):
        w = {"router": p["router"]["kernel"], "gate": p["expert_gate"], "up": p["expert_up"], "down": p["expert_down"]}
        return one_hot_moe(x, w, 2, 1.25)

    temps = {}
    for name, f in (("scatter/gather", ours), ("one-hot einsums", one_hot)):
        temps[name] = measure(jax.jit(jax.grad(lambda p, x: jnp.sum(f(p, x) ** 2))), params, x).temp_bytes
        print(f"{name}: {temps[name] / 2**20:.1f} MiB of temporaries per device")
    np.testing.assert_allclose(np.asarray(jax.jit(ours)(params, x)), np.asarray(moe(x)[0]), rtol=1e-5, atol=1e-5)
    assert temps["scatter/gather"] < temps["one-hot einsums"] / 5

