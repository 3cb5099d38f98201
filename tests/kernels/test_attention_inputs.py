"""Inputs every attention entry point accepts or refuses alike: the softmax scale (concrete or traced),
dtypes, zero kv heads, and which `attention` calls run the Pallas kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.kernels import attention
from jmem.kernels.flash_attention import attention_reference, flash_attention
from jmem.kernels.masks import Causal, LocalWindow
from jmem.kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jmem.kernels.sparse_attention import sparse_attention, sparse_attention_reference
from tests.kernels.test_flash_attention import _inputs
from tests.kernels.test_paged_attention import decode_case
from tests.kernels.test_ragged_attention import ragged_case

TOL = 2e-5
MASK = Causal() & LocalWindow(5)


def _dense(B=1, T=16, H=4, K=2, D=16, seed=0):
    return _inputs(seed, B, T, T, H, K, D, jnp.float32)[:3]


@pytest.mark.parametrize("impl", ["xla", "reference", "pallas"])
def test_attention_traced_scale_every_impl(impl):
    q, k, v = _dense()
    f = jax.jit(lambda q, k, v, s: attention(q, k, v, causal=True, sm_scale=s, impl=impl))
    np.testing.assert_allclose(f(q, k, v, jnp.float32(0.3)), attention_reference(q, k, v, causal=True, sm_scale=0.3),
                               atol=TOL, rtol=TOL)


def test_flash_traced_scale_and_its_gradient():
    q, k, v = _dense(seed=1)
    flash = lambda q, s: flash_attention(q, k, v, sm_scale=s, interpret=True)  # noqa: E731
    ref = lambda q, s: attention_reference(q, k, v, sm_scale=s)  # noqa: E731
    s = jnp.float32(0.7)
    (o, grads) = jax.jit(lambda q, s: (flash(q, s), jax.grad(lambda q, s: (flash(q, s) ** 2).sum(), argnums=(0, 1))(q, s)))(q, s)
    o_ref, grads_ref = ref(q, s), jax.grad(lambda q, s: (ref(q, s) ** 2).sum(), argnums=(0, 1))(q, s)
    np.testing.assert_allclose(o, o_ref, atol=TOL, rtol=TOL)
    for got, want in zip(grads, grads_ref):  # d/dq and d/d(sm_scale)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_sparse_traced_scale():
    q, k, v = _dense(seed=2)
    got = jax.jit(lambda q, s: sparse_attention(q, k, v, MASK, sm_scale=s, interpret=True))(q, jnp.float32(0.4))
    np.testing.assert_allclose(got, sparse_attention_reference(q, k, v, MASK, sm_scale=0.4), atol=TOL, rtol=TOL)


def test_paged_and_ragged_traced_scale():
    q, _, _, kp, vp, lengths, table = decode_case(3, 3, 32, 4, 2, 16, 8, jnp.float32)
    f = jax.jit(lambda q, s: paged_attention(q, kp, vp, lengths, table, sm_scale=s, interpret=True))
    np.testing.assert_allclose(f(q, jnp.float32(0.2)), paged_attention_reference(q, kp, vp, lengths, table, sm_scale=0.2),
                               atol=TOL, rtol=TOL)
    q, _, _, kp, vp, kvl, table, cu, n = ragged_case(4, [3, 1], [6, 9], 3, 5, 4, 2, 16, 8, jnp.float32)
    g = jax.jit(lambda q, s: ragged_paged_attention(q, kp, vp, kvl, table, cu, n, sm_scale=s, interpret=True))
    np.testing.assert_allclose(g(q, jnp.float32(0.2)),
                               ragged_paged_attention_reference(q, kp, vp, kvl, table, cu, n, sm_scale=0.2),
                               atol=TOL, rtol=TOL)


def test_concrete_scalar_scales_are_floats():
    """A NumPy or JAX scalar is the same scale as the Python float (no hashing error for the static argument)."""
    q, k, v = _dense(seed=5)
    want = attention_reference(q, k, v, sm_scale=0.25)
    for s in (np.float32(0.25), jnp.asarray(0.25), 1 / jnp.sqrt(16.0)):
        np.testing.assert_allclose(flash_attention(q, k, v, sm_scale=s, interpret=True), want, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(attention(q, k, v, sm_scale=s, impl="pallas"), want, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match=r"flash_attention: sm_scale=.*accepted: None or one real scalar"):
        flash_attention(q, k, v, sm_scale=np.ones(2), interpret=True)
    with pytest.raises(ValueError, match=r"sparse_attention: sm_scale='big'"):
        sparse_attention(q, k, v, MASK, sm_scale="big", interpret=True)
    for bad in (float("nan"), float("inf"), np.float32("-inf")):  # every logit NaN or infinite
        with pytest.raises(ValueError, match=r"flash_attention: sm_scale=.*accepted: None or one finite real scalar"):
            flash_attention(q, k, v, sm_scale=bad, interpret=True)
        with pytest.raises(ValueError, match=r"sparse_attention: sm_scale=.*accepted: None or one finite real scalar"):
            sparse_attention(q, k, v, MASK, sm_scale=bad, interpret=True)
        for impl in ("xla", "reference", "auto"):  # the plain path gave all-NaN outputs
            with pytest.raises(ValueError, match=r"^attention: sm_scale=.*accepted: None or one finite real scalar"):
                attention(q, k, v, sm_scale=bad, impl=impl)
    for bad in ("a", np.ones(2)):  # were a TypeError and a broadcasting error on the plain path
        with pytest.raises(ValueError, match=r"^attention: sm_scale=.*accepted: None or one real scalar"):
            attention(q, k, v, sm_scale=bad, impl="xla")


def test_integer_inputs_and_zero_kv_heads_are_refused():
    q, k, v = _dense(seed=6)
    as_int = lambda x: x.astype(jnp.int32)  # noqa: E731
    for name, call in [("flash_attention", lambda q, k, v: flash_attention(q, k, v, interpret=True)),
                       ("sparse_attention", lambda q, k, v: sparse_attention(q, k, v, MASK, interpret=True))]:
        with pytest.raises(ValueError, match=f"{name}: q has dtype int32; accepted: a floating dtype"):
            call(as_int(q), k, v)
        with pytest.raises(ValueError, match=f"{name}: v has dtype int32; accepted: a floating dtype"):
            call(q, k, as_int(v))
        with pytest.raises(ValueError, match=f"{name}: q float32, k bfloat16, v bfloat16; accepted: one floating dtype"):
            call(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    qd, _, _, kp, vp, lengths, table = decode_case(7, 2, 16, 4, 2, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match="paged_attention: q has dtype int32; accepted: a floating dtype"):
        paged_attention(as_int(qd), kp, vp, lengths, table, interpret=True)
    qr, _, _, kp, vp, kvl, table, cu, n = ragged_case(8, [2], [4], 2, 2, 4, 2, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match="ragged_paged_attention: q has dtype int32; accepted: a floating dtype"):
        ragged_paged_attention(as_int(qr), kp, vp, kvl, table, cu, n, interpret=True)
    none = jnp.zeros((1, 16, 0, 16))
    for impl in ("xla", "pallas"):
        with pytest.raises(ValueError, match="q_heads=4 must be a multiple of kv_heads=0"):
            attention(q, none, none, impl=impl)
        # Mixed dtypes ran on the plain path (a CPU's "auto") and failed on the kernel's (a GPU's).
        with pytest.raises(ValueError, match=r"^attention: q bfloat16, k float32, v float32; accepted: one floating "
                                             r"dtype for all three \(cast them first\)$"):
            attention(q.astype(jnp.bfloat16), k, v, impl=impl)


def _runs_kernel(**kw):
    q, k, v = _dense(B=2, seed=9)
    return "pallas_call" in str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, impl="pallas", **kw))(q, k, v))


def test_which_calls_run_the_kernel():
    """A concrete zero q_offset is the kernel's own alignment; per-row offsets or lengths go through XLA."""
    assert _runs_kernel() and _runs_kernel(q_offset=0) and _runs_kernel(q_offset=np.zeros(2, np.int32))
    assert not _runs_kernel(q_offset=3)
    assert not _runs_kernel(kv_lengths=jnp.asarray([16, 9]))


def test_empty_batch_gives_empty_outputs():
    """No batch rows (no ragged tokens) give an empty output of q's shape and dtype, as the references do."""
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)  # noqa: E731
    q, k = z(0, 8, 2, 16), z(0, 8, 1, 16)
    outs = [flash_attention(q, k, k, interpret=True), sparse_attention(q, k, k, MASK, interpret=True),
            attention(q, k, k, impl="pallas")]
    kp, none = z(1, 4, 8, 16), jnp.zeros((0,), jnp.int32)
    outs.append(paged_attention(z(0, 2, 16), kp, kp, none, jnp.zeros((0, 2), jnp.int32), interpret=True))
    args = (z(0, 2, 16), kp, kp, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2), jnp.int32), jnp.zeros((2,), jnp.int32), 0)
    outs.append(ragged_paged_attention(*args, interpret=True))
    assert ragged_paged_attention_reference(*args).shape == (0, 2, 16)
    assert [(o.shape, o.dtype) for o in outs] == [(q.shape, q.dtype)] * 3 + [((0, 2, 16), q.dtype)] * 2
    # No query rows: empty on every impl (the kernel's path refused them, the plain path did not).
    q0, k1 = z(1, 0, 2, 16), z(1, 8, 1, 16)
    for impl in ("xla", "reference", "pallas"):
        out = attention(q0, k1, k1, impl=impl)
        assert (out.shape, out.dtype) == (q0.shape, q0.dtype)


def test_sizes_and_counts_must_be_integers_and_lists_are_arrays():
    q, k, v = _dense(seed=10)
    with pytest.raises(ValueError, match=r"flash_attention: block_q=16.0; accepted: a power of two >= 16"):
        flash_attention(q, k, v, block_q=16.0, interpret=True)
    with pytest.raises(ValueError, match=r"sparse_attention: block_k=32.0; accepted: a power of two >= 16"):
        sparse_attention(q, k, v, MASK, block_k=32.0, interpret=True)
    qd, _, _, kp, vp, lengths, table = decode_case(11, 2, 16, 4, 2, 16, 8, jnp.float32)
    want = paged_attention(qd, kp, vp, lengths, table, interpret=True)
    got = paged_attention(qd, kp, vp, np.asarray(lengths).tolist(), np.asarray(table).tolist(), interpret=True)
    np.testing.assert_array_equal(got, want)
    for kw, message in [(dict(num_splits=1.0), r"num_splits=1.0; accepted: an integer in \[1, 1\]"),
                        (dict(pages_per_compute_block=2.0), "pages_per_compute_block=2.0; accepted: a power of two")]:
        with pytest.raises(ValueError, match=f"paged_attention: {message}"):
            paged_attention(qd, kp, vp, lengths, table, interpret=True, **kw)
    qr, _, _, kp, vp, kvl, table, cu, n = ragged_case(12, [2, 1], [4, 3], 2, 4, 4, 2, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"cu_q_lens must be int32\[max_seqs \+ 1\] = \[3\] .*; got float32\[3\]"):
        ragged_paged_attention(qr, kp, vp, kvl, table, cu.astype(jnp.float32), n, interpret=True)
    for bad in (2.5, np.float32(2), jnp.asarray([2])):
        with pytest.raises(ValueError, match="ragged_paged_attention: num_seqs=.*; accepted: an integer"):
            ragged_paged_attention(qr, kp, vp, kvl, table, cu, bad, interpret=True)
    with pytest.raises(ValueError, match="ragged_paged_attention: block_q=3; accepted: a power of two"):
        ragged_paged_attention(qr, kp, vp, kvl, table, cu, n, block_q=3, interpret=True)


def test_none_for_an_array_is_one_clear_error():
    """`attention(None, k, v)` was an AttributeError ('NoneType' has no ndim): `check_arrays` skipped None."""
    q, k, v = _dense(seed=13)
    for args, arg in (((None, k, v), "q"), ((q, None, v), "k"), ((q, k, None), "v")):
        with pytest.raises(ValueError, match=rf"^attention: {arg}=None; accepted: an array$"):
            attention(*args)
        with pytest.raises(ValueError, match=rf"^flash_attention: {arg}=None; accepted: an array$"):
            flash_attention(*args, interpret=True)
    qd, _, _, kp, vp, lengths, table = decode_case(11, 2, 16, 4, 2, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"^paged_attention: q=None; accepted: an array$"):
        paged_attention(None, kp, vp, lengths, table, interpret=True)


@pytest.fixture
def x64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def test_every_kernel_runs_with_x64_enabled(x64):
    """`jax_enable_x64` (common in scientific code) turns Python ints into int64: the kernels'
    index arithmetic on int32 grid indices still traces, and the results and gradients hold."""
    q, k, v = _dense(T=24, seed=4)
    flash = lambda q: flash_attention(q, k, v, causal=True, interpret=True)  # noqa: E731
    ref = lambda q: attention_reference(q, k, v, causal=True)  # noqa: E731
    np.testing.assert_allclose(flash(q), ref(q), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(jax.grad(lambda q: (flash(q) ** 2).sum())(q), jax.grad(lambda q: (ref(q) ** 2).sum())(q),
                               atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(sparse_attention(q, k, v, MASK, interpret=True), sparse_attention_reference(q, k, v, MASK),
                               atol=TOL, rtol=TOL)
    q, _, _, kp, vp, lengths, table = decode_case(3, 3, 32, 4, 2, 16, 8, jnp.float32)
    np.testing.assert_allclose(paged_attention(q, kp, vp, lengths, table, interpret=True),
                               paged_attention_reference(q, kp, vp, lengths, table), atol=TOL, rtol=TOL)
    q, _, _, kp, vp, kvl, table, cu, n = ragged_case(4, [3, 1], [6, 9], 3, 5, 4, 2, 16, 8, jnp.float32)
    np.testing.assert_allclose(ragged_paged_attention(q, kp, vp, kvl, table, cu, n, interpret=True),
                               ragged_paged_attention_reference(q, kp, vp, kvl, table, cu, n), atol=TOL, rtol=TOL)


def test_dequant_matmul_runs_with_x64_enabled(x64):
    """The 4-bit dequantize-matmul's loop index stays int32 under x64 (per-channel groups divide it)."""
    from jmem.quant import IntTensor
    from jmem.quant.kernel import dequant_matmul, reference_matmul

    w = jax.random.normal(jax.random.key(0), (576, 64), jnp.float32) * 0.05
    x = jax.random.normal(jax.random.key(1), (3, 576), jnp.float32)
    for q in (IntTensor.quantize(w, 4, None), IntTensor.quantize(w, 4, 64, symmetric=False)):
        np.testing.assert_allclose(dequant_matmul(x, q, interpret=True), reference_matmul(x, q), atol=1e-5, rtol=1e-5)
