"""Pallas dequantize-matmul (interpret mode on CPU) against the plain dequantize-then-matmul path,
alone and wired into the model through `dot` / `matmul_impl`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.models.dot import dot
from jmem.models.llama import Llama, LlamaConfig
from jmem.quant import FP8Tensor, IntTensor, NF4Tensor, matmul_impl, quantize
from jmem.quant.kernel import dequant_matmul, kernel_unsupported, reference_matmul

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


@pytest.mark.parametrize("group, symmetric", [(None, True), (96, False), (32, True)])
def test_kernel_groups_that_are_not_one_tile(group, symmetric):
    """Groups whose packed rows are no power of two (per channel: 576 rows = 9 steps of 32; 96 rows: 3
    of 16) run in several steps under one scale, as the GPU's power-of-two tiles need."""
    kw, kx = jax.random.split(jax.random.key(group or 1))
    w = jax.random.normal(kw, (576, 64), jnp.float32) * 0.05
    q = IntTensor.quantize(w, 4, group, symmetric=symmetric)
    x = jax.random.normal(kx, (3, 576), jnp.float32)
    np.testing.assert_allclose(dequant_matmul(x, q, interpret=True), reference_matmul(x, q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 256), (2, 0, 256)])
def test_kernel_on_no_rows_gives_an_empty_result(shape):
    q = IntTensor.quantize(np.random.default_rng(0).normal(size=(K, N)).astype(np.float32), 4, 128)
    y = jax.jit(lambda x, q: dequant_matmul(x, q, interpret=True))(jnp.zeros(shape), q)
    assert y.shape == (*shape[:-1], N) and y.shape == reference_matmul(jnp.zeros(shape), q).shape


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers_for_gpu_without_deprecation_warnings(dtype):
    """The compiled (not interpreted) kernel lowers to a Triton call for CUDA from this machine."""
    import warnings

    w = jax.random.normal(jax.random.key(0), (576, 192), jnp.float32) * 0.05
    # Per-channel scales and 96-row groups too: their 288- and 48-row groups load as power-of-two tiles.
    for q in (IntTensor.quantize(w, 4, 64, symmetric=False), NF4Tensor.quantize(w), IntTensor.quantize(w, 4, None),
              IntTensor.quantize(w, 4, 96, symmetric=False)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            text = jax.jit(lambda x, q: dequant_matmul(x, q, interpret=False)).trace(
                jax.ShapeDtypeStruct((4, 576), dtype), q).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1


def _jaxpr(f, *args) -> str:
    # A fresh function each time: JAX caches traces per function, and the path is chosen at trace time.
    return str(jax.make_jaxpr(lambda *a: f(*a))(*args))


def test_model_logits_through_the_kernel_equal_the_xla_path():
    """Tiny model whose linears hold int4 (scale only), int4 (zero points) and NF4 leaves."""
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(7))
    sym = quantize(model, "rtn", bits=4, group_size=32).layers.weights()
    zp = quantize(model, "rtn", bits=4, group_size=32, symmetric=False).layers.weights()
    nf4 = quantize(model, "nf4").layers.weights()
    for names, src in ((("wq", "wo"), sym), (("wk", "w_gate"), zp), (("wv", "w_up", "w_down"), nf4)):
        for n in names:
            getattr(model.layers, n).kernel.set_value(src[n])
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)

    def make_logits():  # a distinct function per path: JAX caches traces per function
        return lambda state, ids: nnx.merge(graphdef, state)(ids)[0]

    xla = jax.jit(make_logits()).trace(state, ids)  # auto on CPU: dequantize + dot
    with matmul_impl("pallas"):
        kern = jax.jit(make_logits()).trace(state, ids)
    assert "pallas_call" in str(kern.jaxpr) and "pallas_call" not in str(xla.jaxpr)
    y_ref = np.asarray(xla.lower().compile()(state, ids))
    y = np.asarray(kern.lower().compile()(state, ids))
    assert np.abs(y_ref).max() > 0.1
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_kernel_is_chosen_only_when_asked_and_tileable():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    q4 = IntTensor.quantize(w, 4, 32)
    assert "pallas_call" not in _jaxpr(dot, x, q4)  # CPU auto: XLA
    with matmul_impl("xla"):
        assert "pallas_call" not in _jaxpr(dot, x, q4)
    with matmul_impl("pallas"):
        assert "pallas_call" in _jaxpr(dot, x, q4)
        assert "pallas_call" in _jaxpr(dot, x[None], NF4Tensor.quantize(w))  # leading dims fold into rows
        fallbacks = {
            "bits": IntTensor.quantize(w, 3, 32), "int8": IntTensor.quantize(w, 8, None),
            "group size": IntTensor.quantize(w, 4, 16), "output width": IntTensor.quantize(w[:, :12], 4, 32),
            "leading axes": IntTensor.quantize(np.stack([w, w]), 4, 32),
        }
        for why, q in fallbacks.items():
            assert kernel_unsupported(q, 64) is not None, why
            assert "pallas_call" not in _jaxpr(dot, x, q), why
            np.testing.assert_allclose(dot(x, q), jnp.matmul(x, q.dequantize()), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="matmul_impl='triton'; accepted: auto, pallas, xla"):
        with matmul_impl("triton"):
            pass


def test_kernel_path_gradients_equal_the_xla_path():
    """Reverse mode through the kernel (custom VJP): d/dx and d/dscale, as QLoRA training needs."""
    kw, kx = jax.random.split(jax.random.key(5))
    q = IntTensor.quantize(jax.random.normal(kw, (64, 32), jnp.float32), 4, 32, symmetric=False)
    x = jax.random.normal(kx, (5, 64), jnp.float32)

    def loss(x, scale):
        w = IntTensor(q.packed, scale, q.zero, 4)
        return jnp.sum(jnp.sin(dot(x, w)))

    g_ref = jax.grad(loss, argnums=(0, 1))(x, q.scale)
    with matmul_impl("pallas"):
        assert "pallas_call" in _jaxpr(jax.grad(loss, argnums=(0, 1)), x, q.scale)
        g = jax.grad(loss, argnums=(0, 1))(x, q.scale)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="auto picks the compiled kernel on a GPU only")
def test_auto_uses_the_compiled_kernel_on_gpu():
    w = jax.random.normal(jax.random.key(1), (576, 192), jnp.float32) * 0.05
    x = jax.random.normal(jax.random.key(2), (2, 7, 576), jnp.float32)
    for q in (IntTensor.quantize(w, 4, 96), IntTensor.quantize(w, 4, 64, symmetric=False), NF4Tensor.quantize(w)):
        assert "pallas_call" in _jaxpr(dot, x, q)
        y = jax.jit(lambda x, q: dot(x, q))(x, q)
        # GPU f32 dots may run as TF32 (10-bit mantissa) in either path.
        np.testing.assert_allclose(y, reference_matmul(x, q), rtol=2e-3, atol=2e-3 * float(jnp.abs(y).max()))


def test_auto_follows_the_compile_target():
    """'auto' takes the kernel when compiling for a GPU (also ahead of time from a CPU host), not for CPU/TPU."""
    from jmem.kernels.dispatch import compiling_for
    from jmem.quant.kernel import uses_kernel

    q = IntTensor.quantize(np.ones((K, N), np.float32), 4, 64)
    assert not uses_kernel(K, q, "auto")
    with compiling_for("gpu"):
        assert uses_kernel(K, q, "auto") and not uses_kernel(K, q, "xla")
    with compiling_for("tpu"):
        assert not uses_kernel(K, q, "auto")


def test_auto_leaves_sharded_steps_to_xla():
    """Inside a step sharded over several devices GSPMD cannot split the Pallas call: 'auto' takes the
    XLA path there even for a GPU; 'pallas' still forces the kernel; one device keeps it."""
    from jmem import parallel as par
    from jmem.kernels.dispatch import compiling_for
    from jmem.parallel.rules import activation_sharding
    from jmem.quant.kernel import uses_kernel

    q = IntTensor.quantize(np.ones((K, N), np.float32), 4, 64)
    with compiling_for("gpu"):
        with activation_sharding(None, par.make_mesh("data=8")):
            assert not uses_kernel(K, q, "auto") and uses_kernel(K, q, "pallas")
        with activation_sharding(None, par.make_mesh(devices=jax.devices()[:1])):
            assert uses_kernel(K, q, "auto")
