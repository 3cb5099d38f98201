"""GGML block formats: our jnp dequantize vs `gguf.quants`, quantize round trips."""

import re

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jmem.quant import ggml, ggml_quantize
from jmem.quant.ggml_quantize import quantize

# Byte offsets of the f16 scales inside one block, so random payloads get finite scales.
F16_OFFSETS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.IQ4_NL: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
QUANTIZED = tuple(F16_OFFSETS)
# Bits per code of each type (the scale overhead is not counted).
CODE_BITS = {T.Q2_K: 2, T.Q3_K: 3, T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5,
             T.Q5_K: 5, T.Q6_K: 6, T.Q8_0: 8, T.IQ4_NL: 4}


def random_raw(rng, qt, lead, n_blocks):
    """Random payload bytes with finite random f16 scales: u8[*lead, n_blocks * type_size]."""
    fmt = ggml.FORMATS[qt]
    if qt == T.F32:
        return rng.normal(size=(*lead, n_blocks)).astype("<f4").view(np.uint8)
    if qt == T.F16:
        return rng.normal(size=(*lead, n_blocks)).astype("<f2").view(np.uint8)
    if qt == T.BF16:
        bits = (rng.normal(size=(*lead, n_blocks)).astype("<f4").view(np.uint32) >> 16).astype("<u2")
        return bits.view(np.uint8)
    raw = rng.integers(0, 256, (*lead, n_blocks, fmt.type_size), dtype=np.uint8)
    for off in F16_OFFSETS[qt]:
        scale = rng.normal(0.0, 1.0, (*lead, n_blocks)).astype("<f2")
        raw[..., off : off + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(*lead, n_blocks * fmt.type_size)


ROW = 1024  # weights per row: whole blocks of every type


@pytest.mark.parametrize("qt", list(ggml.FORMATS), ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_exactly(qt):
    rng = np.random.default_rng(int(qt))
    fmt = ggml.FORMATS[qt]
    raw = random_raw(rng, qt, (2, 3), ROW // fmt.block_size)  # leading axes as a stacked [layers, out] weight
    ref = raw.view(np.float32) if qt == T.F32 else gguf.quants.dequantize(raw, qt)
    ours = np.asarray(ggml.dequantize(raw, qt.name))
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (2, 3, ROW)
    np.testing.assert_array_equal(ours, ref)
    # int qtype and an explicit shape; same compiled decoder.
    np.testing.assert_array_equal(np.asarray(ggml.dequantize(raw, int(qt), shape=(6, -1))), ref.reshape(6, -1))


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_dequantize_inside_jit(qt):
    rng = np.random.default_rng(5)
    raw = random_raw(rng, qt, (4,), 256 // ggml.FORMATS[qt].block_size)
    x = rng.normal(size=(2, 256)).astype(np.float32)
    ref = gguf.quants.dequantize(raw, qt)

    @jax.jit
    def weights_and_product(x, r):
        w = ggml.dequantize(r, qt)
        return w, x @ w.T

    w, y = weights_and_product(x, raw)
    np.testing.assert_array_equal(np.asarray(w), ref)
    # The product's rounding depends on how the backend orders the sum: bound it by the magnitudes summed.
    scale = (np.abs(x) @ np.abs(ref).T).max()
    np.testing.assert_allclose(np.asarray(y), x @ ref.T, rtol=0, atol=1e-6 * scale)


def test_float_types_accept_typed_arrays():
    x = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(ggml.dequantize(x, T.F16)), x.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(ggml.dequantize(x.astype(np.float32), "f32")), x.astype(np.float32))


@pytest.mark.parametrize("qt", list(ggml.FORMATS), ids=lambda t: t.name)
def test_quantize_round_trip(qt):
    rng = np.random.default_rng(100 + int(qt))
    x = rng.normal(size=(2, 3, ROW)).astype(np.float32)
    raw = quantize(x, qt)
    fmt = ggml.FORMATS[qt]
    assert raw.dtype == np.uint8 and raw.shape == (2, 3, ROW // fmt.block_size * fmt.type_size)
    ours = np.asarray(ggml.dequantize(raw, qt))
    ref = raw.view(np.float32) if qt == T.F32 else gguf.quants.dequantize(raw, qt)
    np.testing.assert_array_equal(ours, ref)
    rel_rmse = np.sqrt(((ours - x) ** 2).mean() / (x**2).mean())
    if qt == T.F32:
        assert rel_rmse == 0.0
    elif qt == T.F16:
        assert rel_rmse < 2.0**-11
    elif qt == T.BF16:
        assert rel_rmse < 2.0**-8
    else:
        # A uniform quantizer with b-bit codes over each block's range.
        assert rel_rmse < 1.5 * 2.0 ** -CODE_BITS[qt], rel_rmse


@pytest.mark.parametrize("qt", [T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_legacy_quantize_matches_gguf_bytes(qt):
    x = np.random.default_rng(7).normal(size=(8, 256)).astype(np.float32)
    np.testing.assert_array_equal(quantize(x, qt), gguf.quants.quantize(x, qt))


def test_k_quant_scale_search_beats_single_scale_formats():
    x = np.random.default_rng(3).normal(size=(16, 512)).astype(np.float32)

    def err(qt):
        # gguf's decoder, shown equal to ours above, so no extra compiles here.
        return float(((gguf.quants.dequantize(quantize(x, qt), qt) - x) ** 2).mean())

    assert err(T.Q4_K) < err(T.Q4_1)
    assert err(T.Q5_K) < err(T.Q5_1)
    # IQ4_NL: Q4_0's size (4.5 bits per weight), a non-uniform grid and a scale search: below Q4_0's error.
    assert ggml.FORMATS[T.IQ4_NL].type_size == ggml.FORMATS[T.Q4_0].type_size
    assert err(T.IQ4_NL) < 0.9 * err(T.Q4_0)


def test_k_quant_scale_codes_round_halves_as_llama_cpp():
    """llama.cpp rounds the K-quants' sub-block scale codes with `nearest_int` (adding 1.5 * 2**23 in f32:
    halves to even), not `roundf`: on exact halves the bytes agree with its quantizer."""
    def nearest_int(v):
        return (np.asarray(v, np.float32) + np.float32(12582912.0)).view(np.int32) - np.int32(0x4B400000)

    codes, _ = ggml_quantize._quantize_scales(np.array([[63.0, 2.5, 4.5, 5.5, 0.5]], np.float32), 63)
    np.testing.assert_array_equal(codes, nearest_int([[63.0, 2.5, 4.5, 5.5, 0.5]]))
    np.testing.assert_array_equal(codes, [[63, 2, 4, 6, 0]])
    signed, _ = ggml_quantize._signed_scale_codes(np.array([[-32.0, 2.5, -4.5, 7.5]], np.float32), 32)
    np.testing.assert_array_equal(signed, [[-32, 2, -4, 8]])


def test_iq4_nl_search_in_chunks_equals_one_pass():
    x = np.random.default_rng(4).normal(size=(10, 32)).astype(np.float32)
    np.testing.assert_array_equal(ggml_quantize._q_iq4_nl(x, chunk=3), ggml_quantize._q_iq4_nl(x))


@pytest.mark.parametrize("qt", QUANTIZED, ids=lambda t: t.name)
def test_quantize_zero_and_constant_rows(qt):
    n = ggml.FORMATS[qt].block_size
    x = np.stack([np.zeros(n), np.full(n, -0.75), np.full(n, 0.5)]).astype(np.float32)
    y = gguf.quants.dequantize(quantize(x, qt), qt)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[0], 0.0)
    np.testing.assert_allclose(y[1:], x[1:], atol=0.02)


def test_unsupported_type_error_names_type_and_lists_supported():
    for bad in ("IQ2_XXS", T.Q8_1, "nope", 999):
        with pytest.raises(ValueError, match="supported: F32, F16, BF16, Q4_0") as info:
            ggml.dequantize(np.zeros((1, 34), np.uint8), bad)
        assert str(bad if not isinstance(bad, T) else bad.name) in str(info.value)
    with pytest.raises(ggml.UnsupportedGGMLTypeError, match="IQ4_XS"):
        quantize(np.zeros((1, 256), np.float32), T.IQ4_XS)
    for not_an_id in (8.9, True, np.float32(2.5)):  # int() would truncate them to Q8_0, F16, Q4_0
        with pytest.raises(ggml.UnsupportedGGMLTypeError, match=re.escape(repr(not_an_id))):
            quantize(np.zeros((1, 32), np.float32), not_an_id)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="block size 256"):
        quantize(np.zeros((2, 100), np.float32), "q4_k")
    with pytest.raises(ValueError, match="18-byte blocks"):
        ggml.dequantize(np.zeros((2, 20), np.uint8), "Q4_0")
    with pytest.raises(ValueError, match=r"shape=\[3, 32\] does not fit the 64 values the Q8_0 data decodes to"):
        ggml.dequantize(np.zeros((2, 34), np.uint8), "Q8_0", shape=(3, 32))  # jax's reshape TypeError before


@pytest.mark.parametrize("qt", [T.Q8_0, T.Q4_K, T.IQ4_NL], ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_quantize_refuses_non_finite_weights(qt, bad):
    """One NaN/inf would spoil its whole block's scale (32 or 256 weights); refused as GGMLWeight.from_float does."""
    x = np.ones((2, 256), np.float32)
    x[1, 7] = bad
    with pytest.raises(ValueError, match="the weights x has 1 non-finite value"):
        quantize(x, qt)


@pytest.mark.parametrize("qt", [T.F16, T.Q4_0, T.Q4_1, T.Q8_0, T.Q2_K, T.Q6_K, T.IQ4_NL], ids=lambda t: t.name)
def test_quantize_keeps_the_f16_range_and_refuses_beyond_it(qt):
    """Values up to f16's largest (65504) decode finite in every format; one finite value beyond it would
    be written as inf/NaN (the value, or its block's f16 scale): refused."""
    x = np.random.default_rng(0).normal(size=(2, 256)).astype(np.float32)
    x[0, ::2], x[0, 1::2] = 65504, -65504
    assert np.isfinite(np.asarray(ggml.dequantize(quantize(x, qt), qt))).all()
    x[1, 3] = 1e6
    with pytest.raises(ValueError, match=f"hold 1 value.s. beyond the f16 range .largest .value. 1e.06., which "
                                         f"{qt.name} cannot store"):
        quantize(x, qt)


def test_format_table_matches_gguf():
    for qt, fmt in ggml.FORMATS.items():
        assert (fmt.block_size, fmt.type_size) == gguf.GGML_QUANT_SIZES[qt]
    assert ggml.row_bytes(512, "Q6_K") == 420


def test_the_output_head_falls_back_like_every_other_matrix():
    """A head row that Q8_0's 32-weight block does not divide got Q8_0 anyway, and `jmem quantize --out X.gguf`
    stopped with advice it offers no flag to follow; it now takes F16, as `fitting_qtype` gives the blocks."""
    assert [ggml.output_qtype(q, 72).name for q in ("Q4_K", "Q2_K", "Q6_K", "Q4_0")] == ["F16"] * 4
    assert ggml.output_qtype("Q4_K", 576).name == "Q8_0" and ggml.output_qtype("Q4_K", 512).name == "Q6_K"
    assert ggml.output_qtype("Q8_0", 72).name == "Q8_0"  # as asked: refused by name where it does not fit
