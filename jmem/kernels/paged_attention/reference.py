"""Plain-jnp references for the paged kernels; also their CPU fallback.

Pages are `[kv_heads, num_pages, page_size, head_dim]`. Quantized pages
(int8, float8_e4m3fn) carry one f32 scale per page per kv head:
value = page.astype(f32) * scale[head, page].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmem.kernels.paged_attention.checks import QUANT_DTYPES

INT8_MAX = 127.0
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def qmax(dtype) -> float:
    """Largest magnitude representable by a quantized page dtype."""
    return INT8_MAX if jnp.dtype(dtype) == jnp.dtype(jnp.int8) else FP8_MAX


def quantize(x, scale, dtype):
    """Rounds `x / scale` into `dtype` (int8 or float8_e4m3fn), saturating."""
    m = qmax(dtype)
    y = jnp.clip(x.astype(jnp.float32) / scale, -m, m)
    if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
        y = jnp.round(y)
    return y.astype(dtype)


def quantize_pages(pages_KNPD, dtype):
    """Quantizes float pages with a per-page-per-head absmax scale.

    Args:
        pages_KNPD: float [kv_heads, num_pages, page_size, head_dim].
        dtype: jnp.int8 or jnp.float8_e4m3fn.

    Returns:
        (pages in `dtype`, scale f32[kv_heads, num_pages]).

    Example:
        >>> k8, k_scale = quantize_pages(k_pages, jnp.int8)
    """
    try:
        given = jnp.dtype(dtype) if dtype is not None else None  # (None would read as float64)
    except TypeError:  # not a dtype at all ("foo")
        given = None
    if given not in QUANT_DTYPES:
        shown = repr(dtype) if given is None else given
        raise ValueError(f"quantize_pages: dtype={shown}; accepted: int8, float8_e4m3fn")
    amax_KN = jnp.max(jnp.abs(pages_KNPD.astype(jnp.float32)), axis=(2, 3))
    scale_KN = jnp.where(amax_KN > 0, amax_KN / qmax(dtype), 1.0)
    return quantize(pages_KNPD, scale_KN[:, :, None, None], dtype), scale_KN


def dequantize_pages(pages_KNPD, scale_KN=None):
    """Pages as f32, times their per-page-per-head scale when given."""
    x = pages_KNPD.astype(jnp.float32)
    return x if scale_KN is None else x * scale_KN[:, :, None, None]


def gather_kv(pages_KNPD, scale_KN, block_tables_BP):
    """Contiguous f32 keys or values [batch, pages_per_seq * page_size, kv_heads, head_dim]."""
    K, _, P, D = pages_KNPD.shape
    B, npages = block_tables_BP.shape
    x_KBnPD = dequantize_pages(pages_KNPD, scale_KN)[:, block_tables_BP]
    return x_KBnPD.reshape(K, B, npages * P, D).transpose(1, 2, 0, 3)


def _softmax_attend(q_TKGD, k_SKD, v_SKD, mask_TS, sm_scale):
    s = jnp.einsum("tkgd,skd->tkgs", q_TKGD.astype(jnp.float32), k_SKD, precision="highest") * sm_scale
    s = jnp.where(mask_TS[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)  # rows with no visible key give zeros
    # A key no row sees (a slot past the length) may hold stale values: 0 weight times inf is NaN.
    v_SKD = jnp.where(jnp.any(mask_TS, axis=0)[:, None, None], v_SKD, 0)
    return jnp.einsum("tkgs,skd->tkgd", p, v_SKD, precision="highest")


def paged_attention_reference(q, k_pages, v_pages, lengths, block_tables, *, k_scale=None, v_scale=None, sm_scale=None):
    """Decode attention over paged K/V, one query token per sequence.

    Args:
        q: [batch, q_heads, head_dim].
        k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim].
        lengths: i32[batch] keys visible to each sequence.
        block_tables: i32[batch, pages_per_seq] page of each sequence's i-th block.
        k_scale, v_scale: f32[kv_heads, num_pages] for int8/fp8 pages.
        sm_scale: softmax scale, 1/sqrt(head_dim) when None.

    Returns:
        [batch, q_heads, head_dim] in q's dtype; zeros for length-0 rows.
    """
    B, H, D = q.shape
    K = k_pages.shape[0]
    scale = D**-0.5 if sm_scale is None else sm_scale
    k_BSKD = gather_kv(k_pages, k_scale, block_tables)
    v_BSKD = gather_kv(v_pages, v_scale, block_tables)
    mask_BS = jnp.arange(k_BSKD.shape[1])[None, :] < lengths[:, None]
    q_BKGD = q.reshape(B, K, H // K, D)
    o = jax.vmap(lambda q1, k1, v1, m1: _softmax_attend(q1[None], k1, v1, m1[None], scale)[0])(q_BKGD, k_BSKD, v_BSKD, mask_BS)
    return o.reshape(B, H, D).astype(q.dtype)


def live_cu_q_lens(cu_q_lens, num_seqs):
    """`cu_q_lens` with every entry past `num_seqs` set to cu_q_lens[num_seqs].

    Only the first num_seqs + 1 entries describe the step; callers may pad the
    rest with anything (zeros, repeats). Repeating the last live entry makes
    the array non-decreasing, so searches over it find the right sequence.
    """
    cu_q_lens = jnp.asarray(cu_q_lens)
    n = jnp.clip(jnp.asarray(num_seqs, jnp.int32), 0, cu_q_lens.shape[0] - 1)
    return jnp.where(jnp.arange(cu_q_lens.shape[0]) <= n, cu_q_lens, cu_q_lens[n])


def token_positions(cu_q_lens, kv_lens, num_seqs, total_tokens):
    """Sequence id and absolute position of every concatenated query token.

    Token t of sequence s (cu_q_lens[s] <= t < cu_q_lens[s+1]) sits at
    position kv_lens[s] - q_len[s] + (t - cu_q_lens[s]). Tokens at or past
    cu_q_lens[num_seqs] are padding: seq id -1. Entries of cu_q_lens past
    num_seqs are ignored.
    """
    cu_q_lens = live_cu_q_lens(cu_q_lens, num_seqs)
    t = jnp.arange(total_tokens)
    seq_T = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid_T = (t < cu_q_lens[num_seqs]) & (seq_T < num_seqs)
    seq_T = jnp.where(valid_T, seq_T, -1)
    s = jnp.maximum(seq_T, 0)
    q_len = cu_q_lens[s + 1] - cu_q_lens[s]
    pos_T = kv_lens[s] - q_len + (t - cu_q_lens[s])
    return seq_T, pos_T


def ragged_paged_attention_reference(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, k_scale=None, v_scale=None, sm_scale=None
):
    """Mixed prefill + decode attention over paged K/V, causal inside each chunk.

    Memory is O(total_tokens x max_seqs x context): a reference and small-batch
    CPU fallback, not a serving path.

    Args:
        q: [total_tokens, q_heads, head_dim], the sequences' new tokens concatenated.
        k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], already
            holding the new tokens' keys/values.
        kv_lens: i32[max_seqs] context length of each sequence (new tokens included).
        block_tables: i32[max_seqs, pages_per_seq].
        cu_q_lens: i32[max_seqs + 1] prefix sums of the query lengths; only the
            first num_seqs + 1 entries are read.
        num_seqs: i32 scalar (or int): sequences in use; later rows are ignored.
        k_scale, v_scale: f32[kv_heads, num_pages] for int8/fp8 pages.
        sm_scale: softmax scale, 1/sqrt(head_dim) when None.

    Returns:
        [total_tokens, q_heads, head_dim]; padding tokens give zeros.
    """
    T, H, D = q.shape
    K = k_pages.shape[0]
    scale = D**-0.5 if sm_scale is None else sm_scale
    k_BSKD = gather_kv(k_pages, k_scale, block_tables)
    v_BSKD = gather_kv(v_pages, v_scale, block_tables)
    B, S = k_BSKD.shape[:2]
    seq_T, pos_T = token_positions(cu_q_lens, kv_lens, num_seqs, T)
    key_seq = jnp.repeat(jnp.arange(B), S)
    key_pos = jnp.tile(jnp.arange(S), B)
    mask_TS = (
        (key_seq[None, :] == seq_T[:, None])
        & (key_pos[None, :] <= pos_T[:, None])
        & (key_pos[None, :] < kv_lens[key_seq][None, :])
    )
    o = _softmax_attend(q.reshape(T, K, H // K, D), k_BSKD.reshape(B * S, K, D), v_BSKD.reshape(B * S, K, D), mask_TS, scale)
    return o.reshape(T, H, D).astype(q.dtype)


def write_pages_reference(k_pages, v_pages, k_new, v_new, slot_mapping, *, k_scale=None, v_scale=None):
    """Token-by-token loop writing new keys/values into their page slots.

    Args:
        k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim].
        k_new, v_new: [tokens, kv_heads, head_dim].
        slot_mapping: i32[tokens]; slot = page * page_size + offset; negative
            slots are padding and are skipped.
        k_scale, v_scale: f32[kv_heads, num_pages] for int8/fp8 pages.

    Returns:
        (k_pages, v_pages) with the tokens written.
    """
    K, N, P, D = k_pages.shape

    def put(pages, scale, new_TKD, t, slot):
        page, off = slot // P, slot % P
        x_KD = new_TKD[t].astype(jnp.float32)
        if scale is not None:
            x_KD = quantize(x_KD, scale[:, page][:, None], pages.dtype)
        row = jax.lax.dynamic_update_slice(pages, x_KD.astype(pages.dtype)[:, None, None, :], (0, page, off, 0))
        return jnp.where(slot >= 0, row, pages)

    def body(t, carry):
        kp, vp = carry
        slot = slot_mapping[t]
        return put(kp, k_scale, k_new, t, slot), put(vp, v_scale, v_new, t, slot)

    return jax.lax.fori_loop(0, slot_mapping.shape[0], body, (k_pages, v_pages))
