"""GGML encoders: float rows to llama.cpp block bytes (numpy, offline: writing GGUF, packing weights).

`quantize(x, qtype)` gives bytes that `jmem.quant.ggml.dequantize` and
`gguf.quants.dequantize` decode to the same values. The legacy formats follow
llama.cpp's reference rounding; the K-quants run a small vectorised scale
search (candidate scales, least-squares refit) per sub-block, like llama.cpp's
reference quantizer without importance weights; IQ4_NL (16 fixed non-uniform
levels times one f16 scale per 32 weights) searches its scale the same way.
Each `_q_*` maps f32[N, block_size] -> u8[N, type_size].
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from jmem.quant.ggml import FORMATS, IQ4_NL_VALUES, QK_K, resolve_qtype
from jmem.quant.qtensor import F16_MAX, check_finite, f16_overflow


def check_f16_range(x: np.ndarray, name: str, qtype: str) -> None:
    """Refuse finite values beyond f16's range for F16 and the block types (whose scales are f16):
    they would be written as inf/NaN. One ValueError naming `name`, the count and the largest."""
    n, big = f16_overflow(x)
    if n:
        raise ValueError(f"{name} hold {n} value(s) beyond the f16 range (largest |value| {big:.6g}), which {qtype} "
                         f"cannot store (its values or block scales are f16); accepted: |value| <= {F16_MAX:g}, "
                         "or F32/BF16")


def _f16_bytes(v):
    """f32[N] -> u8[N, 2], little-endian f16."""
    return np.asarray(v, np.float32).astype("<f2").reshape(-1, 1).view(np.uint8)


def _round_away(v):
    """C `roundf` (llama.cpp's Q8_0): halves away from zero."""
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _nearest_int(v):
    """llama.cpp `nearest_int` (its K-quant scale codes): halves to even, as adding 1.5 * 2**23 in f32 rounds."""
    return np.rint(np.asarray(v, np.float32))


def _safe_inv(d):
    with np.errstate(divide="ignore"):
        return np.where(d == 0, 0.0, 1.0 / np.where(d == 0, 1.0, d)).astype(np.float32)


def _pack_nibbles(q):
    """i[N, 32] in 0..15 -> u8[N, 16]: weight j in the low nibble of byte j, j+16 in the high one."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _pack_bits32(bits):
    """i[N, 32] of 0/1 -> u8[N, 4], the little-endian u32 with bit j for weight j."""
    return np.packbits(bits.astype(np.uint8), axis=-1, bitorder="little")


def _signed_absmax(x):
    """The entry of largest magnitude per row, sign kept: f32[N, 1]."""
    idx = np.abs(x).argmax(axis=-1)[:, None]
    return np.take_along_axis(x, idx, axis=-1)


def _q_sym_legacy(x, nlev):
    """Q4_0 (nlev=16) / Q5_0 (nlev=32): d = max / -(nlev/2), codes trunc(x/d + nlev/2 + .5)."""
    d = _signed_absmax(x) / np.float32(-nlev // 2)
    q = np.trunc(x * _safe_inv(d) + np.float32(nlev // 2 + 0.5)).astype(np.int32)
    return d[:, 0], np.clip(q, 0, nlev - 1)


def _q_asym_legacy(x, nlev):
    """Q4_1 / Q5_1: d = (max - min) / (nlev - 1), m = min."""
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(nlev - 1)
    q = np.trunc((x - lo) * _safe_inv(d) + np.float32(0.5)).astype(np.int32)
    return d[:, 0], lo[:, 0], np.clip(q, 0, nlev - 1)


def _q_q4_0(x):
    d, q = _q_sym_legacy(x, 16)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=-1)


def _q_q4_1(x):
    d, m, q = _q_asym_legacy(x, 16)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), _pack_nibbles(q)], axis=-1)


def _q_q5_0(x):
    d, q = _q_sym_legacy(x, 32)
    return np.concatenate([_f16_bytes(d), _pack_bits32(q >> 4), _pack_nibbles(q & 0xF)], axis=-1)


def _q_q5_1(x):
    d, m, q = _q_asym_legacy(x, 32)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(m), _pack_bits32(q >> 4), _pack_nibbles(q & 0xF)], axis=-1
    )


def _q_q8_0(x):
    d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    q = np.clip(_round_away(x * _safe_inv(d)), -127, 127).astype(np.int8)
    return np.concatenate([_f16_bytes(d[:, 0]), q.view(np.uint8)], axis=-1)


def _nearest_iq4_nl(v):
    """Index of the nearest `IQ4_NL_VALUES` entry (ties to the larger, as llama.cpp's `best_index_int8`)."""
    mids = (IQ4_NL_VALUES[1:] + IQ4_NL_VALUES[:-1]) / 2
    return np.searchsorted(mids, v, side="right")


def _q_iq4_nl(x, chunk: int = 1 << 15):
    """IQ4_NL: per block of 32, try the 15 inverse scales (k + values[0]) / max for k in -7..7
    (max: the entry of largest magnitude, sign kept), keep the one whose weighted least-squares
    scale d = <w q x> / <w q q> (w = x^2) fits best, then code every weight at 1/d: llama.cpp's
    search without an importance matrix. `chunk` blocks at a time bound the [blocks, 15, 32]
    temporaries (about 60 MiB each)."""
    if len(x) > chunk:
        return np.concatenate([_q_iq4_nl(x[i:i + chunk], chunk) for i in range(0, len(x), chunk)])
    mx = _signed_absmax(x)  # [N, 1]
    w = x * x
    ids = (np.arange(-7, 8, dtype=np.float32) + IQ4_NL_VALUES[0])[None, :, None] * _safe_inv(mx)[:, :, None]
    q = IQ4_NL_VALUES[_nearest_iq4_nl(ids * x[:, None, :])]  # [N, 15, 32]
    sumqx = (w[:, None, :] * q * x[:, None, :]).sum(-1)
    sumq2 = (w[:, None, :] * q * q).sum(-1)
    score = np.where(sumq2 > 0, sumqx * sumqx / np.where(sumq2 > 0, sumq2, 1), -1)
    best = score.argmax(-1)[:, None]
    d = np.take_along_axis(np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, 1), 0), best, -1)
    d16 = d.astype("<f2").astype(np.float32)  # the scale as stored
    codes = _nearest_iq4_nl(x * _safe_inv(d16))
    return np.concatenate([_f16_bytes(d16[:, 0]), _pack_nibbles(codes)], axis=-1)


def _fit_asym(x, nmax, w, rmin, rdelta, nstep):
    """Per row of x[M, S]: scale >= 0 and offset m >= 0 with x ~ scale * L - m, L in 0..nmax.

    Tries `nstep + 1` candidate inverse scales around nmax / (max - min), refits
    scale and offset by weighted least squares for each code assignment, and
    keeps the lowest weighted squared error.
    """
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    span = hi - lo
    flat = span <= 0
    span = np.where(flat, 1.0, span)
    best_scale = span / nmax
    best_min = lo.copy()
    L = np.clip(np.rint((x - lo[:, None]) / best_scale[:, None]), 0, nmax)
    best_err = (w * (best_scale[:, None] * L + best_min[:, None] - x) ** 2).sum(-1)
    sw, swx = w.sum(-1), (w * x).sum(-1)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / span
        L = np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
        sl, sl2, slx = (w * L).sum(-1), (w * L * L).sum(-1), (w * L * x).sum(-1)
        det = sw * sl2 - sl * sl
        ok = det > 0
        det = np.where(ok, det, 1.0)
        scale = (sw * slx - swx * sl) / det
        mn = (sl2 * swx - sl * slx) / det
        # The offset may not go above zero (codes start at the row minimum or at 0).
        pos = mn > 0
        scale = np.where(pos, slx / np.where(sl2 > 0, sl2, 1.0), scale)
        mn = np.where(pos, 0.0, mn)
        err = (w * (scale[:, None] * L + mn[:, None] - x) ** 2).sum(-1)
        better = ok & (err < best_err)
        best_scale = np.where(better, scale, best_scale)
        best_min = np.where(better, mn, best_min)
        best_err = np.where(better, err, best_err)
    best_scale = np.where(flat, 0.0, best_scale)
    best_min = np.where(flat, lo, best_min)
    return best_scale.astype(np.float32), (-best_min).astype(np.float32)


def _fit_sym(x, nmax):
    """Per row of x[M, S]: signed scale with x ~ scale * L, L in -nmax..nmax-1 (weights x^2)."""
    amax = _signed_absmax(x)[:, 0]
    zero = np.abs(amax) < 1e-30
    amax = np.where(zero, 1.0, amax)
    w = x * x
    best_scale = np.zeros(x.shape[0], np.float64)
    best_score = np.full(x.shape[0], -1.0)
    for step in range(-9, 10):
        iscale = -(nmax + 0.1 * step) / amax
        L = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1)
        slx, sl2 = (w * x * L).sum(-1), (w * L * L).sum(-1)
        ok = sl2 > 0
        sl2 = np.where(ok, sl2, 1.0)
        score = np.where(ok, slx * slx / sl2, -1.0)  # error reduction of the best scale for this L
        better = score > best_score
        best_scale = np.where(better, slx / sl2, best_scale)
        best_score = np.where(better, score, best_score)
    return np.where(zero, 0.0, best_scale).astype(np.float32)


def _quantize_scales(values, levels):
    """Non-negative f32[N, G] -> (codes i32[N, G] in 0..levels, step f32[N] as stored f16)."""
    top = values.max(axis=-1)
    inv = _safe_inv(top / levels)
    codes = np.clip(_nearest_int(values * inv[:, None]), 0, levels).astype(np.int32)
    step = (top / levels).astype(np.float16).astype(np.float32)
    return codes, step


def _asym_codes(x, d, sc, dmin, mn, nmax):
    """Final codes with the stored (rounded) scales: x[N, G, S] -> i32 in 0..nmax."""
    dd = d[:, None] * sc
    dm = dmin[:, None] * mn
    q = np.rint((x + dm[..., None]) * _safe_inv(dd)[..., None])
    return np.clip(q, 0, nmax).astype(np.int32)


def _sym_codes(x, d, sc, nmax):
    dd = d[:, None] * sc
    q = np.rint(x * _safe_inv(dd)[..., None])
    return (np.clip(q, -nmax, nmax - 1) + nmax).astype(np.int32)


def _pack_crumbs(L):
    """i[N, 256] in 0..3 -> u8[N, 64]: byte (h, l) holds weights h*128 + s*32 + l at bits 2s."""
    L = L.reshape(-1, 2, 4, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64).astype(np.uint8)


def _q_q2_k(x):
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    scale, mn = _fit_asym(xs.reshape(-1, 16), 3, np.abs(xs).reshape(-1, 16), -0.5, 0.1, 15)
    sc, d = _quantize_scales(scale.reshape(n, 16), 15)
    mc, dmin = _quantize_scales(mn.reshape(n, 16), 15)
    L = _asym_codes(xs, d, sc, dmin, mc, 3).reshape(n, QK_K)
    return np.concatenate(
        [(sc | (mc << 4)).astype(np.uint8), _pack_crumbs(L), _f16_bytes(d), _f16_bytes(dmin)], axis=-1
    )


def _signed_scale_codes(scale, levels):
    """Signed sub-block scales f32[N, G] -> (codes i32 in -levels..levels-1, step f32[N] as f16)."""
    top = _signed_absmax(scale)[:, 0]
    iscale = np.where(top == 0, 0.0, -levels / np.where(top == 0, 1.0, top))
    codes = np.clip(_nearest_int(iscale[:, None] * scale), -levels, levels - 1).astype(np.int32)
    step = _safe_inv(iscale).astype(np.float16).astype(np.float32)
    return codes, step


def _q_q3_k(x):
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    sc, d = _signed_scale_codes(_fit_sym(xs.reshape(-1, 16), 4).reshape(n, 16), 32)
    L = _sym_codes(xs, d, sc, 4).reshape(n, QK_K)  # 0..7, weight = L - 4
    hmask = np.zeros((n, 32), np.int32)
    for k in range(8):
        hmask |= (L[:, k * 32 : (k + 1) * 32] >> 2) << k
    u = sc + 32
    packed = np.zeros((n, 12), np.int32)
    for i in range(16):
        packed[:, i % 8] |= (u[:, i] & 0xF) << (4 * (i // 8))
        packed[:, 8 + i % 4] |= (u[:, i] >> 4) << (2 * (i // 4))
    return np.concatenate(
        [hmask.astype(np.uint8), _pack_crumbs(L & 3), packed.astype(np.uint8), _f16_bytes(d)], axis=-1
    )


def _q_k_asym(x, nmax):
    """Shared part of Q4_K/Q5_K: 8 sub-blocks of 32 -> (d, dmin, packed scales u8[N, 12], L)."""
    n = x.shape[0]
    xs = x.reshape(n, 8, 32)
    av = np.sqrt((xs * xs).mean(axis=-1, keepdims=True))
    w = (av + np.abs(xs)).reshape(-1, 32)
    scale, mn = _fit_asym(xs.reshape(-1, 32), nmax, w, -1.0, 0.1, 20)
    sc, d = _quantize_scales(scale.reshape(n, 8), 63)
    mc, dmin = _quantize_scales(mn.reshape(n, 8), 63)
    packed = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mc[:, :4] | ((mc[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((mc[:, 4:] & 0xF) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)
    L = _asym_codes(xs, d, sc, dmin, mc, nmax)
    return d, dmin, packed, L


def _pack_low_high(L):
    """i[N, 8, 32] in 0..15 -> u8[N, 128]: chunk c = sub-block 2c low | sub-block 2c+1 high."""
    return (L[:, 0::2] | (L[:, 1::2] << 4)).reshape(-1, 128).astype(np.uint8)


def _q_q4_k(x):
    d, dmin, packed, L = _q_k_asym(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, _pack_low_high(L)], axis=-1)


def _q_q5_k(x):
    d, dmin, packed, L = _q_k_asym(x, 31)
    qh = np.zeros((x.shape[0], 32), np.int32)
    for k in range(8):
        qh |= (L[:, k] >> 4) << k
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), packed, qh.astype(np.uint8), _pack_low_high(L & 0xF)], axis=-1
    )


def _q_q6_k(x):
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    sc, d = _signed_scale_codes(_fit_sym(xs.reshape(-1, 16), 32).reshape(n, 16), 128)
    sc = np.minimum(sc, 127)
    L = _sym_codes(xs, d, sc, 32).reshape(n, 2, 4, 32)  # 0..63, weight = L - 32
    lo = L & 0xF
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=-1)
    qh = sum(((L[:, :, s] >> 4) & 3) << (2 * s) for s in range(4))
    return np.concatenate(
        [
            ql.reshape(n, 128).astype(np.uint8),
            qh.reshape(n, 64).astype(np.uint8),
            sc.astype(np.int8).view(np.uint8),
            _f16_bytes(d),
        ],
        axis=-1,
    )


_QUANT = {
    T.Q4_0: _q_q4_0,
    T.Q4_1: _q_q4_1,
    T.Q5_0: _q_q5_0,
    T.Q5_1: _q_q5_1,
    T.Q8_0: _q_q8_0,
    T.IQ4_NL: _q_iq4_nl,
    T.Q2_K: _q_q2_k,
    T.Q3_K: _q_q3_k,
    T.Q4_K: _q_q4_k,
    T.Q5_K: _q_q5_k,
    T.Q6_K: _q_q6_k,
}


def _to_bf16_bits(x):
    """f32 -> u16 bf16 bits, round to nearest even, NaNs kept quiet (as llama.cpp)."""
    u = x.view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet = ((u >> 16) & 0xFFFF) | 0x40
    return np.where(nan, quiet, rounded).astype(np.uint16)


def quantize(x, qtype, *, name: str = "the weights x") -> np.ndarray:
    """Encode float rows to GGML raw bytes (numpy, offline).

    Args:
        x: f32[..., n] (numpy or jax); `n` a multiple of the type's block size.
        qtype: a supported type: `GGMLQuantizationType`, its value or name.
        name: how errors call `x` (e.g. the tensor's GGUF name).

    Returns:
        u8[..., n / block_size * type_size] little-endian blocks, decodable by
        `dequantize` and by `gguf.quants.dequantize` to the same values.

    Raises:
        ValueError: a row length that is not a whole number of blocks, NaN/inf in `x` for a
            block type (one would spread over its whole block), or finite values beyond the f16
            range for F16 and the block types (written as inf/NaN).

    Example:
        >>> raw = quantize(np.random.randn(8, 256).astype(np.float32), "Q4_K")
        >>> raw.shape
        (8, 144)
    """
    qt = resolve_qtype(qtype)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("quantize needs at least one axis (rows of weights), got a scalar")
    fmt = FORMATS[qt]
    lead, n = x.shape[:-1], x.shape[-1]
    if n % fmt.block_size:
        raise ValueError(f"row length {n} is not a multiple of the {qt.name} block size {fmt.block_size}")
    if qt == T.F32:
        return np.ascontiguousarray(x.astype("<f4")).view(np.uint8).reshape(*lead, 4 * n)
    if qt == T.BF16:
        bits = _to_bf16_bits(np.ascontiguousarray(x)).astype("<u2")
        return bits.view(np.uint8).reshape(*lead, 2 * n)
    check_f16_range(x, name, qt.name)
    if qt == T.F16:
        return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(*lead, 2 * n)
    check_finite(x, name)
    blocks = np.ascontiguousarray(x).reshape(-1, fmt.block_size)
    out = _QUANT[qt](blocks)
    assert out.shape == (blocks.shape[0], fmt.type_size) and out.dtype == np.uint8
    return out.reshape(*lead, n // fmt.block_size * fmt.type_size)
