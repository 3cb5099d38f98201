"""Flash attention kernel (Pallas, interpret mode on CPU) against the plain-jnp reference."""

import importlib.util
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.kernels import attention, xla_attention
from jmem.kernels.flash_attention import attention_reference, flash_attention

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # bf16: a few ulps of values of order 1


def _inputs(seed, B, T, S, H, K, D, dtype):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(B, T, H, D), (B, S, K, D), (B, S, K, D), (B, T, H, D)]
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(ks, shapes)]


def _check_fwd_bwd(fn, ref, q, k, v, do, tol):
    o, vjp = jax.vjp(fn, q, k, v)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    o_ref, vjp_ref = jax.vjp(ref, f32(q), f32(k), f32(v))
    np.testing.assert_allclose(f32(o), o_ref, atol=tol, rtol=tol)
    for name, got, want in zip(("dq", "dk", "dv"), vjp(do), vjp_ref(f32(do))):
        assert got.shape == want.shape and got.dtype == q.dtype, name
        np.testing.assert_allclose(f32(got), want, atol=tol, rtol=tol, err_msg=name)


def force_head_dim_padding(monkeypatch):
    """Pad head_dim to a power of two in the interpreter too, as the GPU (Triton) path does."""
    from jmem.kernels.flash_attention import kernel as fk

    monkeypatch.setattr(fk, "POW2_HEAD_DIM_PLATFORMS", ("gpu", "interpret"))


def force_streaming(monkeypatch):
    """Run the TPU (streaming) body in the interpreter too."""
    from jmem.kernels.flash_attention import kernel as fk

    monkeypatch.setattr(fk, "STREAM_PLATFORMS", ("tpu", "interpret"))


# Lengths off the block grid, head ratios 1, 3 and 8, both dtypes, both causalities, both bodies: the
# whole-row (GPU) body, with head_dim 24 padded to 32 as on GPU (the padded shape shows in the jaxpr),
# and the streaming (TPU) body. The slow sweep runs both bodies over more shapes.
CASES = [
    (1, 40, 40, 3, 1, 24, True, jnp.float32, "pad"),
    (1, 33, 70, 8, 1, 16, False, jnp.float32, "stream"),
    (1, 64, 48, 2, 2, 16, True, jnp.bfloat16, "stream"),
]


@pytest.mark.parametrize("B,T,S,H,K,D,causal,dtype,body", CASES)
def test_flash_matches_reference(B, T, S, H, K, D, causal, dtype, body, monkeypatch):
    if body == "pad":
        force_head_dim_padding(monkeypatch)
    if body == "stream":
        force_streaming(monkeypatch)
    q, k, v, do = _inputs(T * S + H, B, T, S, H, K, D, dtype)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, block_q=16, block_k=32, interpret=True)  # noqa: E731
    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(fn)(q, k, v))
    assert ("f32[1,3,48,32]" in jaxpr) == (body == "pad")  # [B, H, T_pad, D_pad] inside the kernel call
    assert ("flash_fwd_stream" in jaxpr) == (body == "stream")
    _check_fwd_bwd(fn, ref, q, k, v, do, TOL[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("T,S", [(1, 17), (129, 129), (100, 300), (257, 64)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_flash_sweep(T, S, causal, stream, monkeypatch):
    if stream:
        force_streaming(monkeypatch)
    q, k, v, do = _inputs(T + S, 2, T, S, 6, 2, 64, jnp.float32)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, sm_scale=0.3, interpret=True)  # noqa: E731
    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal, sm_scale=0.3)  # noqa: E731
    _check_fwd_bwd(fn, ref, q, k, v, do, TOL[jnp.float32])


def test_dispatcher_pallas_branch_matches_xla():
    q, k, v, _ = _inputs(5, 1, 24, 24, 4, 2, 16, jnp.float32)
    got = attention(q, k, v, causal=True, impl="pallas")
    np.testing.assert_allclose(got, attention(q, k, v, causal=True, impl="xla"), atol=2e-5, rtol=2e-5)


def test_bad_inputs_raise():
    q = jnp.zeros((1, 8, 6, 16))
    kv = jnp.zeros((1, 8, 4, 16))
    with pytest.raises(ValueError, match=r"q_heads=6 must be a multiple of kv_heads=4"):
        flash_attention(q, kv, kv)
    with pytest.raises(ValueError, match=r"^flash_attention: v is a list; accepted: an array$"):
        flash_attention(q, kv, kv.tolist())  # an AttributeError ('ndim') before
    with pytest.raises(ValueError, match=r"head_dim"):
        flash_attention(q, jnp.zeros((1, 8, 2, 8)), jnp.zeros((1, 8, 2, 8)))
    with pytest.raises(ValueError, match=r"k \(1, 8, 2, 16\) and v \(1, 9, 2, 16\)"):
        flash_attention(q, jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 9, 2, 16)))
    with pytest.raises(ValueError, match="block_q=48; accepted: a power of two >= 16"):
        flash_attention(q, jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2, 16)), block_q=48)
    with pytest.raises(ValueError, match="flash_attention: causal='no'; accepted: True or False"):
        flash_attention(q, jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2, 16)), causal="no")


def test_dispatcher_checks_offsets_lengths_and_dtypes():
    q, k, v, _ = _inputs(3, 2, 4, 10, 4, 2, 16, jnp.float32)
    # A scalar offset / length is every row's.
    np.testing.assert_array_equal(attention(q, k, v, q_offset=6, kv_lengths=9, impl="xla"),
                                  attention(q, k, v, q_offset=jnp.full((2,), 6), kv_lengths=jnp.full((2,), 9),
                                            impl="xla"))
    for kw, message in [(dict(q_offset=jnp.zeros((3,), jnp.int32)), r"q_offset has shape \(3,\); accepted: a scalar"),
                        (dict(kv_lengths=jnp.ones((2,))), "kv_lengths has dtype float32; accepted: integers")]:
        with pytest.raises(ValueError, match=message):
            attention(q, k, v, impl="xla", **kw)
    with pytest.raises(ValueError, match="q has dtype int32; accepted: a floating dtype"):
        attention(q.astype(jnp.int32), k, v, impl="xla")
    with pytest.raises(ValueError, match="kv_len is 0"):
        attention(q, k[:, :0], v[:, :0], impl="xla")
    with pytest.raises(ValueError, match="attention: causal=None; accepted: True or False"):
        attention(q, k, v, causal=None, impl="xla")


def tpu_topology_device():
    """The first device of an ahead-of-time TPU topology, or skip when libtpu is absent."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed")
    from jax.experimental import topologies

    # Other processes on this host may hold libtpu's lock file; compiling needs no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1").devices[0]
    except Exception as e:  # noqa: BLE001 - any failure to build the topology means: cannot check here
        pytest.skip(f"no TPU topology: {e}")


def compile_grad_for_tpu(fn, device, q_shape, kv_shape, dtype):
    """Compile d(sum fn)/d(q, k, v) for `device` without running it."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct(q_shape, dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct(kv_shape, dtype, sharding=sharding)
    loss = lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).compile()


def lower_grad_for_gpu(fn, q_shape, kv_shape, dtype):
    """StableHLO text of d(sum fn)/d(q, k, v) lowered for CUDA, checking no deprecation warning is raised."""
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    kv = jax.ShapeDtypeStruct(kv_shape, dtype)
    loss = lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    with warnings.catch_warnings():
        # JAX 0.11 deprecates the Pallas Triton backend (its replacement, Mosaic GPU, needs a
        # different kernel structure); up to 0.10 this lowering must be warning-free.
        if jax.__version_info__ < (0, 11):
            warnings.simplefilter("error", DeprecationWarning)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


def cuda_lowering_available():
    """Skip unless this JAX can lower a trivial function for CUDA (the Triton lowering needs nothing more)."""
    try:
        jax.jit(lambda x: x + 1).trace(jax.ShapeDtypeStruct((2,), jnp.float32)).lower(lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001 - any failure here means this host cannot lower for CUDA at all
        pytest.skip(f"cannot lower for cuda here: {e}")


@pytest.mark.parametrize("D", [80, 96])
def test_flash_lowers_for_gpu_with_any_head_dim(D):
    cuda_lowering_available()
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=False)  # noqa: E731
    text = lower_grad_for_gpu(fn, (1, 64, 2, D), (1, 64, 1, D), jnp.bfloat16)
    assert text.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.parametrize("causal", [True, False])
def test_flash_lowers_to_triton_for_gpu(causal):
    fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, interpret=False)  # noqa: E731
    text = lower_grad_for_gpu(fn, (1, 300, 3, 64), (1, 300, 1, 64), jnp.bfloat16)
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv


def test_flash_compiles_for_tpu():
    device = tpu_topology_device()
    for causal, dtype, (T, H, K, D) in [(True, jnp.bfloat16, (300, 3, 1, 64)), (False, jnp.float32, (256, 4, 4, 128))]:
        fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, interpret=False)  # noqa: E731
        compiled = compile_grad_for_tpu(fn, device, (1, T, H, D), (1, T, K, D), dtype)
        assert compiled.as_text().count("tpu_custom_call") >= 3  # forward, dq, dk/dv kernels


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
@pytest.mark.parametrize("T,H,K,causal", [(1000, 8, 2, True), (4096, 4, 4, False)])
def test_flash_compiled_on_accelerator(T, H, K, causal):
    q, k, v, do = _inputs(T, 1, T, T, H, K, 128, jnp.bfloat16)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, interpret=False)  # noqa: E731
    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        _check_fwd_bwd(fn, ref, q, k, v, do, TOL[jnp.bfloat16])


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_flash_and_auto_take_long_sequences_for_tpu():
    """No VMEM bound for the flash kernel on TPU: at Llama's 32/8 heads and 4k it traces, and `auto` uses it."""
    from jmem.kernels.dispatch import compiling_for

    q, kv = _sds((1, 4096, 32, 128)), _sds((1, 4096, 8, 128))
    with compiling_for("tpu"):
        jax.eval_shape(lambda q, k, v: flash_attention(q, k, v), q, kv, kv)
        assert "pallas_call" in str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, impl="auto"))(q, kv, kv))


def test_float16_for_tpu_is_refused_by_the_kernels_and_auto_takes_xla():
    """Mosaic does not compile float16 loads: the kernels refuse it in one line naming the dtype, before
    any lowering, and `auto` attention runs it through XLA; float16 still takes the kernel on GPU."""
    from jmem.kernels.dispatch import compiling_for
    from jmem.kernels.masks import Causal
    from jmem.kernels.sparse_attention import sparse_attention

    q, kv = _sds((1, 32, 2, 64), jnp.float16), _sds((1, 32, 1, 64), jnp.float16)
    with compiling_for("tpu"):
        for name, fn in (("flash_attention", flash_attention),
                         ("sparse_attention", lambda q, k, v: sparse_attention(q, k, v, Causal()))):
            with pytest.raises(ValueError, match=f"{name}: dtype float16 does not compile for TPU; accepted on TPU: "
                                                 "float32, bfloat16"):
                jax.eval_shape(fn, q, kv, kv)
        assert "pallas_call" not in str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, impl="auto"))(q, kv, kv))
        jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, interpret=True), q, kv, kv)  # the interpreter takes it
    with compiling_for("gpu"):
        assert "pallas_call" in str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, impl="auto"))(q, kv, kv))
    # A model's forward resolves "auto" itself: it forced the kernel on float16 too.
    from flax import nnx

    from jmem.models import Llama, get_config

    model = Llama(get_config("tiny", compute_dtype="f16", attention_impl="auto"), rngs=nnx.Rngs(0))
    ids = jnp.zeros((1, 16), jnp.int32)
    for platform, kernel in (("tpu", False), ("gpu", True)):
        with compiling_for(platform):
            assert ("pallas_call" in str(jax.make_jaxpr(lambda ids: model(ids)[0])(ids))) == kernel
    with pytest.raises(ValueError, match="interpret='no'; accepted: True or False"):
        flash_attention(*(jnp.zeros(x.shape, x.dtype) for x in (q, kv, kv)), interpret="no")


def test_flash_compiles_for_tpu_at_training_length():
    """fwd + bwd at Llama's 32/8 heads and q_len 4096 compile for TPU v5e: the TPU body streams tiles through
    the grid, so no program holds a whole sequence in VMEM (the whole-row body needed 24 MiB of 16 here)."""
    device = tpu_topology_device()
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=False)  # noqa: E731
    compiled = compile_grad_for_tpu(fn, device, (1, 4096, 32, 128), (1, 4096, 8, 128), jnp.bfloat16)
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 3 and "flash_dkdv_stream" in text


def test_dispatcher_refuses_negative_offsets_and_lengths_past_kv_len():
    q, k, v, _ = _inputs(3, 2, 4, 10, 4, 2, 16, jnp.float32)
    for kw, message in [(dict(kv_lengths=-3), r"attention: kv_lengths=-3; accepted: integers in \[0, kv_len=10\]"),
                        (dict(kv_lengths=jnp.array([10, -1])), r"attention: kv_lengths\[1\]=-1; accepted"),
                        (dict(kv_lengths=11), r"attention: kv_lengths=11; accepted: integers in \[0, kv_len=10\]"),
                        (dict(q_offset=np.array([0, -5])), r"attention: q_offset\[1\]=-5; accepted: integers in \[0, "),
                        # Past int32 (the positions' dtype): they wrapped to 0 or to a negative offset.
                        (dict(q_offset=np.array([2**32, 0], np.int64)), r"q_offset\[0\]=4294967296; accepted: "
                         r"integers in \[0, int32 max - q_len=2147483643\]"),
                        (dict(q_offset=np.uint32(2**31)), r"q_offset=2147483648; accepted"),
                        (dict(q_offset=2**31 - 4), r"q_offset=2147483644; accepted"),  # its last query's wraps
                        (dict(q_offset=2**40), r"q_offset=1099511627776; accepted")]:
        for impl in ("xla", "pallas"):
            with pytest.raises(ValueError, match=message):
                attention(q, k, v, impl=impl, **kw)
        with pytest.raises(ValueError, match=message):  # the exported plain path checks alike
            xla_attention(q, k, v, **kw)
    # The ends of the ranges are accepted; traced values are not checked (the cached decode's offsets are traced).
    assert not attention(q, k, v, kv_lengths=0, impl="xla").any()
    np.testing.assert_allclose(attention(q, k, v, q_offset=2**31 - 5, impl="xla"),  # every key visible
                               attention(q, k, v, causal=False, impl="xla"), atol=1e-6)
    want = attention(q, k, v, q_offset=20, kv_lengths=10, impl="xla")
    got = jax.jit(lambda off, n: attention(q, k, v, q_offset=off, kv_lengths=n, impl="xla"))(jnp.int32(20), jnp.int32(10))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)  # jit may fuse differently: rounding only


def test_plain_paths_refuse_what_the_dispatcher_refuses():
    """`xla_attention` and `attention_reference` (exported) name bad input in one line; they failed deep inside
    (a reshape, a subscript of an int offset, a broadcast of a wrong mask)."""
    q, k, v, _ = _inputs(3, 2, 4, 10, 4, 2, 16, jnp.float32)
    for fn in (xla_attention, attention_reference):
        with pytest.raises(ValueError, match=r"q_heads=3 must be a multiple of kv_heads=2"):
            fn(q[:, :, :3], k, v)
        with pytest.raises(ValueError, match=r"mask_TS has shape \(3, 3\); accepted: a bool array \[q_len, kv_len\]"):
            fn(q, k, v, mask_TS=np.ones((3, 3), bool))
        with pytest.raises(ValueError, match="q is a list; accepted: an array"):
            fn(q.tolist(), k, v)
    np.testing.assert_allclose(xla_attention(q, k, v, q_offset=3), xla_attention(q, k, v, q_offset=jnp.full(2, 3)))


@pytest.mark.parametrize("D,num_warps,expected", [(128, None, 8), (96, None, 8), (64, None, 4), (128, 2, 2)])
def test_flash_gpu_warps_follow_head_dim(D, num_warps, expected):
    cuda_lowering_available()
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=False, num_warps=num_warps)  # noqa: E731
    text = lower_grad_for_gpu(fn, (1, 64, 2, D), (1, 64, 1, D), jnp.bfloat16)
    assert text.count(f"num_warps = {expected} : i32") == 3  # forward, dq, dk/dv


@pytest.mark.parametrize("bad", [3, 0, True, 8.0, "8"])
def test_flash_refuses_bad_num_warps(bad):
    q = jnp.zeros((1, 16, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"num_warps=.*accepted: None, 1, 2, 4, 8, 16"):
        flash_attention(q, q, q, num_warps=bad)


def test_gradients_of_gradients_are_one_clear_error():
    """Pallas cannot differentiate the kernels (it failed on a bare assertion); the reference can."""
    from jmem.kernels.masks import Causal
    from jmem.kernels.sparse_attention import sparse_attention, sparse_attention_reference

    q, k = jax.random.normal(jax.random.key(0), (1, 16, 2, 16)), jax.random.normal(jax.random.key(1), (1, 16, 1, 16))
    hvp = lambda f: jax.grad(lambda q: (jax.grad(lambda q: f(q, k, k).sum())(q) ** 2).sum())(q)  # noqa: E731
    for kernel, reference in [(flash_attention, attention_reference),
                              (lambda *a: sparse_attention(*a, Causal()),
                               lambda *a: sparse_attention_reference(*a, Causal()))]:
        with pytest.raises(NotImplementedError, match=r"has first-order gradients only .*accepted for gradients "
                                                      r"of gradients: jmem\.kernels\."):
            hvp(kernel)
        assert np.isfinite(np.asarray(hvp(reference))).all()
    assert np.allclose(jax.grad(lambda q: flash_attention(q, k, k).sum())(q),
                       jax.grad(lambda q: attention_reference(q, k, k).sum())(q), atol=1e-5)
