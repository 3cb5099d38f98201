"""Quantized weight leaves: packing, dot, bytes per weight, round-trip error."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.models.dot import dot
from jmem.quant import FP8Tensor, IntTensor, NF4Tensor, NF4_CODE, pack_bits, unpack_bits
from jmem.quant.nf4 import NF4_ABSMAX_BLOCK, NF4_BLOCK

L, N_IN, N_OUT = 2, 256, 64


def _w(seed=0, shape=(L, N_IN, N_OUT)):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.02


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_roundtrip(bits):
    u = jax.random.randint(jax.random.key(bits), (L, 64, 24), 0, 2**bits)
    packed = pack_bits(u, bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (L, 64 * bits // 8, 24)
    np.testing.assert_array_equal(unpack_bits(packed, bits), u)


def _leaves(w):
    return {
        "int8": IntTensor.quantize(w, 8, None),
        "int4_g128_sym": IntTensor.quantize(w, 4, 128),
        "int4_g32_zp": IntTensor.quantize(w, 4, 32, symmetric=False),
        "int3_g64_sym": IntTensor.quantize(w, 3, 64),
        "int3_g128_zp": IntTensor.quantize(w, 3, 128, symmetric=False),
        "nf4": NF4Tensor.quantize(w),
        "fp8": FP8Tensor.quantize(w),
    }


def test_dot_matches_dequantized_matmul_under_scan():
    """`dot(x, leaf)` inside a scan over the stacked axis equals x @ dequantize() per layer."""
    all_leaves = _leaves(_w())
    # Formats whose unpacking differs (bytes, 4-bit pairs, 3-bit words, NF4, fp8); one compile.
    leaves = {k: all_leaves[k] for k in ("int8", "int4_g128_sym", "int3_g128_zp", "nf4", "fp8")}
    x = jax.random.normal(jax.random.key(1), (3, N_IN), jnp.float32)

    @jax.jit
    def scanned(leaves):
        def body(c, layer):
            return c, jax.tree_util.tree_map(lambda q: dot(x, q), layer, is_leaf=lambda q: hasattr(q, "dequantize"))
        return jax.lax.scan(body, 0, leaves)[1]

    ys = scanned(leaves)
    for name, q in leaves.items():
        assert q.shape == (L, N_IN, N_OUT) and q[1].shape == (N_IN, N_OUT), name
        expect = jnp.einsum("ni,lio->lno", x, q.dequantize(jnp.float32), precision="highest")
        np.testing.assert_allclose(ys[name], expect, rtol=1e-5, atol=1e-5, err_msg=name)


def test_bytes_per_weight():
    """Stored bytes are exactly what each format promises."""
    w = _w()
    n = L * N_IN * N_OUT
    q = _leaves(w)
    groups = lambda g: L * (N_IN // g) * N_OUT  # noqa: E731
    assert q["int8"].nbytes == n + 2 * L * N_OUT  # u8 codes + f16 scale per column
    assert q["int4_g128_sym"].nbytes == n // 2 + 2 * groups(128)  # 4.125 bits
    assert q["int4_g128_sym"].nbytes * 8 / n == 4.125
    assert q["int4_g32_zp"].nbytes == n // 2 + 3 * groups(32)  # f16 scale + u8 zero
    assert q["int3_g64_sym"].nbytes == n * 3 // 8 + 2 * groups(64)
    assert q["int3_g128_zp"].nbytes * 8 / n == 3 + 24 / 128
    n_abs = N_IN // NF4_BLOCK * N_OUT  # 256 per layer: exactly one second-level block
    assert q["nf4"].nbytes == n // 2 + L * (n_abs + 4 * n_abs // NF4_ABSMAX_BLOCK + 4)
    assert q["fp8"].nbytes == n + 4 * L * N_OUT
    # The 4-bit group-128 formats stay under 0.16 of f32 bytes.
    assert q["int4_g128_sym"].nbytes / (4 * n) <= 0.16 and q["nf4"].nbytes / (4 * n) <= 0.16


def test_int_roundtrip_error_bounds():
    w = _w(2)
    for bits, g, sym in [(8, None, True), (8, None, False), (4, 128, True), (4, 32, False), (3, 64, True),
                         (3, 128, False), (2, None, False)]:
        q = IntTensor.quantize(w, bits, g, symmetric=sym)
        err = jnp.abs(q.dequantize() - w).reshape(L, -1, q.group_size, N_OUT)
        scale = q.scale.astype(jnp.float32)[:, :, None, :]
        # Rounding moves a value at most half a step, the group's extremes too: the f16 scale is rounded
        # up, so the grid (after the zero point's own rounding) still spans the group.
        assert bool(jnp.all(err <= 0.5 * scale * (1 + 1e-6) + 1e-9)), (bits, g, sym, float(jnp.max(err / scale)))
        assert float(err.mean()) < 0.3 * float(scale.mean())


def test_int_roundtrip_error_does_not_grow_for_small_weights():
    """Round-to-nearest with per-group scales is scale-invariant: a layer of tiny weights keeps its
    relative error (f16 scales go down into f16's subnormal range instead of stopping at its
    smallest normal, 6e-5, which left groups below ~1e-2 with a coarse grid or all zeros)."""
    w = _w(3) / 0.02

    def rel(q, w):
        return float(jnp.linalg.norm(q.dequantize() - w) / jnp.linalg.norm(w))

    for bits, g in [(8, None), (4, 32)]:
        ref = rel(IntTensor.quantize(w, bits, g), w)
        for magnitude in (1e-3, 1e-4, 1e-5):
            assert rel(IntTensor.quantize(w * magnitude, bits, g), w * magnitude) < 1.25 * ref, (bits, magnitude)


def test_nf4_codebook_is_normal_quantiles():
    stats = pytest.importorskip("scipy.stats")
    offset = 0.9677083
    pos = stats.norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    neg = -stats.norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    v = np.sort(np.concatenate([pos, [0.0], neg]))
    np.testing.assert_allclose(NF4_CODE, v / v.max(), atol=1e-6)


def test_nf4_roundtrip_and_double_quant():
    w = _w(3)
    q = NF4Tensor.quantize(w)
    assert q.codes.dtype == jnp.uint8 and q.absmax_q.dtype == jnp.int8
    true_absmax = jnp.abs(w.reshape(L, N_IN // NF4_BLOCK, NF4_BLOCK, N_OUT)).max(axis=2)
    absmax = q.absmax()
    # int8 of (absmax - mean) per 256-block: error at most half a step.
    step = q.absmax_scale[:, :, None]
    a_err = jnp.abs(absmax - true_absmax).reshape(L, -1, NF4_ABSMAX_BLOCK)
    assert bool(jnp.all(a_err <= 0.5 * step * 1.001 + 1e-9))
    # Each weight lands on the nearest code of its block: half the widest gap.
    half_gap = float(np.max(np.diff(NF4_CODE))) / 2
    err = jnp.abs(q.dequantize() - w).reshape(L, N_IN // NF4_BLOCK, NF4_BLOCK, N_OUT)
    bound = half_gap * absmax[:, :, None, :] + jnp.abs(absmax - true_absmax)[:, :, None, :]
    assert bool(jnp.all(err <= bound * 1.001 + 1e-7))


def test_fp8_roundtrip():
    w = _w(4)
    q = FP8Tensor.quantize(w)
    assert q.q.dtype == jnp.float8_e4m3fn
    scale = q.scale
    err = jnp.abs(q.dequantize() - w)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normal values,
    # absolute <= half the subnormal step (2**-10) times the scale below them.
    assert bool(jnp.all(err <= jnp.maximum(jnp.abs(w) * 2.0**-4, scale * 2.0**-10) * 1.001))


def test_bad_inputs():
    w = _w()
    with pytest.raises(ValueError, match="bits=5"):
        IntTensor.quantize(w, bits=5)
    with pytest.raises(ValueError, match="group_size=96"):
        IntTensor.quantize(w, bits=4, group_size=96)
    with pytest.raises(ValueError, match=rf"^clip has shape \(2, 3, 64\); accepted: f32\[{L}, 2, 64\]"):
        IntTensor.quantize(w, bits=4, group_size=128, clip=np.ones((2, 3, 64)))
    for bad in (0.0, 1.5, np.nan):
        with pytest.raises(ValueError, match=r"^clip holds values outside \(0, 1\]"):
            IntTensor.quantize(w, bits=4, group_size=128, clip=np.full((L, 2, 64), bad))
    clipped = IntTensor.quantize(w, bits=4, group_size=128, clip=np.full((L, 2, 64), 0.5))
    assert float(jnp.max(jnp.abs(clipped.dequantize()))) < 0.6 * float(jnp.max(jnp.abs(w)))
    with pytest.raises(ValueError, match="multiple of 64"):
        NF4Tensor.quantize(_w(shape=(96, 8)))


@pytest.mark.parametrize("symmetric", [True, False])
def test_scale_beyond_f16_is_refused_not_nan(symmetric):
    """A group needing an f16 scale above 65504 would decode to NaN: one ValueError naming the range and the
    limit, from RTN and GPTQ alike; a weight at the limit's scale still decodes finite."""
    from jmem.quant import gptq_quantize

    big = np.full((64, 4), 1e6, np.float32)
    big[::2] *= -0.5
    limit = "458528 (65504 x 7 steps)" if symmetric else "982560 (65504 x 15 steps)"
    msg = rf"^the weight w ranges over -500000\.\.1e\+06: 8 group\(s\) of 32 rows need an f16 scale above 65504 .*" \
          rf"{re.escape(limit)}"
    with pytest.raises(ValueError, match=msg):
        IntTensor.quantize(big, 4, 32, symmetric=symmetric)
    with pytest.raises(ValueError, match=msg):
        gptq_quantize(big, np.eye(64), 4, 32, symmetric=symmetric)
    ok = np.asarray(IntTensor.quantize(big / 4, 4, 32, symmetric=symmetric).dequantize())
    assert np.isfinite(ok).all()


def test_weight_below_the_smallest_f16_scale_is_refused_not_zeroed():
    """f16 scales stop at 6e-8: a non-zero weight whose every value is under half that would decode to all
    zeros, and is refused; an all-zero weight, and tiny groups beside normal ones, quantize as before."""
    w = np.asarray(_w(5, (64, 8)))
    with pytest.raises(ValueError, match=r"would decode to all zeros; accepted: a weight with some "
                                         r"\|value\| >= 2\.98e-08"):
        IntTensor.quantize(w * 1e-9, 4, 32)
    with pytest.raises(ValueError, match="would decode to all zeros"):
        IntTensor.quantize(w * 1e-9, 8, None, symmetric=False)
    assert not np.asarray(IntTensor.quantize(np.zeros((64, 8), np.float32), 4, 32).dequantize()).any()
    mixed = w.copy()
    mixed[:32] *= 1e-9
    d = np.asarray(IntTensor.quantize(mixed, 4, 32).dequantize())
    assert np.abs(d[:32] - mixed[:32]).max() <= 3e-8 and np.abs(d[32:]).max() > 0
