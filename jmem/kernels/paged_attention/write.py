"""Page writes: scatter new keys/values into their page slots, quantizing when the pool is int8/fp8.

`write_pages` quantizes with scales the caller fixes (for example calibrated
ones). `append_pages` keeps one scale per page per kv head that grows with
the page's content: the page's scale becomes max(scale, absmax(new) / qmax),
and when it grows the tokens already in the page are requantized to it, so a
page of small keys keeps its precision and a large key never saturates.
Only the pages written are touched: a decode step rewrites one page per
sequence. `page_scales` and `requantize_pages` are the two halves, for
callers (the serving cache) that gather the written pages themselves.

One XLA scatter per pool: on GPU and TPU it updates the pool in place when
the caller's jit donates the pool buffers (`donate_argnums`), so a step's
cost is the written bytes, not the pool's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jmem.checks import check_arrays, is_int
from jmem.kernels.paged_attention.checks import as_array, check_pages, concrete, is_quantized
from jmem.kernels.paged_attention.reference import qmax, quantize


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
        slot_mapping: i32[tokens] (an array or a list); slot = page * page_size +
            offset. Negative slots are padding and are skipped. Two tokens with one
            slot: one wins.
        k_scale, v_scale: f32[kv_heads, num_pages] scales of int8/fp8 pools; a
            token is stored as round(x / scale[head, page]), saturated. The
            pages written need finite scales > 0 (checked when concrete);
            `append_pages` grows scales that start at 0.

    Returns:
        (k_pages, v_pages) updated. Donate the pools in the caller's jit to
        update them in place.

    Example:
        >>> pos = jnp.arange(start, start + T)  # k_new, v_new: [T, kv_heads, head_dim] of sequence b
        >>> slots = block_tables[b, pos // page_size] * page_size + pos % page_size
        >>> k_pages, v_pages = write_pages(k_pages, v_pages, k_new, v_new, slots)
    """
    slot_mapping = as_array(slot_mapping)
    _check_write("write_pages", k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale)
    if not is_quantized(k_pages.dtype):
        k_scale = v_scale = None
    slots = concrete(slot_mapping)
    for sname, scale in (("k_scale", concrete(k_scale)), ("v_scale", concrete(v_scale))):
        if scale is not None and slots is not None:
            pages = np.unique(slots[slots >= 0] // k_pages.shape[2])
            bad = np.argwhere(~(scale[:, pages] > 0) | ~np.isfinite(scale[:, pages]))
            if len(bad):
                head, page = bad[0][0], pages[bad[0][1]]
                raise ValueError(f"write_pages: {sname}[{head}, {page}]={scale[head, page]} on a page written; "
                                 "accepted: finite scales > 0 (append_pages grows scales from 0 as tokens arrive)")
    return _write(k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale)


def _check_write(name, k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale):
    check_arrays(name, k_pages=k_pages, v_pages=v_pages, k_new=k_new, v_new=v_new, slot_mapping=slot_mapping)
    check_pages(name, k_pages.shape[0], k_pages.shape[3], k_pages, v_pages, k_scale, v_scale)
    K, N, P, D = k_pages.shape
    if k_new.ndim != 3 or k_new.shape != v_new.shape or k_new.shape[1:] != (K, D):
        raise ValueError(
            f"{name}: k_new and v_new must be [tokens, kv_heads={K}, head_dim={D}]; "
            f"got k_new {k_new.shape}, v_new {v_new.shape}"
        )
    if not (jnp.issubdtype(k_new.dtype, jnp.floating) and jnp.issubdtype(v_new.dtype, jnp.floating)):
        raise ValueError(f"{name}: k_new/v_new dtypes {k_new.dtype}/{v_new.dtype}; accepted: float arrays")
    if slot_mapping.shape != (k_new.shape[0],) or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"{name}: slot_mapping must be int32[{k_new.shape[0]}]; got {slot_mapping.dtype}{list(slot_mapping.shape)}")
    slots = concrete(slot_mapping)
    if slots is not None and (slots >= N * P).any():
        bad = int(np.flatnonzero(slots >= N * P)[0])
        raise ValueError(
            f"{name}: slot_mapping[{bad}]={int(slots[bad])} is past the pool's "
            f"{N} pages x page_size {P} = {N * P} slots"
        )


def page_scales(scale_KW, kept_W, new_TKD, row_T, dtype):
    """Scales of W pages after new tokens land in them.

    Args:
        scale_KW: f32[kv_heads, W] the pages' current scales.
        kept_W: i32[W] slots of each page whose old content stays (the first
            slot written now); 0 starts the page afresh: its old scale is dropped.
        new_TKD: [tokens, kv_heads, head_dim] new keys or values.
        row_T: i32[tokens] page (0..W-1) each token goes to; W or more: padding.
        dtype: the pool's dtype (int8 or float8_e4m3fn).

    Returns:
        f32[kv_heads, W]: max(old scale, absmax(new tokens of the page) * f32(1 / qmax)).
    """
    amax_TK = jnp.max(jnp.abs(new_TKD.astype(jnp.float32)), axis=-1)
    amax_KW = jnp.zeros_like(scale_KW).at[:, row_T].max(amax_TK.T, mode="drop")
    # Times the f32 reciprocal rather than divided by qmax: compilers may rewrite a division by a
    # constant into this product (XLA on CPU does), so spelling it out fixes the rounding.
    return jnp.maximum(jnp.where(kept_W > 0, scale_KW, 0.0), amax_KW * np.float32(1.0 / qmax(dtype)))


def requantize_pages(pages_KWPD, old_scale_KW, new_scale_KW, kept_W):
    """Old content of W quantized pages under their new scales.

    Slots below `kept_W` keep their values: unchanged bits where the scale did
    not grow, else dequantized with the old scale and rounded to the new one.
    Slots at or past `kept_W` are cleared (they are about to be written or
    hold a previous owner's tokens).

    Args:
        pages_KWPD: int8/fp8 [kv_heads, W, page_size, head_dim].
        old_scale_KW, new_scale_KW: f32[kv_heads, W] (new >= old where kept > 0).
        kept_W: i32[W].
    """
    P = pages_KWPD.shape[2]
    grew_KW = new_scale_KW > old_scale_KW
    x = pages_KWPD.astype(jnp.float32) * old_scale_KW[:, :, None, None]
    y = quantize(x, safe_scale(new_scale_KW)[:, :, None, None], pages_KWPD.dtype)
    out = jnp.where(grew_KW[:, :, None, None], y, pages_KWPD)
    kept_WP = jnp.arange(P)[None, :] < kept_W[:, None]
    return jnp.where(kept_WP[None, :, :, None], out, jnp.zeros((), pages_KWPD.dtype))


def safe_scale(scale):
    """A zero scale (an empty or all-zero page) divides as 1: its values quantize to 0 either way."""
    return jnp.where(scale > 0, scale, 1.0)


@jax.jit
def _append(k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping):
    K, N, P, D = k_pages.shape
    slot = slot_mapping.astype(jnp.int32)
    valid = slot >= 0
    page_T = jnp.where(valid, slot // P, N)  # N: dropped by every scatter below
    off_T = jnp.where(valid, slot % P, 0)
    # Pool-wide per-page facts (N ints and K*N floats: cheap), then only written pages' rows move.
    kept_N = jnp.full((N,), P, jnp.int32).at[page_T].min(off_T, mode="drop")
    read_T = jnp.minimum(page_T, N - 1)

    def put(pages, scale, new_TKD):
        new_scale = page_scales(scale, kept_N, new_TKD, page_T, pages.dtype)
        # One row per token: tokens sharing a page compute identical rows, so the
        # duplicate writes of the scatter agree.
        rows_KTPD = requantize_pages(pages[:, read_T], scale[:, read_T], new_scale[:, read_T], kept_N[read_T])
        pages = pages.at[:, page_T].set(rows_KTPD, mode="drop")
        x_KTD = quantize(new_TKD.transpose(1, 0, 2), safe_scale(new_scale[:, read_T])[:, :, None], pages.dtype)
        return pages.at[:, page_T, off_T].set(x_KTD, mode="drop"), new_scale

    k_pages, k_scale = put(k_pages, k_scale, k_new)
    v_pages, v_scale = put(v_pages, v_scale, v_new)
    return k_pages, v_pages, k_scale, v_scale


def append_pages(k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping):
    """Writes new tokens into pages whose per-page-per-head scales grow to fit them.

    Pages fill in order from slot 0, as a sequence's cache does. For each page
    written, with `first` its lowest slot written now: slots below `first`
    keep their tokens, the rest are cleared and the new tokens written; the
    scale becomes max(old scale, absmax(new tokens) / qmax) (int8: 127,
    fp8_e4m3: 448), and if it grew, slots below `first` are requantized to it.
    A write at slot 0 starts the page afresh (old scale dropped), so a reused
    page never inherits a stale scale; nothing needs resetting at allocation.
    Scales start at 0 (`jnp.zeros`). Float pools are written as by `write_pages`
    and their scales (None) returned as is.

    Args:
        k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] pools.
        k_scale, v_scale: f32[kv_heads, num_pages] for int8/float8_e4m3fn pools, else None.
        k_new, v_new: [tokens, kv_heads, head_dim] new keys/values (any float dtype).
        slot_mapping: i32[tokens] (an array or a list); slot = page * page_size +
            offset; negative slots are padding. Two tokens with one slot: one wins.

    Returns:
        (k_pages, v_pages, k_scale, v_scale) updated.

    Example:
        >>> k8 = jnp.zeros((K, N, P, D), jnp.int8); ks = jnp.zeros((K, N), jnp.float32)
        >>> k8, v8, ks, vs = append_pages(k8, v8, ks, vs, k_new, v_new, slots)
    """
    slot_mapping = as_array(slot_mapping)
    _check_write("append_pages", k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale)
    if not is_quantized(k_pages.dtype):
        return (*_write(k_pages, v_pages, k_new, v_new, slot_mapping, None, None), None, None)
    return _append(k_pages, v_pages, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), k_new, v_new,
                   slot_mapping)


@functools.partial(jax.jit, static_argnames=("page_size",))
def _slots_for(block_tables, positions, page_size: int):
    capacity = block_tables.shape[1] * page_size
    valid = (positions >= 0) & (positions < capacity)
    # Clipped so no gather index leaves the table; positions outside it are dropped below, so a
    # position past the table never lands in another sequence's page.
    index = jnp.clip(positions, 0, capacity - 1) // page_size
    page = jnp.take_along_axis(block_tables, index, axis=1)
    # A negative (unallocated) table entry gives padding, not a negative slot of some other meaning.
    return jnp.where(valid & (page >= 0), page * page_size + positions % page_size, -1)


def slots_for(block_tables, positions, page_size: int):
    """Slot of each (sequence, position): block_tables[b, pos // page_size] * page_size + pos % page_size.

    Args:
        block_tables: i32[batch, pages_per_seq]; a negative entry is an
            unallocated page.
        positions: i32[batch, tokens]; negative positions give slot -1 (padding),
            which `write_pages` skips. A position at or past the table's end
            (pages_per_seq * page_size), or one whose table entry is negative,
            raises when the arrays are concrete and gives -1 (dropped) when traced.
        page_size: tokens per page.

    Returns:
        i32[batch, tokens] slots, -1 for padding.

    Raises:
        ValueError: bad shapes or dtypes; a concrete position past the table or
            in an unallocated (negative) table entry.

    Example:
        >>> slots = slots_for(block_tables, positions, page_size=16)
        >>> k_pages, v_pages = write_pages(k_pages, v_pages, k_new, v_new, slots.reshape(-1))
    """
    block_tables, positions = as_array(block_tables), as_array(positions)
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"slots_for: page_size={page_size!r}; accepted: a positive integer")
    if block_tables.ndim != 2 or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"slots_for: block_tables must be int32[batch, pages_per_seq]; got {block_tables.dtype}{list(block_tables.shape)}")
    if positions.ndim != 2 or positions.shape[0] != block_tables.shape[0] or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(
            f"slots_for: positions must be int32[batch={block_tables.shape[0]}, tokens]; "
            f"got {positions.dtype}{list(positions.shape)}"
        )
    capacity = block_tables.shape[1] * int(page_size)
    pos = concrete(positions)
    if pos is not None and (pos >= capacity).any():
        b, t = (int(i[0]) for i in np.nonzero(pos >= capacity))
        raise ValueError(
            f"slots_for: positions[{b}, {t}]={int(pos[b, t])} is past the block table's "
            f"{block_tables.shape[1]} pages x page_size {page_size} = {capacity} positions; "
            "accepted: positions below that (negative ones are padding)"
        )
    table = concrete(block_tables)
    if pos is not None and table is not None and capacity:
        used = pos >= 0
        entry = np.take_along_axis(table, np.where(used, pos, 0) // page_size, axis=1)
        if (used & (entry < 0)).any():
            b, t = (int(i[0]) for i in np.nonzero(used & (entry < 0)))
            c = int(pos[b, t]) // page_size
            raise ValueError(
                f"slots_for: positions[{b}, {t}]={int(pos[b, t])} falls in block_tables[{b}, {c}]="
                f"{int(table[b, c])}, an unallocated page; accepted: table entries >= 0 for every "
                "position written (negative positions are padding)"
            )
    if capacity == 0:  # an empty table holds no position
        return jnp.full(positions.shape, -1, jnp.int32)
    return _slots_for(block_tables, positions, int(page_size))
