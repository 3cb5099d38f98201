"""Pallas dequantize-matmul (interpret mode on CPU) against the plain dequantize-then-matmul path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.quant import FP8Tensor, IntTensor, NF4Tensor
from jmem.quant.kernel import dequant_matmul, reference_matmul

K, N = 256, 96


@pytest.mark.parametrize("fmt", ["int4_sym_g128", "int4_zp_g64", "nf4"])
def test_kernel_matches_reference(fmt):
    kw, kx = jax.random.split(jax.random.key(hash(fmt) % 2**31))
    w = jax.random.normal(kw, (K, N), jnp.float32) * 0.05
    q = {"int4_sym_g128": lambda: IntTensor.quantize(w, 4, 128),
         "int4_zp_g64": lambda: IntTensor.quantize(w, 4, 64, symmetric=False),
         "nf4": lambda: NF4Tensor.quantize(w)}[fmt]()
    x = jax.random.normal(kx, (2, 5, K), jnp.float32)  # 10 rows: padded to one 16-row tile
    y = dequant_matmul(x, q, interpret=True)
    assert y.shape == (2, 5, N) and y.dtype == x.dtype
    np.testing.assert_allclose(y, reference_matmul(x, q), rtol=1e-5, atol=1e-5)


def test_kernel_rejects_other_formats():
    w = np.ones((64, 8), np.float32)
    with pytest.raises(ValueError, match="4-bit IntTensor or an NF4Tensor"):
        dequant_matmul(jnp.ones((1, 64)), FP8Tensor.quantize(w), interpret=True)
    with pytest.raises(ValueError, match="2-D weight"):
        dequant_matmul(jnp.ones((1, 64)), IntTensor.quantize(np.ones((2, 64, 8), np.float32), 4, 32), interpret=True)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the Pallas kernel for a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576, 1536), (100, 1536, 576), (16, 576, 192)])
def test_kernel_on_gpu(shape, dtype):
    """Compiled (not interpreted) kernel at SmolLM2's shapes against the plain path."""
    M, K_, N_ = shape
    kw, kx = jax.random.split(jax.random.key(M + K_))
    w = jax.random.normal(kw, (K_, N_), jnp.float32) * 0.05
    x = jax.random.normal(kx, (M, K_), jnp.float32).astype(dtype)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    for q in (IntTensor.quantize(w, 4, 64), IntTensor.quantize(w, 4, 64, symmetric=False), NF4Tensor.quantize(w)):
        y = dequant_matmul(x, q).astype(jnp.float32)
        ref = reference_matmul(x.astype(jnp.float32), q)
        np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * float(jnp.abs(ref).max()))
