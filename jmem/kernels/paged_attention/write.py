"""`write_pages`: scatter new keys/values into their page slots, quantizing when the pool is int8/fp8.

One XLA scatter per pool: on GPU and TPU it updates the pool in place when
the caller's jit donates the pool buffers (`donate_argnums`), so a step's
cost is the new tokens' bytes, not the pool's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jmem.kernels.paged_attention.checks import check_pages, concrete, is_quantized
from jmem.kernels.paged_attention.reference import quantize


@jax.jit
def _write(k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale):
    K, N, P, D = k_pages.shape
    slot = slot_mapping.astype(jnp.int32)
    valid = slot >= 0
    # Padding slots point one past the pool and are dropped by the scatter.
    page = jnp.where(valid, slot // P, N)
    off = jnp.where(valid, slot % P, 0)

    def put(pages, scale, new_TKD):
        x_KTD = new_TKD.transpose(1, 0, 2)
        if scale is not None:
            x_KTD = quantize(x_KTD, scale[:, jnp.minimum(page, N - 1)][:, :, None], pages.dtype)
        return pages.at[:, page, off].set(x_KTD.astype(pages.dtype), mode="drop")

    return put(k_pages, k_scale, k_new), put(v_pages, v_scale, v_new)


def write_pages(k_pages, v_pages, k_new, v_new, slot_mapping, *, k_scale=None, v_scale=None):
    """Writes new tokens' keys and values into the page pools.

    Args:
        k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] pools.
        k_new, v_new: [tokens, kv_heads, head_dim] new keys/values (any float dtype).
        slot_mapping: i32[tokens]; slot = page * page_size + offset. Negative
            slots are padding and are skipped. Two tokens with one slot: one wins.
        k_scale, v_scale: f32[kv_heads, num_pages] scales of int8/fp8 pools; a
            token is stored as round(x / scale[head, page]), saturated.

    Returns:
        (k_pages, v_pages) updated. Donate the pools in the caller's jit to
        update them in place.

    Example:
        >>> slots = block_tables[b, pos // page_size] * page_size + pos % page_size
        >>> k_pages, v_pages = write_pages(k_pages, v_pages, k_new, v_new, slots[None])
    """
    check_pages("write_pages", k_pages.shape[0], k_pages.shape[3], k_pages, v_pages, k_scale, v_scale)
    K, N, P, D = k_pages.shape
    if k_new.ndim != 3 or k_new.shape != v_new.shape or k_new.shape[1:] != (K, D):
        raise ValueError(
            f"write_pages: k_new and v_new must be [tokens, kv_heads={K}, head_dim={D}]; "
            f"got k_new {k_new.shape}, v_new {v_new.shape}"
        )
    if slot_mapping.shape != (k_new.shape[0],) or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"write_pages: slot_mapping must be int32[{k_new.shape[0]}]; got {slot_mapping.dtype}{list(slot_mapping.shape)}")
    slots = concrete(slot_mapping)
    if slots is not None and (slots >= N * P).any():
        bad = int(np.flatnonzero(slots >= N * P)[0])
        raise ValueError(
            f"write_pages: slot_mapping[{bad}]={int(slots[bad])} is past the pool's "
            f"{N} pages x page_size {P} = {N * P} slots"
        )
    if not is_quantized(k_pages.dtype):
        k_scale = v_scale = None
    return _write(k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale)


@functools.partial(jax.jit, static_argnames=("page_size",))
def slots_for(block_tables, positions, page_size: int):
    """Slot of each (sequence, position): block_tables[b, pos // page_size] * page_size + pos % page_size.

    Args:
        block_tables: i32[batch, pages_per_seq].
        positions: i32[batch, tokens]; negative positions give slot -1 (padding).
    """
    page = jnp.take_along_axis(block_tables, jnp.maximum(positions, 0) // page_size, axis=1)
    return jnp.where(positions >= 0, page * page_size + positions % page_size, -1)
