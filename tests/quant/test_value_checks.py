"""Bad values and arguments to the quantizers: one clear ValueError up front; integer inputs to quantized dots."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.models.dot import dot
from jmem.models.llama import Llama, LlamaConfig
from jmem.quant import (awq_clip, awq_quantize, awq_scale, fp8_quantize, gptq_quantize, group_sizes, hessian,
                        int8_quantize, nf4_quantize, pack_bits, quantize, quantized_dot, rtn_quantize, unpack_bits,
                        weight_bytes)
from jmem.quant.ggml_weight import GGMLWeight

N_IN, N_OUT = 128, 8


@pytest.fixture(scope="module")
def w():
    return np.random.default_rng(0).normal(size=(N_IN, N_OUT)).astype(np.float32)


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).normal(size=(32, N_IN)).astype(np.float32)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


LEAF_QUANTIZERS = {
    "rtn": lambda w, x: rtn_quantize(w, 4, 32),
    "int8": lambda w, x: int8_quantize(w),
    "nf4": lambda w, x: nf4_quantize(w),
    "fp8": lambda w, x: fp8_quantize(w),
    "gptq": lambda w, x: gptq_quantize(w, hessian(x), 4, 32),
    "awq": lambda w, x: awq_quantize(w, x, 4, 32),
    "ggml": lambda w, x: GGMLWeight.from_float(w, "Q8_0"),
}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("method", LEAF_QUANTIZERS)
def test_leaf_quantizers_refuse_non_finite_weights(method, bad, w, x):
    wb = w.copy()
    wb[3, 1] = bad
    with pytest.raises(ValueError, match=r"has 1 non-finite value\(s\); accepted: finite weights"):
        LEAF_QUANTIZERS[method](wb, x)


def test_non_finite_check_runs_on_concrete_arrays_only(w):
    """Refused when concrete; under jit (a Tracer, values unknown) the quantizer still traces."""
    with pytest.raises(ValueError, match=r"the weight w has 2 non-finite value\(s\)"):
        rtn_quantize(np.where(np.arange(N_IN)[:, None] < 2, np.nan, w)[:, :1], 4, 32)
    got = jax.jit(lambda a: rtn_quantize(a, 4, 32).dequantize())(w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rtn_quantize(w, 4, 32).dequantize()))


def test_awq_refuses_non_finite_calibration_inputs(w, x):
    """awq_quantize, and the public awq_scale and awq_clip too (all losses NaN: they returned s = 1 as found)."""
    xb = x.copy()
    xb[0, 0] = np.nan
    for call in (lambda: awq_quantize(w, xb, 4, 32), lambda: awq_scale(xb, [w], 4, 32),
                 lambda: awq_clip(xb, w, 4, 32)):
        with pytest.raises(ValueError, match=r"calibration inputs x has 1 non-finite value\(s\)"):
            call()
    wb = w.copy()
    wb[3, 1] = np.inf
    with pytest.raises(ValueError, match=r"the weight ws\[1\] has 1 non-finite value\(s\)"):
        awq_scale(x, [w, wb], 4, 32)


def test_awq_scale_search_skips_scales_whose_grid_overflows():
    """A dead input channel beside a large one: s = max(mean|x|, 1e-8) ** alpha spanned 11 decades, w * s
    overflowed the f16 group scales at alpha 0.9 and 0.95, and argmin took their NaN loss: the weight was
    refused as ranging over -504121..451119 (it spans about +-10). The AutoAWQ clamp after the power."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((32, 8)) * 3).astype(np.float32)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    x[:, 3] *= 5000
    x[:, 5] = 0
    q = awq_quantize(w, x, 4, 8)
    assert np.all(np.isfinite(np.asarray(q.dequantize())))
    err = lambda wq: float(np.mean((x @ wq - x @ w) ** 2))  # noqa: E731
    assert err(np.asarray(q.dequantize())) < err(np.asarray(rtn_quantize(w, 4, 8).dequantize()))


def test_awq_scale_arguments_are_named(w, x):
    with pytest.raises(ValueError, match=r"^ws of type ndarray; accepted: a list of weights \[in, out_j\]"):
        awq_scale(x, w, 4, 32)  # a bare matrix read as a list of rows
    with pytest.raises(ValueError, match=re.escape("x_mean of shape (5,); accepted: f32[128]")):
        awq_scale(x, [w], 4, 32, x_mean=np.ones(5))


@pytest.mark.parametrize("method", ["rtn", "nf4", "gptq"])
def test_model_quantize_refuses_non_finite_weights(model, method):
    m = nnx.clone(model)
    k = m.layers.wv.kernel
    k.set_value(k.get_value().at[1, 0, 0].set(jnp.nan))
    with pytest.raises(ValueError, match=re.escape("layers.wv has 1 non-finite value(s) (layer 1); accepted: "
                                                   "finite weights")):
        quantize(m, method, bits=4, group_size=32, calibration=np.ones((1, 8), np.int32))


@pytest.mark.parametrize("make", [
    lambda w: rtn_quantize(w, 4, 32), lambda w: rtn_quantize(w, 8, None), lambda w: nf4_quantize(w),
    lambda w: fp8_quantize(w), lambda w: GGMLWeight.from_float(w, "Q8_0"),
])
def test_integer_input_is_promoted_to_float(make, w):
    q = make(w)
    x_int = jnp.arange(N_IN, dtype=jnp.int32).reshape(1, N_IN) % 3 - 1
    want = np.asarray(x_int, np.float32) @ np.asarray(q.dequantize(jnp.float32))
    got = dot(x_int, q)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    if not isinstance(q, GGMLWeight) and q.__class__.__name__ != "FP8Tensor":
        np.testing.assert_allclose(np.asarray(quantized_dot(x_int, q)), want, rtol=1e-5, atol=1e-4)


def test_integer_input_against_a_plain_weight(w):
    """`dot` promotes an integer x for every weight leaf (it cast a float weight to int before)."""
    x_int = jnp.arange(N_IN, dtype=jnp.int32).reshape(1, N_IN) % 3 - 1
    got = dot(x_int, jnp.asarray(w, jnp.float32))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(x_int, np.float32) @ np.asarray(w, np.float32), rtol=1e-5,
                               atol=1e-4)


def test_integer_input_through_awq_input_scale(w, x):
    q = awq_quantize(w, x, 4, 32)
    x_int = jnp.ones((1, N_IN), jnp.int32)
    got = dot(x_int, q)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.ones((1, N_IN)) @ np.asarray(q.dequantize()), rtol=1e-5,
                               atol=1e-4)


def test_gptq_refuses_a_degenerate_hessian(w, x):
    with pytest.raises(ValueError, match=r"the Hessian h is all zero on its diagonal \(the calibration inputs are "
                                         r"all zero: no calibration signal\)"):
        gptq_quantize(w, np.zeros((N_IN, N_IN)), 4, 32)
    with pytest.raises(ValueError, match=r"the Hessian h is all zero"):
        gptq_quantize(w, hessian(np.zeros((4, N_IN), np.float32)), 4, 32)
    h = np.eye(N_IN)
    h[2, 2] = np.nan
    with pytest.raises(ValueError, match=r"the Hessian h has 1 non-finite value\(s\); accepted: a finite Hessian"):
        gptq_quantize(w, h, 4, 32)
    # Some zero diagonal entries (inputs that never fire) are normal: those rows quantize to 0, the rest as usual.
    xd = x.copy()
    xd[:, :5] = 0.0
    got = np.asarray(gptq_quantize(w, hessian(xd), 4, 32).dequantize())
    np.testing.assert_array_equal(got[:5], 0.0)
    ref = np.asarray(rtn_quantize(w, 4, 32).dequantize())
    assert np.mean((xd @ got - xd @ w) ** 2) < np.mean((xd @ ref - xd @ w) ** 2)


def test_names_take_one_string_and_refuse_unknown(model):
    wq_bytes = model.layers.wq.kernel.get_value().nbytes
    assert weight_bytes(model, names="wq") == weight_bytes(model, names=("wq",)) == wq_bytes
    assert group_sizes(model, "wq") == {"wq": None}
    msg = "unknown weight name(s) 'bogus'; accepted: wq, wk, wv, wo, w_gate, w_up, w_down"
    with pytest.raises(ValueError, match=re.escape(msg)):
        group_sizes(model, names=("bogus",))
    with pytest.raises(ValueError, match=re.escape(msg)):
        weight_bytes(model, names=["wq", "bogus"])


def test_weight_bytes_and_group_sizes_refuse_a_non_model(w):
    """`weight_bytes(None)`, `weight_bytes({"w": w})` and `group_sizes(None)` were AttributeErrors inside."""
    for fn, model in ((weight_bytes, None), (weight_bytes, {"w": w}), (group_sizes, None)):
        with pytest.raises(ValueError, match=r"^model(=| is a ).*; accepted: a jmem.models.Llama model$"):
            fn(model)


def test_bits_must_be_an_int(w, model):
    with pytest.raises(ValueError, match=r"bits=4.0 is not supported for integer quantization; accepted: an int"):
        rtn_quantize(w, 4.0, 32)
    with pytest.raises(ValueError, match=r"bits=4.0 is not supported by method 'rtn'; accepted: an int"):
        quantize(model, "rtn", bits=4.0, group_size=32)


def test_awq_search_arguments(w, x):
    for call in (lambda: awq_scale(x, [w], 4, 32, n_grid=0), lambda: awq_clip(x, w, 4, 32, n_grid=-1)):
        with pytest.raises(ValueError, match=r"n_grid=-?\d; accepted: a positive integer"):
            call()
    for shrink in (1.5, 0.0, -0.2, True):
        with pytest.raises(ValueError, match=rf"max_shrink={shrink}; accepted: a number in \(0, 1\]"):
            awq_clip(x, w, 4, 32, max_shrink=shrink)
    # symmetric=None searched for the zero-point grid (quantize()'s None is symmetric); clip='no' clipped.
    for call in (lambda: awq_scale(x, [w], 4, 32, symmetric=None), lambda: awq_clip(x, w, 4, 32, symmetric=0)):
        with pytest.raises(ValueError, match=r"^symmetric=(None|0); accepted: True or False$"):
            call()
    with pytest.raises(ValueError, match=r"^clip='no'; accepted: True or False$"):
        awq_quantize(w, x, 4, 32, clip="no")
    assert awq_clip(x, w, 4, 32, n_grid=1, max_shrink=0.4).shape == (N_IN // 32, N_OUT)  # one ratio: no clip
    with pytest.raises(ValueError, match=re.escape("x has 64 input features (its last axis, shape (32, 64)) but the "
                                                   "weight has 128 input rows; accepted: x[..., 128]")):
        awq_quantize(w, x[:, :64], 4, 32)
    with pytest.raises(ValueError, match=r"ws have different input dimensions \[64, 128\]"):
        awq_scale(x, [w, w[:64]], 4, 32)


@pytest.mark.parametrize("block", [0, -1, 2.5])
def test_gptq_block_must_be_positive(block, w, x):
    with pytest.raises(ValueError, match=rf"block={block}; accepted: a positive integer"):
        gptq_quantize(w, hessian(x), 4, 32, block=block)


def test_pack_bits_checks_bits_and_codes():
    codes = np.arange(16, dtype=np.int32).reshape(8, 2) % 16
    np.testing.assert_array_equal(np.asarray(unpack_bits(pack_bits(codes, 4), 4)), codes)
    for bits in (1, 3):  # pruning masks use 1 bit
        small = codes % 2 ** bits
        np.testing.assert_array_equal(np.asarray(unpack_bits(pack_bits(small, bits), bits)), small)
    for bits in (0, 5, 9, 4.0):  # 8 rows of 5 bits overflow a 32-bit word
        with pytest.raises(ValueError, match=rf"bits={bits} cannot be packed; accepted: 1, 2, 3, 4, 8"):
            pack_bits(codes, bits)
        with pytest.raises(ValueError, match=rf"bits={bits} cannot be packed"):
            unpack_bits(np.zeros((4, 2), np.uint8), bits)
    with pytest.raises(ValueError, match=r"codes range over 0..16; accepted: unsigned 4-bit codes, 0..15"):
        pack_bits(codes + (codes == 15), 4)
    with pytest.raises(ValueError, match=r"codes range over -1..14; accepted: unsigned 4-bit codes"):
        pack_bits(codes - 1, 4)
    with pytest.raises(ValueError, match=r"codes of shape \(6, 2\) cannot be packed at 4 bits"):
        pack_bits(codes[:6], 4)


@pytest.mark.parametrize("make", [lambda w: rtn_quantize(w, 4, 32), nf4_quantize, int8_quantize, fp8_quantize,
                                  lambda w: gptq_quantize(w, hessian(np.eye(64, dtype=np.float32)), 4, 32),
                                  lambda w: awq_quantize(w, np.ones((8, 64), np.float32), 4, 32)])
def test_integer_weights_are_refused(make):
    """An int32 weight was stored as int32, and its dequantized values were rounded integers (35 came back 34)."""
    with pytest.raises(ValueError, match=r"weight dtype int32; accepted: a float array \(f32, bf16, f16\)"):
        make(jnp.arange(-128, 128, dtype=jnp.int32).reshape(64, 4) // 3)
    float_rows = np.linspace(-1, 1, 256).reshape(64, 4).tolist()  # nested lists of floats stay accepted
    assert make(float_rows).shape == (64, 4)
