"""Decode rows of a ragged step: one query per sequence over its paged keys, split into chunks (plain jnp).

A sequence that computes one token this step (a decode, or a prefill chunk of
one token) does not need a query tile of its own: its query attends to

- the complete pages before the page it writes, cut into chunks of
  `DECODE_CHUNK_KEYS` keys; each chunk gives a partial softmax (max, sum,
  weighted values), as in split-KV ("flash-decoding") kernels, and
- the page it writes, as it stands after this step's write (built by the
  caller: for float pages the gathered page with the new token in its slot,
  for int8/fp8 pages the rewritten page with its grown scale).

The partials are merged per row by their log-sum-exp. The chunks list only the
pages sequences actually hold, so the keys read follow the real context
lengths rather than the longest sequence of the step, and each query row
costs one row of work, not a tile's. On a CPU this is what decode throughput
depends on: a batch of decodes is bound by reading its keys and values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DECODE_CHUNK_KEYS = 64  # keys per chunk of a decode row's complete pages


def chunk_pages(page_size: int) -> int:
    """Pages per decode chunk."""
    return max(1, DECODE_CHUNK_KEYS // page_size)


def dequantize(x, scale, dtype):
    """x * scale in `dtype`; `scale` covers x's leading axes (per page, or per slot) and broadcasts over the rest."""
    if scale is None:
        return x.astype(dtype)
    scale = scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim))
    return (x.astype(jnp.float32) * scale).astype(dtype)


def _partial(q_KNGD, k_KNCD, v_KNCD, visible_NC, sm_scale, stale_values: bool = False):
    """Softmax partials of queries [K, N, G, D] over keys [K, N, C, D] where visible: (max, sum, weighted V).

    `stale_values`: invisible slots may hold anything (a reused page's stale slots, inf included): their
    values are zeroed, since 0 * inf is NaN. Complete pages and the spare page hold written, finite values.

    Shapes for XLA's CPU backend, which the decode path serves: with G (a few)
    query rows per batch, scores [K, N, C, G] (keys leading) run faster than
    [K, N, G, C], and the weighted sum of values as a broadcast product
    reduced over keys (one fused loop) faster than a batched matmul.
    """
    s = jnp.einsum("kncd,kngd->kncg", k_KNCD, q_KNGD, preferred_element_type=jnp.float32) * sm_scale
    s = jnp.where(visible_NC[None, :, :, None], s, -jnp.inf)
    m_KNG = jnp.max(s, axis=2)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m_KNG), m_KNG, 0.0)[:, :, None])
    l_KNG = jnp.sum(p, axis=2)
    if stale_values:
        v_KNCD = jnp.where(visible_NC[None, :, :, None], v_KNCD, 0)
    o_KNGD = jnp.sum(p[..., None] * v_KNCD[:, :, :, None, :].astype(jnp.float32), axis=2)
    return m_KNG, l_KNG, o_KNGD


def decode_attention(q_RKGD, k_pages_KPSD, v_pages_KPSD, k_scale, v_scale, cur_k, cur_v, layout, sm_scale):
    """Attention of the decode rows of a step.

    Args:
        q_RKGD: each decode row's query [rows, kv_heads, group, head_dim].
        k_pages_KPSD, v_pages_KPSD: one layer's pages [kv_heads, pages, page_size, head_dim].
        k_scale, v_scale: int8/fp8 scales per page f32 [kv_heads, pages] (or per slot
            [kv_heads, pages, page_size]); None for float pages.
        cur_k, cur_v: (page [kv_heads, rows, page_size, head_dim], its scale [kv_heads, rows] or
            [kv_heads, rows, page_size] or None): the page each row writes, after the write.
        layout: the step's `StepLayout` (`dec_*` fields).
        sm_scale: softmax scale.

    Returns:
        f32 [rows, kv_heads, group, head_dim].
    """
    R, K, G, D = q_RKGD.shape
    Nc, Mc = layout.dec_chunk_pages.shape
    S = k_pages_KPSD.shape[2]
    dtype = q_RKGD.dtype
    q_KRGD = jnp.swapaxes(q_RKGD, 0, 1)

    # Chunks of complete pages, each with its row's query.
    q_pad = jnp.concatenate([q_KRGD, jnp.zeros((K, 1, G, D), dtype)], axis=1)
    q_KNGD = q_pad[:, layout.dec_chunk_row]

    def gather(pages, scales):
        x = pages[:, layout.dec_chunk_pages]
        s = None if scales is None else scales[:, layout.dec_chunk_pages]
        return dequantize(x, s, dtype).reshape(K, Nc, Mc * S, D)

    visible = jnp.arange(Mc * S)[None, :] < layout.dec_chunk_len[:, None]
    m_c, l_c, o_c = _partial(q_KNGD, gather(k_pages_KPSD, k_scale), gather(v_pages_KPSD, v_scale), visible, sm_scale)

    # The page each row writes, up to and including the row's own token.
    visible_cur = jnp.arange(S)[None, :] <= (layout.dec_pos % S)[:, None]
    m_r, l_r, o_r = _partial(q_KRGD, dequantize(*cur_k, dtype), dequantize(*cur_v, dtype), visible_cur, sm_scale,
                             stale_values=True)

    # Each row's chunk partials and its page's, merged by their log-sum-exp as split-KV kernels merge
    # their splits. Chunks reach their row by segment reductions (padding chunks, row Rd, drop out), so
    # the step's shape does not depend on how many chunks one row has.
    row = layout.dec_chunk_row
    m_c, l_c, o_c = (jnp.moveaxis(x, 0, 1) for x in (m_c, l_c, o_c))  # [Nc, K, G(, D)]
    m_r, l_r, o_r = (jnp.moveaxis(x, 0, 1) for x in (m_r, l_r, o_r))  # [R, K, G(, D)]
    m = jnp.maximum(jax.ops.segment_max(m_c, row, num_segments=R), m_r)  # finite: a row sees its own token
    w_c = jnp.exp(m_c - jnp.concatenate([m, jnp.zeros_like(m[:1])])[row])
    w_r = jnp.exp(m_r - m)
    den = jax.ops.segment_sum(w_c * l_c, row, num_segments=R) + w_r * l_r
    o = jax.ops.segment_sum(w_c[..., None] * o_c, row, num_segments=R) + w_r[..., None] * o_r
    return o / den[..., None]
