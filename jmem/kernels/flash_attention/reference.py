"""Plain-jnp attention: the reference for the flash and sparse kernels, and the CPU fallback.

It materializes the [q_len, kv_len] score matrix, so memory is O(length^2);
use it to check the kernels, not for long sequences.
"""

from __future__ import annotations

import jax.numpy as jnp


def attention_reference(q_BTHD, k_BSKD, v_BSKD, *, causal=True, sm_scale=None, mask_TS=None):
    """Grouped-query softmax attention with an optional dense mask; softmax in f32.

    Args:
        q_BTHD: queries [batch, q_len, q_heads, head_dim].
        k_BSKD, v_BSKD: keys/values [batch, kv_len, kv_heads, head_dim]; q_heads must be
            a multiple of kv_heads.
        causal: query i sees key j only when j <= i.
        sm_scale: softmax scale; 1/sqrt(head_dim) when None.
        mask_TS: optional bool[q_len, kv_len], True where query i may see key j
            (combined with `causal`). Rows that see no key give zeros.

    Returns:
        [batch, q_len, q_heads, head_dim] in q's dtype.

    Example:
        >>> o = attention_reference(q, k, v, causal=True)
    """
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    G = H // K
    scale = D**-0.5 if sm_scale is None else sm_scale
    q_BTKGD = q_BTHD.reshape(B, T, K, G, D)
    s_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32) * scale
    visible_TS = jnp.ones((T, S), bool)
    if causal:
        visible_TS &= jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]
    if mask_TS is not None:
        visible_TS &= jnp.asarray(mask_TS, bool)
    s_BKGTS = jnp.where(visible_TS, s_BKGTS, -jnp.inf)
    m = jnp.max(s_BKGTS, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s_BKGTS - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    o_BTKGD = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_BSKD.dtype), v_BSKD, preferred_element_type=jnp.float32)
    return o_BTKGD.reshape(B, T, H, D).astype(q_BTHD.dtype)
