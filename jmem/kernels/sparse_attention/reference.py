"""Dense reference for block-sparse attention: materialize the mask, then plain attention."""

from __future__ import annotations

from jmem.kernels.flash_attention.reference import attention_reference
from jmem.kernels.masks import Mask


def sparse_attention_reference(q_BTHD, k_BSKD, v_BSKD, mask: Mask, *, sm_scale=None):
    """Attention with `mask.mask(q_len, kv_len)` as the only visibility rule; O(length^2) memory.

    Args:
        q_BTHD: [batch, q_len, q_heads, head_dim].
        k_BSKD, v_BSKD: [batch, kv_len, kv_heads, head_dim].
        mask: a `jmem.kernels.masks.Mask`.
        sm_scale: softmax scale; 1/sqrt(head_dim) when None.

    Example:
        >>> o = sparse_attention_reference(q, k, v, Causal() & LocalWindow(64))
    """
    mask_TS = mask.mask(q_BTHD.shape[1], k_BSKD.shape[1])
    return attention_reference(q_BTHD, k_BSKD, v_BSKD, causal=False, sm_scale=sm_scale, mask_TS=mask_TS)
