"""Plain-jnp attention: the reference for the flash and sparse kernels, and the CPU fallback.

It materializes the [q_len, kv_len] score matrix, so memory is O(length^2);
use it to check the kernels, not for long sequences.
"""

from __future__ import annotations


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
    from jmem.kernels.dispatch import xla_attention

    return xla_attention(q_BTHD, k_BSKD, v_BSKD, causal=causal, sm_scale=sm_scale, mask_TS=mask_TS)
