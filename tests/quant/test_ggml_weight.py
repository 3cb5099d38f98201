"""GGMLWeight: packed GGUF blocks as a weight leaf of the one matmul entry point."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.models.dot import dot
from jmem.quant.ggml_quantize import quantize
from jmem.quant.ggml_weight import GGMLWeight

IN, OUT = 256, 48


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_dot_matches_dequantized_float_matmul(qtype):
    rng = np.random.default_rng(0)
    w_in_out = rng.normal(size=(IN, OUT)).astype(np.float32)
    w = GGMLWeight.from_float(w_in_out, qtype)
    assert w.shape == (IN, OUT) and w.in_features == IN and w.out_features == OUT
    # The float kernel from gguf's own decoder of the same bytes, W[out, in] -> K[in, out].
    k_ref = gguf.quants.dequantize(np.asarray(w.raw), w.qtype).T
    np.testing.assert_array_equal(np.asarray(w.dequantize()), k_ref)
    x = rng.normal(size=(2, 3, IN)).astype(np.float32)
    y = jax.jit(dot)(jnp.asarray(x), w)
    assert y.shape == (2, 3, OUT) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), x @ k_ref, rtol=1e-5, atol=1e-4)


def test_bf16_activations_follow_dot_semantics():
    rng = np.random.default_rng(1)
    w = GGMLWeight.from_float(rng.normal(size=(IN, OUT)).astype(np.float32), "Q8_0")
    x = jnp.asarray(rng.normal(size=(4, IN)), jnp.bfloat16)
    y = jax.jit(dot)(x, w)
    assert y.dtype == jnp.bfloat16
    ref = dot(x, w.dequantize())  # the plain-array path with the same float kernel
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))


def test_scan_over_stacked_layers():
    rng = np.random.default_rng(2)
    n_layers = 3
    kernels = rng.normal(size=(n_layers, IN, IN)).astype(np.float32) / 16
    w = GGMLWeight.from_float(kernels, "Q4_K")
    assert w.raw.shape == (n_layers, IN, IN // 256 * 144) and w.shape == (n_layers, IN, IN)

    def step(h, w_layer):
        assert isinstance(w_layer, GGMLWeight) and w_layer.raw.ndim == 2
        return jnp.tanh(dot(h, w_layer)), None

    x = rng.normal(size=(2, IN)).astype(np.float32)
    h, _ = jax.jit(lambda x, w: jax.lax.scan(step, x, w))(jnp.asarray(x), w)
    k = np.asarray(w.dequantize())
    ref = x
    for i in range(n_layers):
        ref = np.tanh(ref @ k[i])
    np.testing.assert_allclose(np.asarray(h), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "qtype,bits", [("Q4_0", 4.5), ("Q4_1", 5.0), ("Q8_0", 8.5), ("Q4_K", 4.5), ("Q6_K", 6.5625)]
)
def test_stored_bytes_per_weight(qtype, bits):
    w = GGMLWeight(jnp.asarray(quantize(np.zeros((OUT, 512), np.float32), qtype)), qtype)
    assert w.nbytes * 8 / (OUT * 512) == bits == w.bits_per_weight


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="uint8"):
        GGMLWeight(jnp.zeros((4, 18), jnp.float32), "Q4_0")
    with pytest.raises(ValueError, match="18"):
        GGMLWeight(jnp.zeros((4, 20), jnp.uint8), "Q4_0")
    with pytest.raises(ValueError, match="supported"):
        GGMLWeight(jnp.zeros((4, 18), jnp.uint8), "IQ2_XXS")
    stacked = GGMLWeight(jnp.zeros((2, 4, 18), jnp.uint8), "Q4_0")
    with pytest.raises(ValueError, match="slice the stacked layers axis"):
        dot(jnp.ones((1, 32)), stacked)


def test_nnx_param_value_and_layer_indexing():
    from flax import nnx

    class Linear(nnx.Module):
        def __init__(self, kernel):
            self.kernel = nnx.Param(kernel)

        def __call__(self, x):
            return dot(x, self.kernel[...])

    rng = np.random.default_rng(3)
    stacked = GGMLWeight.from_float(rng.normal(size=(2, IN, OUT)).astype(np.float32), "Q5_0")
    layer = stacked[1]
    np.testing.assert_array_equal(np.asarray(layer.raw), np.asarray(stacked.raw[1]))
    graphdef, state = nnx.split(Linear(layer))
    x = rng.normal(size=(2, IN)).astype(np.float32)
    y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(y), x @ np.asarray(stacked.dequantize()[1]), rtol=1e-5, atol=1e-4)
    with pytest.raises(IndexError, match="leading"):
        layer[0]
