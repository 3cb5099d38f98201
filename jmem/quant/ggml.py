"""llama.cpp (GGML) tensor formats: the block table and `dequantize` (encoders: `jmem.quant.ggml_quantize`).

Every GGML quantized type stores a row of `n` weights as `n / block_size`
blocks of `type_size` bytes each: small integer codes plus one or two f16
scales per block (K-quants add 6- or 8-bit sub-block scales). A tensor stored
[rows, n] in GGUF is therefore raw bytes `u8[rows, n / block_size * type_size]`,
which is what `gguf.GGUFReader` gives as `tensor.data` for quantized types.

`dequantize` is written in `jax.numpy` with no per-block Python loop, so it runs
inside a jitted step (the packed-weight matmul dequantizes on the fly and XLA
fuses it) and also accepts numpy input. Its arithmetic follows the order of
`gguf.quants.dequantize`, so the two agree bit for bit.

`jmem.quant.ggml_quantize.quantize` is the numpy encoder, used offline.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

from jmem.checks import is_int

QK_K = 256  # weights per K-quant super-block


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """Layout of one GGML type: `block_size` weights take `type_size` bytes."""

    qtype: T
    block_size: int
    type_size: int

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size


FORMATS: dict[T, BlockFormat] = {
    f.qtype: f
    for f in (
        BlockFormat(T.F32, 1, 4),
        BlockFormat(T.F16, 1, 2),
        BlockFormat(T.BF16, 1, 2),
        BlockFormat(T.Q4_0, 32, 2 + 16),
        BlockFormat(T.Q4_1, 32, 2 + 2 + 16),
        BlockFormat(T.Q5_0, 32, 2 + 4 + 16),
        BlockFormat(T.Q5_1, 32, 2 + 2 + 4 + 16),
        BlockFormat(T.Q8_0, 32, 2 + 32),
        BlockFormat(T.IQ4_NL, 32, 2 + 16),
        BlockFormat(T.Q2_K, QK_K, 16 + 64 + 2 + 2),
        BlockFormat(T.Q3_K, QK_K, 32 + 64 + 12 + 2),
        BlockFormat(T.Q4_K, QK_K, 2 + 2 + 12 + 128),
        BlockFormat(T.Q5_K, QK_K, 2 + 2 + 12 + 32 + 128),
        BlockFormat(T.Q6_K, QK_K, 128 + 64 + 16 + 2),
    )
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in FORMATS)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


class UnsupportedGGMLTypeError(ValueError):
    """A GGML tensor type this module does not read or write."""


def resolve_qtype(qtype) -> T:
    """`GGMLQuantizationType`, its int value or its name (any case) -> the enum member.

    Raises:
        UnsupportedGGMLTypeError: the type is unknown or not in `SUPPORTED_TYPES`.
    """
    try:  # a float or bool is no type id: int() would truncate 8.9 to Q8_0
        qt = T[qtype.upper()] if isinstance(qtype, str) else T(int(qtype)) if is_int(qtype) else None
    except (KeyError, ValueError):
        qt = None
    if qt not in FORMATS:
        shown = qt.name if qt is not None else repr(qtype)
        raise UnsupportedGGMLTypeError(
            f"unsupported GGML tensor type {shown}; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    return qt


# llama.cpp's substitutes for a k-quant whose 256-weight super-block does not divide a row.
K_FALLBACK: dict[T, T] = {T.Q2_K: T.IQ4_NL, T.Q3_K: T.IQ4_NL, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

# IQ4_NL's 16 levels (llama.cpp's `kvalues_iq4nl`): a non-uniform grid, denser near zero,
# that a block's one f16 scale multiplies.
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def fitting_qtype(qtype, row_length: int) -> T:
    """The type a row of `row_length` weights is stored in when `qtype` is asked, as llama.cpp does.

    `qtype` itself when its block divides the row; for a k-quant that does
    not fit, its `K_FALLBACK` substitute, or F16 when that does not fit
    either. Other types are returned as asked (`quantize` then refuses a row
    they do not divide).

    Example:
        >>> fitting_qtype("Q4_K", 576).name, fitting_qtype("Q6_K", 576).name, fitting_qtype("Q4_K", 512).name
        ('Q5_0', 'Q8_0', 'Q4_K')
    """
    qt = resolve_qtype(qtype)
    if row_length % FORMATS[qt].block_size == 0 or qt not in K_FALLBACK:
        return qt
    sub = K_FALLBACK[qt]
    return sub if row_length % FORMATS[sub].block_size == 0 else T.F16


def output_qtype(qtype, row_length: int) -> T:
    """The type llama.cpp's quantize gives the output head (the token embedding, when it is tied to the
    head) for a request of `qtype`: Q6_K, or Q8_0 when that is asked or when the row is not a multiple
    of a k-quant super-block (256), or F16 when not of Q8_0's block (32) either (as `fitting_qtype` falls
    back). Float types are kept.

    Example:
        >>> output_qtype("Q4_K", 576).name, output_qtype("Q4_0", 512).name, output_qtype("Q4_K", 72).name
        ('Q8_0', 'Q6_K', 'F16')
    """
    qt = resolve_qtype(qtype)
    if qt in FLOAT_TYPES or qt == T.Q8_0:  # as asked (a row Q8_0 does not divide is refused, named, later)
        return qt
    head = T.Q8_0 if row_length % QK_K else T.Q6_K
    return head if row_length % FORMATS[head].block_size == 0 else T.F16


def fallback_lines(qtype, chosen: dict[str, tuple[int, str]]) -> list[str]:
    """One line per substitution in `chosen` (tensor name -> (row length, type used)) for a request of
    `qtype`; the layers of a stacked name (`blk.3.attn_q.weight`) are shown once as `blk.*`."""
    asked = resolve_qtype(qtype).name
    groups: dict[tuple[int, str], list[str]] = {}
    for name, (n, used) in chosen.items():
        if used != asked:
            shown = re.sub(r"^blk\.\d+\.", "blk.*.", name)
            names = groups.setdefault((n, used), [])
            if shown not in names:
                names.append(shown)
    return [f"{asked}: row length {n} is not a multiple of its block size {FORMATS[T[asked]].block_size}; "
            f"stored as {used} (llama.cpp's fallback): {', '.join(names)}" for (n, used), names in groups.items()]


def block_format(qtype) -> BlockFormat:
    """The `BlockFormat` of a supported type (see `resolve_qtype` for accepted forms)."""
    return FORMATS[resolve_qtype(qtype)]


def row_bytes(n: int, qtype) -> int:
    """Bytes of one row of `n` weights; `n` must be a whole number of blocks."""
    fmt = block_format(qtype)
    if n % fmt.block_size:
        raise ValueError(f"row length {n} is not a multiple of the {fmt.name} block size {fmt.block_size}")
    return n // fmt.block_size * fmt.type_size


# ----------------------------------------------------------------------------- dequantize
# Each `_dq_*` maps u8[..., nb, type_size] -> f32[..., nb, block_size].


def _u16(b_lo, b_hi):
    return b_lo.astype(jnp.uint16) | (b_hi.astype(jnp.uint16) << 8)


def _f16(b, off):
    """The little-endian f16 at byte `off` of each block, as f32[..., 1]."""
    h = _u16(b[..., off], b[..., off + 1])
    return jax.lax.bitcast_convert_type(h, jnp.float16).astype(jnp.float32)[..., None]


def _u32(b, off):
    b = b[..., off : off + 4].astype(jnp.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _shifted(b, shifts, mask):
    """u8[..., g, n] -> i32[..., g, len(shifts), n]: `(b >> s) & mask` for each shift."""
    s = jnp.asarray(shifts, jnp.int32)[:, None]
    return (b.astype(jnp.int32)[..., None, :] >> s) & mask


def _nibbles(qs):
    """u8[..., 16] -> i32[..., 32]: low nibbles are weights 0..15, high ones 16..31."""
    return _shifted(qs, (0, 4), 0xF).reshape(*qs.shape[:-1], 2 * qs.shape[-1])


def _bits32(b, off):
    """The u32 high-bit mask at byte `off` -> i32[..., 32], bit j for weight j."""
    return ((_u32(b, off)[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.int32)


def _dq_q4_0(b):
    return _f16(b, 0) * (_nibbles(b[..., 2:18]) - 8).astype(jnp.float32)


def _dq_q4_1(b):
    return _f16(b, 0) * _nibbles(b[..., 4:20]).astype(jnp.float32) + _f16(b, 2)


def _dq_q5_0(b):
    q = _nibbles(b[..., 6:22]) | (_bits32(b, 2) << 4)
    return _f16(b, 0) * (q - 16).astype(jnp.float32)


def _dq_q5_1(b):
    q = _nibbles(b[..., 8:24]) | (_bits32(b, 4) << 4)
    return _f16(b, 0) * q.astype(jnp.float32) + _f16(b, 2)


def _dq_iq4_nl(b):
    return _f16(b, 0) * jnp.asarray(IQ4_NL_VALUES)[_nibbles(b[..., 2:18])]


def _dq_q8_0(b):
    q = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8)
    return q.astype(jnp.float32) * _f16(b, 0)


def _crumbs(qs):
    """u8[..., 64] of 2-bit codes -> i32[..., 256] (two halves of 128, shifts 0,2,4,6)."""
    lead = qs.shape[:-1]
    return _shifted(qs.reshape(*lead, 2, 32), (0, 2, 4, 6), 3).reshape(*lead, QK_K)


def _dq_q2_k(b):
    lead = b.shape[:-1]
    sc = b[..., 0:16].astype(jnp.int32)
    dl = (_f16(b, 80) * (sc & 0xF).astype(jnp.float32))[..., None]
    ml = (_f16(b, 82) * (sc >> 4).astype(jnp.float32))[..., None]
    q = _crumbs(b[..., 16:80]).reshape(*lead, 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(*lead, QK_K)


def _dq_q3_k(b):
    lead = b.shape[:-1]
    s = b[..., 96:108]
    low = _shifted(s[..., 0:8], (0, 4), 0xF).reshape(*lead, 16)
    high = _shifted(s[..., 8:12], (0, 2, 4, 6), 3).reshape(*lead, 16)
    scale = ((low | (high << 4)) - 32).astype(jnp.float32)
    dl = (_f16(b, 108) * scale)[..., None]
    hbit = _shifted(b[..., 0:32], tuple(range(8)), 1).reshape(*lead, QK_K)
    # A set high bit means "no offset"; a clear one subtracts 4.
    q = (_crumbs(b[..., 32:96]) - ((hbit ^ 1) << 2)).astype(jnp.float32)
    return (dl * q.reshape(*lead, 16, 16)).reshape(*lead, QK_K)


def _k_scale_min(s):
    """The 12 packed bytes of Q4_K/Q5_K -> (scale i32[..., 8], min i32[..., 8]), 6 bits each."""
    s = s.astype(jnp.int32)
    a, m, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([a & 63, (c & 0xF) | ((a >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 63, (c >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _dq_k_asym(b, q_sub):
    """Q4_K/Q5_K: d * scale * q - dmin * min per 32-weight sub-block."""
    lead = b.shape[:-1]
    sc, mn = _k_scale_min(b[..., 4:16])
    d = (_f16(b, 0) * sc.astype(jnp.float32))[..., None]
    dm = (_f16(b, 2) * mn.astype(jnp.float32))[..., None]
    return (d * q_sub.astype(jnp.float32) - dm).reshape(*lead, QK_K)


def _low_high_nibbles(qs):
    """u8[..., 128] -> i32[..., 8, 32]: 32-byte chunk c holds sub-blocks 2c (low) and 2c+1 (high)."""
    lead = qs.shape[:-1]
    return _shifted(qs.reshape(*lead, 4, 32), (0, 4), 0xF).reshape(*lead, 8, 32)


def _dq_q4_k(b):
    return _dq_k_asym(b, _low_high_nibbles(b[..., 16:144]))


def _dq_q5_k(b):
    lead = b.shape[:-1]
    qh = _shifted(b[..., 16:48], tuple(range(8)), 1).reshape(*lead, 8, 32)
    return _dq_k_asym(b, _low_high_nibbles(b[..., 48:176]) | (qh << 4))


def _dq_q6_k(b):
    lead = b.shape[:-1]
    ql = _shifted(b[..., 0:128].reshape(*lead, 2, 64), (0, 4), 0xF).reshape(*lead, 8, 32)
    qh = _shifted(b[..., 128:192].reshape(*lead, 2, 32), (0, 2, 4, 6), 3).reshape(*lead, 8, 32)
    q = ((ql | (qh << 4)) - 32).reshape(*lead, 16, 16).astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    d = (_f16(b, 208) * scale)[..., None]
    return (d * q).reshape(*lead, QK_K)


def _dq_f32(b):
    return jax.lax.bitcast_convert_type(_u32(b, 0), jnp.float32)[..., None]


def _dq_f16(b):
    return jax.lax.bitcast_convert_type(_u16(b[..., 0], b[..., 1]), jnp.float16).astype(jnp.float32)[..., None]


def _dq_bf16(b):
    bits = _u16(b[..., 0], b[..., 1]).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits, jnp.float32)[..., None]


_DEQUANT = {
    T.F32: _dq_f32,
    T.F16: _dq_f16,
    T.BF16: _dq_bf16,
    T.Q4_0: _dq_q4_0,
    T.Q4_1: _dq_q4_1,
    T.Q5_0: _dq_q5_0,
    T.Q5_1: _dq_q5_1,
    T.Q8_0: _dq_q8_0,
    T.IQ4_NL: _dq_iq4_nl,
    T.Q2_K: _dq_q2_k,
    T.Q3_K: _dq_q3_k,
    T.Q4_K: _dq_q4_k,
    T.Q5_K: _dq_q5_k,
    T.Q6_K: _dq_q6_k,
}


@functools.partial(jax.jit, static_argnums=1)
def _decode_rows(raw, qt: T):
    """u8[..., nb * type_size] -> f32[..., nb * block_size]; jitted so eager calls compile once."""
    fmt = FORMATS[qt]
    lead, nb = raw.shape[:-1], raw.shape[-1] // fmt.type_size
    return _DEQUANT[qt](raw.reshape(*lead, nb, fmt.type_size)).reshape(*lead, nb * fmt.block_size)


def dequantize(raw, qtype, shape=None) -> jax.Array:
    """Decode GGML rows of blocks to float32.

    Args:
        raw: u8[..., n_bytes], whole blocks per row (`gguf.GGUFReader`'s
            `tensor.data` for quantized types). For F32/F16/BF16 also the
            typed array (f32/f16) the reader gives. numpy or jax.
        qtype: a supported type: `GGMLQuantizationType`, its value or name.
        shape: optional shape to reshape the result to (same element count).

    Returns:
        f32[..., n_bytes / type_size * block_size] (or `shape`).

    Example:
        >>> from jmem.quant.ggml_quantize import quantize
        >>> raw = quantize(np.ones((4, 64), np.float32), "Q4_0")  # u8[4, 36]
        >>> dequantize(raw, "Q4_0").shape
        (4, 64)
    """
    qt = resolve_qtype(qtype)
    raw = jnp.asarray(raw)
    fmt = FORMATS[qt]
    if qt in FLOAT_TYPES and raw.dtype != jnp.uint8:
        out = raw.astype(jnp.float32)  # the typed array GGUFReader gives for F32/F16
    elif raw.dtype != jnp.uint8:
        raise ValueError(f"{qt.name} data must be uint8 raw blocks, got dtype {raw.dtype}")
    elif raw.ndim == 0 or raw.shape[-1] % fmt.type_size:
        n_bytes = raw.shape[-1] if raw.ndim else 0
        raise ValueError(
            f"{qt.name} row of {n_bytes} bytes is not a whole number of {fmt.type_size}-byte blocks"
        )
    else:
        out = _decode_rows(raw, qt)
    if shape is not None:
        try:
            out = out.reshape(tuple(shape))
        except TypeError:  # jax's reshape message names neither the type nor the decoded size
            raise ValueError(f"shape={list(shape)} does not fit the {out.size} values the {qt.name} data decodes "
                             f"to; accepted: a shape of {out.size} values (one -1 may stand for an axis)") from None
    return out
