"""Bad optimizer settings raise one clear ValueError when the optimizer is built; good ones of any scalar kind pass."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmem.optim.adafactor import Layout, clip_by_block_rms, scale_by_factored_rms, scale_by_param_block_rms
from jmem.optim import adafactor, adam8bit, dequantize, galore, galore_plan, make_optimizer, quantize

LR = "learning_rate={}; accepted: a finite number >= 0 or a schedule"


@pytest.mark.parametrize("name,lr", [(name, lr) for name in ("adamw", "sgd", "adam8bit", "galore", "adafactor")
                                       for lr in (None, -1e-3, float("nan")) if (name, lr) != ("adafactor", None)])
def test_make_optimizer_refuses_a_learning_rate_that_would_not_descend(name, lr):
    with pytest.raises(ValueError, match=f"^{name} " + LR.format(lr)):
        make_optimizer(name, lr)


@pytest.mark.parametrize("ctor", [adam8bit, galore, adafactor])
def test_constructors_refuse_none_or_negative_learning_rates(ctor):
    if ctor is not adafactor:
        with pytest.raises(ValueError, match=LR.format(None)):
            ctor(None)
    with pytest.raises(ValueError, match=LR.format(-0.1)):
        ctor(-0.1)
    ctor(optax.constant_schedule(1e-3)), ctor(np.float32(1e-3)), ctor(0)
    if ctor is adafactor:
        ctor(None), make_optimizer("adafactor", None)  # documented: the relative step size


@pytest.mark.parametrize("kwargs,match", [
    (dict(b2=1.0), r"^adam8bit b2=1.0; accepted: a value in \[0, 1\)$"),
    (dict(b1=1.5), r"b1=1.5; accepted: a value in \[0, 1\)"),
    (dict(b1=-0.1), r"b1=-0.1; accepted"),
    (dict(eps=-1e-8), "eps=-1e-08; accepted: a finite number >= 0"),
    (dict(eps=float("inf")), "eps=inf; accepted"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1; accepted"),
    (dict(block_size=2.5), "block_size=2.5; accepted: an integer >= 1"),
    (dict(block_size=True), "block_size=True; accepted: an integer >= 1"),
    (dict(block_size=0), "block_size=0; accepted"),
    (dict(min_8bit_size=-1), "min_8bit_size=-1; accepted: an integer >= 0"),
    (dict(min_8bit_size=1.5), "min_8bit_size=1.5; accepted"),
])
def test_adam8bit_bad_settings_raise_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adam8bit(1e-3, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=True), "^galore block_size=True; accepted: an integer >= 1$"),
    (dict(min_8bit_size=True), "min_8bit_size=True; accepted: an integer >= 0"),
    (dict(eps=float("nan")), "eps=nan; accepted: a finite number >= 0"),
    (dict(eps_root=float("inf")), "eps_root=inf; accepted"),
])
def test_galore_bad_settings_raise_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        galore(1e-3, **kwargs)


@pytest.mark.parametrize("build,match", [
    # Adafactor's building blocks, public on their own: these gave NaN updates or silently wrong ones.
    (lambda: scale_by_factored_rms(eps=-1.0), r"^adafactor eps=-1.0; accepted: a finite number >= 0$"),
    (lambda: scale_by_factored_rms(decay_rate=-1.0), r"^adafactor decay_rate=-1.0; accepted: a finite number > 0$"),
    (lambda: clip_by_block_rms(0.0), r"^adafactor clipping_threshold=0.0; accepted: a finite number > 0$"),
    (lambda: clip_by_block_rms(-1.0), r"clipping_threshold=-1.0; accepted"),
    (lambda: scale_by_param_block_rms(-1.0), r"^adafactor min_scale=-1.0; accepted: a finite number >= 0$"),
    # A truthy string is no bool.
    (lambda: adafactor(multiply_by_parameter_scale="no"), r"^adafactor multiply_by_parameter_scale='no'; accepted: "
                                                          r"True or False$"),
    (lambda: make_optimizer("sgd", 1e-3, nesterov="x"), r"^sgd nesterov='x'; accepted: True or False$"),
])
def test_adafactor_parts_and_flags_refuse_bad_settings(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_adafactor_parts_take_good_settings():
    scale_by_factored_rms(eps=0.0), clip_by_block_rms(np.float32(1.0)), scale_by_param_block_rms(0)
    adafactor(multiply_by_parameter_scale=np.bool_(False)), make_optimizer("sgd", 1e-3, nesterov=True)


@pytest.mark.parametrize("build,name", [
    (lambda d: adafactor(state_dtype=d), "adafactor state_dtype"),
    (lambda d: adafactor(momentum=0.9, momentum_dtype=d), "adafactor momentum_dtype"),
    (lambda d: galore(1e-3, basis_dtype=d), "galore basis_dtype"),
])
def test_state_dtypes_must_be_floating(build, name):
    for bad in (jnp.int8, "int32", np.uint8, jnp.bool_, "no-such-dtype"):
        with pytest.raises(ValueError, match=f"^{name}=.*; accepted: .*a floating dtype"):
            build(bad)
    for good in (jnp.bfloat16, "bfloat16", np.float32) + ((jnp.dtype("float16"),) if "state" not in name else ()):
        build(good)


def test_adafactor_statistics_need_float32s_range():
    """float16 statistics were accepted and gave -inf updates: eps 1e-30 is 0 in float16 (rsqrt(0) on a zero
    gradient) and g^2 overflows above |g| = 256."""
    for bad in (jnp.float16, "float16"):
        with pytest.raises(ValueError, match=r"^adafactor state_dtype=.*float16.*; accepted: a floating dtype with "
                                             r"float32's range \(float32, bfloat16\)"):
            adafactor(state_dtype=bad)
    adafactor(momentum=0.9, momentum_dtype=jnp.float16)  # updates, not squares: float16 holds them


def test_adafactor_int8_statistics_would_have_given_nan():
    with pytest.raises(ValueError, match="state_dtype"):
        adafactor(1e-2, state_dtype=jnp.int8)
    params = {"w": jnp.ones((4, 4))}
    tx = adafactor(1e-2, state_dtype="bfloat16", momentum=0.9, momentum_dtype=None)
    u, _ = tx.update(params, tx.init(params), params)
    assert np.all(np.isfinite(np.asarray(u["w"])))


def test_a_single_exclude_string_is_one_name():
    params = {"embed": jnp.ones((8, 16)), "w": jnp.ones((8, 16)), "e": jnp.ones((8, 16))}
    plans, _ = galore_plan(params, rank=2, exclude="embed")
    assert [p.side for p in plans] == ["left", None, "left"]  # keys sorted: e, embed, w; "e" is not excluded
    state = galore(1e-3, rank=2, exclude="embed").init(params)
    assert state[0].basis["embed"].shape == (1,) and state[0].basis["e"].shape == (8, 2)
    assert [p.side for p in galore_plan(params, rank=2, exclude=["embed", "w"])[0]] == ["left", None, None]
    for bad in (3, ("embed", 3), None):
        with pytest.raises(ValueError, match=r"exclude=.*; accepted: a string or a tuple of strings"):
            galore(1e-3, exclude=bad)


def test_galore_plan_checks_rank_as_galore_does():
    """`galore_plan(params, rank=0)` and `rank=2.0` returned Plan(rank=0) / Plan(rank=2.0) that galore refuses."""
    params = {"w": jnp.ones((8, 16))}
    for rank in (0, 2.0, True, "2"):
        for build in (lambda: galore(1e-3, rank=rank), lambda: galore_plan(params, rank=rank)):
            with pytest.raises(ValueError, match=rf"^galore rank={rank!r}; accepted: an integer >= 1$"):
                build()
    assert galore_plan(params, rank=np.int64(2))[0][0].rank == 2


def test_dynamic_code_takes_a_bool():
    """`dynamic_code(0)` or `dynamic_code("x")` picked a code by truthiness; a list was a TypeError (unhashable)."""
    from jmem.optim import dynamic_code

    for bad in (0, 1, "x", None, []):
        with pytest.raises(ValueError, match=rf"^signed={re.escape(repr(bad))}; accepted: True or False$"):
            dynamic_code(bad)
    np.testing.assert_array_equal(dynamic_code(np.bool_(True)), dynamic_code(True))


def test_quantize_and_dequantize_check_block_size_and_shape():
    with pytest.raises(ValueError, match="^quantize block_size=0; accepted: an integer >= 1$"):
        quantize(jnp.ones(10), signed=True, block_size=0)
    q = quantize(jnp.arange(1000.0), signed=False)  # 4 blocks of 256
    for shape in [(7,), (2000,), (768,), (32, 33)]:
        with pytest.raises(ValueError, match=r"dequantize shape=.*accepted: a shape of 769 to 1024 elements"):
            dequantize(q, shape, signed=False)
    assert dequantize(q, (10, 100), signed=False).shape == (10, 100)
    assert dequantize(q, (1024,), signed=False).shape == (1024,)


def test_numpy_and_jax_scalars_pass_and_inject_hyperparams_tracers_are_skipped():
    params = {"w": jnp.linspace(-1.0, 1.0, 128).reshape(8, 16), "b": jnp.ones((16,))}
    adam8bit(np.float32(1e-3), b1=np.float32(0.9), b2=jnp.float32(0.99), eps=np.float64(1e-8),
             block_size=np.int64(64), min_8bit_size=np.int32(0))
    galore(jnp.float32(1e-3), rank=np.int64(2), scale=jnp.float32(0.25), b1=np.float32(0.9))
    txs = [
        optax.inject_hyperparams(adam8bit, static_args=("block_size", "min_8bit_size"))(
            1e-3, b1=0.8, block_size=32, min_8bit_size=64),
        # The dtype defaults are names, not callables that inject_hyperparams would take for schedules.
        optax.inject_hyperparams(galore, static_args=("rank", "update_proj_gap", "block_size", "min_8bit_size"))(
            optax.linear_schedule(1e-3, 0.0, 10), rank=2),
        optax.inject_hyperparams(adafactor, static_args=("min_dim_size_to_factor", "decay_offset"))(
            1e-3, momentum=0.9),
    ]
    for tx in txs:
        state = tx.init(params)  # hyperparameters are concrete 0-d arrays here
        u, state = jax.jit(tx.update)(params, state, params)  # and tracers here
        assert float(jnp.vdot(u["w"], params["w"])) < 0  # a descent direction (grads = params)


@pytest.mark.parametrize("make,name", [
    (lambda: optax.inject_hyperparams(galore)(1e-3, rank=2), "galore rank"),
    (lambda: optax.inject_hyperparams(adam8bit)(1e-3), "adam8bit block_size"),
    (lambda: optax.inject_hyperparams(adafactor)(1e-3), "adafactor min_dim_size_to_factor"),
])
def test_a_traced_hyperparameter_that_sets_shapes_names_static_args(make, name):
    """Under optax.inject_hyperparams a rank or block size is traced inside a jitted update: one
    ValueError names it and static_args (not a TracerBoolConversionError from deep inside)."""
    params = {"w": jnp.linspace(-1.0, 1.0, 128).reshape(8, 16)}
    tx = make()
    state = tx.init(params)
    with pytest.raises(ValueError, match=f"{name}=.*list '{name.split()[1]}' in static_args"):
        jax.jit(tx.update)(params, state, params)


@pytest.mark.parametrize("layout", [Layout(0, (0, 0)), Layout(0, (0, 5)), Layout(3, None), Layout(1, (0, 1)),
                                    (0, None), None])
def test_a_factor_rule_layout_that_does_not_fit_its_leaf_is_one_error(layout):
    """A repeated axis, an axis past the leaf, more batch axes than it has or a factored axis among them
    gave per-element statistics silently or an IndexError deep in the update; a non-Layout an
    AttributeError."""
    tx = adafactor(1e-2, factor_rule=lambda path, shape: layout)
    with pytest.raises(ValueError, match=r"^adafactor factor_rule gave .* for w of shape \[4, 6\]; accepted: "
                                         r"Layout\(batch_ndim, factored\) with batch_ndim in 0\.\.2 and factored "
                                         r"None or two distinct axes in batch_ndim\.\.ndim-1$"):
        tx.init({"w": jnp.ones((4, 6))})
