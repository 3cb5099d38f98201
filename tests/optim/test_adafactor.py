"""Adafactor: equal to optax.adafactor on 2-D params; stacked layers factor per layer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmem.memory.measure import tree_bytes
from jmem.optim.adafactor import Layout, adafactor, get_rule

STEPS = 5


_STEPS = {}


def _run(tx, params, grads_seq):
    state = tx.init(params)
    step = _STEPS.setdefault(tx, jax.jit(tx.update))  # keyed by tx itself, kept alive
    for g in grads_seq:
        u, state = step(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def _problem(shapes, seed=0):
    rng = np.random.default_rng(seed)
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    grads = [{k: jnp.asarray(rng.normal(size=s) * (1 + i), jnp.float32) for k, s in shapes.items()}
             for i in range(STEPS)]
    return params, grads


@pytest.mark.parametrize("settings", [
    dict(learning_rate=0.01),
    dict(learning_rate=0.05, momentum=0.9, clipping_threshold=None, multiply_by_parameter_scale=False,
         weight_decay_rate=1e-3, decay_rate=0.7),
])
def test_matches_optax_adafactor_on_2d_params(settings):
    # With min_dim_size_to_factor=16: [32, 20] and [17, 40] are factored, [8, 64] and [12] are not.
    settings = dict(settings, min_dim_size_to_factor=16)
    params, grads = _problem({"a": (32, 20), "b": (17, 40), "c": (8, 64), "d": (12,)})
    mom = dict(dtype_momentum=jnp.float32) if "momentum" in settings else {}
    ref_p, ref_s = _run(optax.adafactor(**settings, **mom), params, grads)
    ours = dict(settings, momentum_dtype=jnp.float32) if "momentum" in settings else settings
    got_p, got_s = _run(adafactor(**ours), params, grads)
    for k in params:
        assert float(jnp.abs(got_p[k] - params[k]).max()) > 1e-4  # the test moves the params
        np.testing.assert_allclose(got_p[k], ref_p[k], rtol=2e-5, atol=1e-6)
    # Same statistics, same shapes.
    ref_rms, got_rms = ref_s[0], got_s[0]
    for k in ("a", "b"):
        np.testing.assert_allclose(got_rms.v_row[k], ref_rms.v_row[k], rtol=1e-5)
        np.testing.assert_allclose(got_rms.v_col[k], ref_rms.v_col[k], rtol=1e-5)


def test_state_bytes_and_bf16_momentum():
    L, D, F = 4, 256, 384
    params = {"layers": {"w": jnp.zeros((L, D, F)), "norm": jnp.zeros((L, D))}, "embed": jnp.zeros((512, D))}
    state = adafactor(0.01).init(params)
    rms = state[0]
    # Per layer: one row (D) and one column (F) statistic; norm keeps a full per-layer v.
    assert rms.v_row["layers"]["w"].shape == (L, D) and rms.v_col["layers"]["w"].shape == (L, F)
    assert rms.v["layers"]["norm"].shape == (L, D)
    assert rms.v_row["embed"].shape == (D,) and rms.v_col["embed"].shape == (512,)
    stats = L * (D + F) + L * D + (D + 512)
    placeholders = 4  # an f32[1] in each unused slot: w.v, norm.v_row, norm.v_col, embed.v
    assert tree_bytes(state) == 4 * stats + 4 * placeholders + 4  # + the i32 step count
    n_params = L * D * F + L * D + 512 * D
    assert tree_bytes(state) <= 0.03 * 8 * n_params  # <= 3% of AdamW's two f32 moments
    with_mom = adafactor(0.01, momentum=0.9).init(params)
    extra = tree_bytes(with_mom) - tree_bytes(state)
    assert extra == 2 * n_params + 4  # bf16 momentum: 2 bytes per parameter, + its step count


@pytest.mark.parametrize("shape", [(16, 24), (24,), ()], ids=["matrix", "vector", "scalar"])
def test_stacked_layers_are_factored_per_layer(shape):
    """A stacked [L, ...] leaf updates exactly like L separate leaves (a `[L]` leaf took its clipping and
    parameter scale over the whole stack: one layer's update was 100x its own)."""
    L = 3
    rng = np.random.default_rng(1)
    scales = (10.0 ** np.arange(L)).reshape((L,) + (1,) * len(shape))
    stacked = {"layers": {"w": jnp.asarray(rng.normal(size=(L, *shape)) * scales, jnp.float32)}}
    grads = [{"layers": {"w": jnp.asarray(rng.normal(size=(L, *shape)) * (1 + 3 * np.arange(L)).reshape(scales.shape),
                                          jnp.float32)}} for _ in range(3)]
    tx = adafactor(0.01, min_dim_size_to_factor=16)
    got, _ = _run(tx, stacked, grads)
    for i in range(L):
        sep, _ = _run(tx, {"w": stacked["layers"]["w"][i]}, [{"w": g["layers"]["w"][i]} for g in grads])
        np.testing.assert_allclose(got["layers"]["w"][i], sep["w"], rtol=2e-5, atol=1e-6)
    if len(shape) < 2:
        return
    # optax's rule on a stacked leaf factors over (in, out) of the whole stack:
    # different statistics, so different updates.
    flat, _ = _run(adafactor(0.01, factor_rule="optax", min_dim_size_to_factor=16), stacked, grads)
    assert float(jnp.abs(flat["layers"]["w"] - got["layers"]["w"]).max()) > 1e-4


def test_rules_and_bad_names():
    stacked = get_rule("stacked")
    assert stacked(("layers", "wq", "kernel"), (4, 256, 512)) == Layout(1, (1, 2))
    assert stacked(("layers", "attn_norm", "scale"), (4, 256)) == Layout(1, None)
    assert stacked(("embed", "embedding"), (49152, 576)) == Layout(0, (1, 0))
    assert get_rule("last_two")((), (2, 3, 256, 512)) == Layout(2, (2, 3))
    assert get_rule("optax")((), (4, 256, 512)) == Layout(0, (1, 2))
    assert get_rule("optax")((), (512, 4, 256)) == Layout(0, (2, 0))
    with pytest.raises(ValueError, match="stacked, last_two, optax"):
        adafactor(0.01, factor_rule="biggest")
    with pytest.raises(ValueError, match="^adafactor factor_rule=3; accepted: stacked"):
        adafactor(0.01, factor_rule=3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_dim_size_to_factor="x"), "^adafactor min_dim_size_to_factor='x'; accepted: an integer >= 1$"),
    (dict(min_dim_size_to_factor=-5), "^adafactor min_dim_size_to_factor=-5; accepted: an integer >= 1$"),
    (dict(min_dim_size_to_factor=0), "^adafactor min_dim_size_to_factor=0; accepted"),
    (dict(min_dim_size_to_factor=2.5), "^adafactor min_dim_size_to_factor=2.5; accepted"),
    (dict(min_dim_size_to_factor=True), "^adafactor min_dim_size_to_factor=True; accepted"),
    (dict(decay_offset="a"), "^adafactor decay_offset='a'; accepted: an integer >= 0$"),
    (dict(decay_offset=-1), "^adafactor decay_offset=-1; accepted: an integer >= 0$"),
    (dict(decay_offset=1.5), "^adafactor decay_offset=1.5; accepted"),
    (dict(decay_offset=None), "^adafactor decay_offset=None; accepted"),
    (dict(eps=0.0), "^adafactor eps=0.0; accepted: a finite number > 0$"),
])
def test_bad_factoring_and_offset_settings_are_refused_at_build(kwargs, match):
    """Refused when the optimizer is built (were a TypeError at init or update, or accepted)."""
    with pytest.raises(ValueError, match=match):
        adafactor(0.01, **kwargs)


def test_a_decay_offset_beyond_the_state_count_starts_the_schedule():
    """With a fresh state the steps before `decay_offset` raised a negative step to a negative power: NaN
    from step 0, for good. Each of them is the schedule's first step now (v = g^2), as a fresh state's is."""
    params, grads = _problem({"w": (8, 8)})
    tx, fresh = adafactor(0.01, decay_offset=2), adafactor(0.01)
    state = tx.init(params)
    for g in grads[:2]:
        u, state = tx.update(g, state, params)
        want, _ = fresh.update(g, fresh.init(params), params)
        np.testing.assert_allclose(u["w"], want["w"], rtol=1e-6)


def test_numpy_integer_factoring_and_offset_settings_are_accepted():
    params = {"w": jnp.ones((32, 20))}
    a, _ = _run(adafactor(0.01, min_dim_size_to_factor=np.int64(16), decay_offset=np.int32(0)), params,
                [params])
    b, _ = _run(adafactor(0.01, min_dim_size_to_factor=16), params, [params])
    np.testing.assert_array_equal(a["w"], b["w"])


def test_relative_step_size_default_descends():
    params = {"w": jnp.full((8, 8), 0.5)}
    loss = lambda p: jnp.sum((p["w"] - 1.0) ** 2)  # noqa: E731
    tx = adafactor()
    state = tx.init(params)
    step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
    first = float(loss(params))
    for _ in range(20):
        u, state = step(params, state)
        params = optax.apply_updates(params, u)
    assert float(loss(params)) < 0.8 * first
