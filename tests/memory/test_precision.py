"""Precision policies, loss scaling, non-finite skipping and master weights."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmem.memory.precision import (
    DynamicLossScale,
    NoOpLossScale,
    Policy,
    PrecisionError,
    all_finite,
    cast_floating,
    global_norm,
    loss_scale_for,
    skip_nonfinite,
    with_master_weights,
)


def test_parse_and_string_round_trip():
    p = Policy.parse("p=f32,c=bf16,o=f32")
    assert (p.param, p.compute, p.output) == (np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float32"))
    assert str(p) == "p=f32,c=bf16,o=f32"
    assert Policy.parse(str(p)) == p
    assert Policy.parse("c=bfloat16, o=float32, p=fp32") == p
    assert Policy.parse("bf16") == p
    assert Policy.parse("f32") == Policy()
    assert Policy.parse("bf16-pure").param == np.dtype(jnp.bfloat16)
    assert Policy.parse("f16").needs_loss_scale and not p.needs_loss_scale
    assert hash(p) == hash(Policy.parse("bf16"))  # frozen, usable as a dict key / static arg


@pytest.mark.parametrize("bad", ["", "p=f33", "x=f32", "p=f32,p=bf16", "bf17", "p:f32", "p=int8"])
def test_bad_strings_raise_one_clear_error(bad):
    with pytest.raises(PrecisionError) as e:
        Policy.parse(bad)
    assert "\n" not in str(e.value)


def test_casts_only_floating_leaves():
    tree = {"w": jnp.ones((2, 3)), "ids": jnp.arange(3), "key": jax.random.key(0),
            "sds": jax.ShapeDtypeStruct((4,), jnp.float32), "sds_i": jax.ShapeDtypeStruct((4,), jnp.int32)}
    out = Policy.parse("bf16").cast_to_compute(tree)
    assert out["w"].dtype == jnp.bfloat16
    assert out["ids"].dtype == jnp.int32
    assert out["key"] is tree["key"]
    assert out["sds"].dtype == jnp.bfloat16 and out["sds"].shape == (4,)
    assert out["sds_i"].dtype == jnp.int32
    assert Policy.parse("bf16").cast_to_param(out)["w"].dtype == jnp.float32
    assert cast_floating(tree, "bf16")["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", ["bogus", "int8", 3, jnp.int8, jnp.float64])
def test_bad_cast_dtype_is_one_clear_error(bad):
    with pytest.raises(PrecisionError, match=r"^(unknown )?dtype .*; accepted: .*(bf16|bfloat16)"):
        cast_floating({"w": jnp.ones(2)}, bad)


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf"), True, "8"])
def test_bad_initial_loss_scale_is_one_clear_error(bad):
    with pytest.raises(ValueError, match=r"^DynamicLossScale: initial_scale=.*; accepted: a finite number > 0$"):
        DynamicLossScale.create(bad)


@pytest.mark.parametrize("kw, message", [
    (dict(growth_interval=2.5), "growth_interval=2.5; accepted: an integer >= 1"),
    (dict(growth_interval="10"), "growth_interval='10'; accepted: an integer >= 1"),
    (dict(growth_interval=True), "growth_interval=True; accepted: an integer >= 1"),
    (dict(growth_interval=0), "growth_interval=0; accepted: an integer >= 1"),
    (dict(max_scale="big"), "max_scale='big'; accepted: a finite number > 0"),
    (dict(max_scale=float("inf")), "max_scale=inf; accepted: a finite number > 0"),
    (dict(min_scale=0.0), "min_scale=0.0; accepted: a finite number > 0"),
    (dict(growth_factor="2"), "growth_factor='2'; accepted: a finite number > 1"),
    (dict(backoff_factor=1.0), "backoff_factor=1.0; accepted: a number in (0, 1)"),
    (dict(max_scale=0.5), "min_scale=1.0, initial_scale=32768.0, max_scale=0.5; "
                          "accepted: min_scale <= initial_scale <= max_scale"),
    (dict(initial_scale=4.0, min_scale=8.0, max_scale=2.0), "min_scale=8.0, initial_scale=4.0, max_scale=2.0; "
                                                            "accepted: min_scale <= initial_scale <= max_scale"),
])
def test_bad_loss_scale_settings_are_one_clear_error(kw, message):
    with pytest.raises(ValueError, match="^DynamicLossScale: " + re.escape(message) + "$"):
        DynamicLossScale.create(**kw)


def test_loss_scale_settings_take_numpy_numbers_and_equal_bounds():
    ls = DynamicLossScale.create(np.float32(4.0), growth_interval=np.int64(1), min_scale=4, max_scale=4.0)
    assert float(ls.adjust(jnp.array(True)).scale_value) == 4.0
    assert float(ls.adjust(jnp.array(False)).scale_value) == 4.0
    # A Python number is a loss or gradient too.
    assert float(ls.scale(1.5)) == 6.0 and float(ls.unscale({"g": 2.0})["g"]) == 0.5 and ls.scale(3).dtype == jnp.int32


def test_dynamic_loss_scale_grows_and_backs_off():
    ls = DynamicLossScale.create(8.0, growth_interval=3, min_scale=2.0)
    adjust = jax.jit(lambda ls, f: ls.adjust(f))
    seen = []
    for finite in [True, True, True, True, False, False, False]:
        ls = adjust(ls, jnp.array(finite))
        seen.append((float(ls.scale_value), int(ls.counter)))
    assert seen == [(8, 1), (8, 2), (16, 0), (16, 1), (8, 0), (4, 0), (2, 0)]
    ls = adjust(ls, jnp.array(False))
    assert float(ls.scale_value) == 2.0  # floored at min_scale
    g = {"a": jnp.array([2.0, 4.0], jnp.float16)}
    np.testing.assert_array_equal(ls.unscale(ls.scale(g))["a"], g["a"])
    assert isinstance(loss_scale_for("bf16"), NoOpLossScale)
    assert isinstance(loss_scale_for("f16"), DynamicLossScale)
    with pytest.raises(ValueError, match="^DynamicLossScale: initial_scale=-1.0; accepted"):
        loss_scale_for("bf16", initial_scale=-1.0)


def test_f16_gradients_unscale_into_f32():
    """Scaled by 2^15, a gradient of 1e-9 is 3.3e-5 in f16; unscaled back into f16 it was 0 (and values below
    6e-5 lost bits): f16 leaves come back in f32, other dtypes keep theirs."""
    ls = DynamicLossScale.create(2.0**15)
    scaled = {"h": jnp.array([1e-9 * 2**15, 3.0], jnp.float16), "b": jnp.array([2.0], jnp.bfloat16),
              "i": jnp.array([3], jnp.int32)}
    out = ls.unscale(scaled)
    assert out["h"].dtype == jnp.float32 and out["b"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32
    np.testing.assert_allclose(out["h"], np.asarray(scaled["h"], np.float32) / 2**15, rtol=1e-6)
    assert float(out["h"][0]) > 0.9e-9


def test_global_norm_sums_in_f32():
    g = {"a": jnp.full((1000,), 300.0, jnp.float16), "b": jnp.full((1000,), 1e-4, jnp.float16)}
    want = np.sqrt(1000 * 300.0**2 + 1000 * float(np.float16(1e-4)) ** 2)
    np.testing.assert_allclose(float(global_norm(g)), want, rtol=1e-6)
    np.testing.assert_allclose(float(global_norm({"b": g["b"]})), np.sqrt(1000) * float(np.float16(1e-4)), rtol=1e-6)


def test_fp16_overflow_step_is_skipped_and_counted():
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    tx = skip_nonfinite(optax.adam(0.1))
    state = tx.init(params)
    step = jax.jit(tx.update)
    u1, state = step({"w": jnp.array([1.0, 1.0, 1.0])}, state, params)
    inner_after_good = state.inner
    u2, state = step({"w": jnp.array([1.0, jnp.inf, 1.0])}, state, params)
    np.testing.assert_array_equal(u2["w"], 0.0)
    assert int(state.skipped_steps) == 1 and not bool(state.last_finite)
    jax.tree.map(np.testing.assert_array_equal, state.inner, inner_after_good)
    u3, state = step({"w": jnp.array([1.0, 1.0, 1.0])}, state, params)
    assert bool(state.last_finite) and int(state.skipped_steps) == 1
    assert bool(all_finite(u3)) and not bool(all_finite({"x": jnp.array([jnp.nan])}))


def test_master_weights_match_f32_training():
    """bf16 params + f32 master follow f32 training exactly in the master copy,
    and the bf16 params are the rounded master (small steps would be lost
    if applied to bf16 params directly)."""
    rng = np.random.default_rng(0)
    w32 = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "n": jnp.int32(3)}
    grads = [jnp.asarray(rng.normal(size=(8, 4)), jnp.float32) for _ in range(5)]
    ref = optax.sgd(1e-4)
    tx = with_master_weights(optax.sgd(1e-4))
    ref_p, ref_s = {"w": w32["w"]}, ref.init({"w": w32["w"]})
    p16 = {"w": w32["w"].astype(jnp.bfloat16), "n": w32["n"]}
    s = tx.init(p16)
    assert s.master["w"].dtype == jnp.float32
    for g in grads:
        u, ref_s = ref.update({"w": g}, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
        u, s = tx.update({"w": g.astype(jnp.bfloat16), "n": jnp.int32(0)}, s, p16)
        p16 = optax.apply_updates(p16, u)
    # The master copy saw bf16-rounded grads; compare with the same rounding.
    ref2_p = {"w": w32["w"].astype(jnp.bfloat16).astype(jnp.float32)}
    for g in grads:
        ref2_p = {"w": ref2_p["w"] - 1e-4 * g.astype(jnp.bfloat16).astype(jnp.float32)}
    np.testing.assert_allclose(s.master["w"], ref2_p["w"], rtol=0, atol=1e-6)
    assert p16["w"].dtype == jnp.bfloat16 and int(p16["n"]) == 3
    np.testing.assert_array_equal(p16["w"], s.master["w"].astype(jnp.bfloat16))
    # Applied directly to bf16 params, 1e-4-sized steps are rounded away.
    direct = w32["w"].astype(jnp.bfloat16)
    for g in grads:
        direct = optax.apply_updates(direct, -1e-4 * g.astype(jnp.bfloat16))
    start = w32["w"].astype(jnp.bfloat16)
    assert int((direct != start).sum()) < int((p16["w"] != start).sum())
    # Gradients from `jax.grad(..., allow_int=True)` hold float0 for the integer leaf: a zero update too.
    g = jax.grad(lambda p: jnp.sum(p["w"].astype(jnp.float32) ** 2), allow_int=True)(p16)
    assert g["n"].dtype == jax.dtypes.float0
    u, s = with_master_weights(optax.adamw(1e-3)).update(g, with_master_weights(optax.adamw(1e-3)).init(p16), p16)
    assert int(u["n"]) == 0 and u["w"].dtype == jnp.float32 and float(jnp.abs(u["w"]).max()) > 0
    assert int(s.master["n"]) == 3  # weight decay moved it to 2 (3 - 3e-4 truncated)


def test_fp16_step_with_loss_scaling_end_to_end():
    """f16 compute with f32 params: an overflowing scale backs off and the
    step is skipped; the next step (smaller scale) is applied."""
    policy = Policy.parse("f16")
    params = {"w": jnp.full((4,), 3.0, jnp.float32)}
    x = jnp.full((4,), 10.0, jnp.float32)
    tx = skip_nonfinite(optax.sgd(0.01))

    @jax.jit
    def step(params, opt_state, ls):
        def scaled_loss(p):
            p16, x16 = policy.cast_to_compute((p, x))
            y = jnp.sum((p16["w"] * x16) ** 2)
            return ls.scale(policy.cast_to_output(y))
        grads = ls.unscale(jax.grad(scaled_loss)(params))
        finite = all_finite(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ls.adjust(finite)

    ls = loss_scale_for(policy, initial_scale=2.0**10)
    state = tx.init(params)
    p1, state, ls = step(params, state, ls)
    # The f16 gradient 2 q x * scale = 2 * 30 * 10 * 2^10 > 65504 (in any
    # association order XLA picks): inf, skipped, backoff.
    np.testing.assert_array_equal(p1["w"], params["w"])
    assert int(state.skipped_steps) == 1 and float(ls.scale_value) == 2.0**9
    small = {"w": jnp.full((4,), 0.01, jnp.float32)}
    p2, state, ls = step(small, state, ls)
    assert int(state.skipped_steps) == 1 and bool(state.last_finite)
    # Now every product (at most 2 * 10 * 2^9) fits in f16; the unscaled grad is 2 p x^2 = 2.
    np.testing.assert_allclose(p2["w"], 0.01 - 0.01 * 2 * 0.01 * 10.0**2, rtol=1e-2)
