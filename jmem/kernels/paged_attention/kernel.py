"""Paged decode attention: one query token per sequence over paged K/V.

Flash-decoding: each sequence's pages are split into `num_splits` windows
that run as separate work items (more parallel programs when the batch is
small and the context long); their partial softmax accumulators are merged
after the kernel. Grouped-query heads share one kv head's pages, so each
kernel program reads a page once for all `q_heads // kv_heads` queries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jmem.kernels.paged_attention import core
from jmem.kernels.flash_attention.kernel import check_float
from jmem.checks import check_arrays, is_int
from jmem.kernels.paged_attention.checks import as_array, check_pages, check_pow2, check_tables
from jmem.kernels.scale import split_scale

# Programs to keep a GPU busy (about 2 per SM on an H100/H200); decode splits
# the context until batch x kv_heads x splits reaches it.
GPU_TARGET_PROGRAMS = 256
BLOCK_TOKENS = 128  # keys per kernel step, unless pages_per_compute_block is given


def default_pages_per_block(page_size: int, pages_per_seq: int) -> int:
    return max(1, min(core.next_pow2(BLOCK_TOKENS // page_size) if page_size < BLOCK_TOKENS else 1, core.next_pow2(pages_per_seq)))


def default_splits(batch: int, kv_heads: int, num_blocks: int, backend: str) -> int:
    target = GPU_TARGET_PROGRAMS if backend == "triton" else 2
    return max(1, min(num_blocks, -(-target // max(1, batch * kv_heads))))


def sanitize_tables(block_tables, lengths, page_size: int, num_pages: int):
    """Entries past each row's length -> page 0, and all entries clamped into the pool.

    Under jit bad values cannot raise; clamping keeps the kernel's reads inside
    the pool (the concrete-value checks have already rejected bad input).
    """
    used = jnp.arange(block_tables.shape[1])[None, :] < (lengths[:, None] + page_size - 1) // page_size
    return jnp.clip(jnp.where(used, block_tables, 0), 0, num_pages - 1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_block", "num_splits", "backend", "interpret"))
def _paged_attention(q, k_pages, v_pages, lengths, block_tables, k_scale, v_scale, *, sm_scale, pages_per_block, num_splits, backend, interpret):
    B, H, D = q.shape
    K, N, page, _ = k_pages.shape
    G = H // K
    R = max(16, core.next_pow2(G))
    ppb = pages_per_block
    npages = block_tables.shape[1]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, npages * page)
    tables = sanitize_tables(block_tables, lengths, page, N)
    nb_total = -(-npages // ppb)
    S = num_splits
    nbp = -(-nb_total // S) * ppb  # pages per split
    tables = jnp.pad(tables, ((0, 0), (0, S * nbp - npages)))
    split_tokens = nbp * page
    lo_S = jnp.arange(S, dtype=jnp.int32) * split_tokens
    hi_BS = jnp.clip(lengths[:, None], lo_S[None, :], lo_S[None, :] + split_tokens)
    meta = jnp.stack([jnp.broadcast_to(lo_S, (B, S)), hi_BS, jnp.zeros((B, S), jnp.int32), jnp.zeros((B, S), jnp.int32)], -1)
    q_BKRD = jnp.pad(q.reshape(B, K, G, D), ((0, 0), (0, 0), (0, R - G), (0, 0)))
    o, m, l = core.attend_items(
        q_BKRD, k_pages, v_pages, k_scale, v_scale, tables.reshape(B * S, nbp), meta.reshape(B * S, core.META),
        q_div=S, gp=R, causal=False, pages_per_block=ppb, sm_scale=sm_scale, backend=backend, interpret=interpret,
    )
    o = core.combine_splits(o.reshape(B, S, K, R, D), m.reshape(B, S, K, R), l.reshape(B, S, K, R))
    return o[:, :, :G].reshape(B, H, D).astype(q.dtype)


def paged_attention(
    q, k_pages, v_pages, lengths, block_tables, *, k_scale=None, v_scale=None, sm_scale=None,
    pages_per_compute_block=None, num_splits=None, backend=None, interpret=None,
):
    """Decode attention of one new token per sequence against its paged K/V cache.
    For inference: it has no gradient (train with flash_attention).

    Args:
        q: [batch, q_heads, head_dim], a floating dtype (f32, bf16 or f16).
        k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], float, or
            int8 / float8_e4m3fn with scales; q_heads a multiple of kv_heads.
        lengths: i32[batch] keys visible to each sequence (0 gives zeros).
        block_tables: i32[batch, pages_per_seq]; row b's i-th page holds tokens
            [i * page_size, (i + 1) * page_size) of sequence b. Entries past
            cdiv(length, page_size) are ignored. Both may be arrays or lists.
        k_scale, v_scale: f32[kv_heads, num_pages] per-page-per-head scales
            (required for, and only for, int8/fp8 pages).
        sm_scale: softmax scale, 1/sqrt(head_dim) when None; a Python/NumPy/JAX
            scalar, or a traced one (folded into q: `jmem.kernels.scale`).
        pages_per_compute_block: pages per kernel step (a power of two);
            about 128 keys when None.
        num_splits: context windows per sequence whose partial softmaxes are
            merged after the kernel (flash-decoding); chosen from the batch
            and the device when None.
        backend: "triton" (GPU) or "mosaic" (TPU); from the default device when None.
        interpret: run the kernel in the Pallas interpreter; True on CPU when None.

    Returns:
        [batch, q_heads, head_dim] in q's dtype.

    Raises:
        ValueError: mismatched shapes or heads; with concrete inputs also a
            length past the table's pages, a used table entry outside the pool,
            or a scale of a page read that is negative or not finite.

    Example:
        >>> o = paged_attention(q, k_pages, v_pages, lengths, block_tables)
    """
    check_arrays("paged_attention", q=q)
    if q.ndim != 3:
        raise ValueError(f"paged_attention: q must be [batch, q_heads, head_dim]; got {q.shape}")
    B, H, D = q.shape
    check_float("paged_attention", q=q)
    check_pages("paged_attention", H, D, k_pages, v_pages, k_scale, v_scale)
    K, N, page, _ = k_pages.shape
    lengths, block_tables = as_array(lengths), as_array(block_tables)
    check_tables("paged_attention", lengths, block_tables, N, page, rows=B,
                 scales={"k_scale": k_scale, "v_scale": v_scale})
    backend, interpret = core.resolve("paged_attention", backend, interpret)
    core.check_backend_shapes("paged_attention", backend, interpret, page, D)
    npages = block_tables.shape[1]
    ppb = default_pages_per_block(page, npages) if pages_per_compute_block is None else pages_per_compute_block
    check_pow2("paged_attention", "pages_per_compute_block", ppb)
    nb_total = -(-npages // ppb)
    splits = default_splits(B, K, nb_total, backend) if num_splits is None else num_splits
    if not is_int(splits) or not 1 <= splits <= nb_total:
        raise ValueError(f"paged_attention: num_splits={splits!r}; accepted: an integer in [1, {nb_total}] "
                         f"({npages} pages / {ppb} per block)")
    q, scale = split_scale("paged_attention", q, sm_scale, D)
    if B == 0:  # an empty batch: nothing to attend (the kernel grid would be empty)
        return jnp.zeros(q.shape, q.dtype)
    return _paged_attention(
        q, k_pages, v_pages, lengths, block_tables, k_scale, v_scale,
        sm_scale=scale, pages_per_block=ppb, num_splits=splits, backend=backend, interpret=interpret,
    )
