"""Ragged paged attention: prefill chunks and decode tokens of many sequences in one call.

The query tokens of all sequences arrive concatenated (`cu_q_lens` prefix
sums). Each sequence's tokens are cut into blocks of `block_q` tokens that
start at the sequence's first token, so a block never mixes sequences; every
block is one work item of the shared kernel, with causal row positions. The
number of blocks is bounded statically by cdiv(total_tokens, block_q) +
max_seqs, so one compiled kernel serves every mix of prefill and decode with
the same padded shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jmem.kernels.flash_attention.kernel import check_float
from jmem.kernels.paged_attention import core
from jmem.checks import check_arrays, is_int
from jmem.kernels.paged_attention.checks import as_array, check_pages, check_pow2, check_tables, concrete
from jmem.kernels.paged_attention.kernel import default_pages_per_block, sanitize_tables
from jmem.kernels.paged_attention.reference import live_cu_q_lens
from jmem.kernels.scale import split_scale

BLOCK_Q = 16  # query tokens per work item


def _work_items(cu_q_lens, kv_lens, num_seqs, total_tokens, bq, max_seqs):
    """Per-item (seq, first token, first position, token count) and each token's item slot."""
    s = jnp.arange(max_seqs)
    live = s < num_seqs
    q_len = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    n_items = (q_len + bq - 1) // bq
    first_item = jnp.cumsum(n_items) - n_items
    W = -(-total_tokens // bq) + max_seqs
    w = jnp.arange(W)
    seq_W = jnp.clip(jnp.searchsorted(jnp.cumsum(n_items), w, side="right"), 0, max_seqs - 1)
    j_W = w - first_item[seq_W]
    valid_W = w < jnp.sum(n_items)
    count_W = jnp.where(valid_W, jnp.clip(q_len[seq_W] - j_W * bq, 0, bq), 0)
    tok0_W = cu_q_lens[seq_W] + j_W * bq
    pos0_W = kv_lens[seq_W] - q_len[seq_W] + j_W * bq
    hi_W = jnp.where(valid_W, jnp.clip(pos0_W + count_W, 0, kv_lens[seq_W]), 0)
    # Each real token's slot in the padded [W * bq] layout.
    t = jnp.arange(total_tokens)
    seq_T = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, max_seqs - 1)
    real_T = t < cu_q_lens[jnp.minimum(num_seqs, max_seqs)]
    off_T = t - cu_q_lens[seq_T]
    slot_T = (first_item[seq_T] + off_T // bq) * bq + off_T % bq
    return seq_W, tok0_W, count_W, pos0_W, hi_W, jnp.where(real_T, slot_T, -1)


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_block", "block_q", "backend", "interpret"))
def _ragged(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, k_scale, v_scale, *, sm_scale, pages_per_block, block_q, backend, interpret):
    T, H, D = q.shape
    K, N, page, _ = k_pages.shape
    G = H // K
    gp = core.next_pow2(G)
    bq = max(block_q, 16 // gp)
    R = bq * gp
    S_max, npages = block_tables.shape
    ppb = pages_per_block
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, npages * page)
    cu_q_lens = live_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
    seq_W, tok0_W, count_W, pos0_W, hi_W, slot_T = _work_items(cu_q_lens, kv_lens, num_seqs, T, bq, S_max)
    W = seq_W.shape[0]
    nbp = -(-npages // ppb) * ppb
    tables = jnp.pad(sanitize_tables(block_tables, kv_lens, page, N), ((0, 0), (0, nbp - npages)))[seq_W]
    zeros = jnp.zeros_like(hi_W)
    meta = jnp.stack([zeros, hi_W, pos0_W, zeros], -1).astype(jnp.int32)
    # Gather the query tokens into [W, K, bq * gp, D] rows (row = token * gp + group member).
    t_WB = tok0_W[:, None] + jnp.arange(bq)[None, :]
    in_W = jnp.arange(bq)[None, :] < count_W[:, None]
    q_WBHD = jnp.where(in_W[:, :, None, None], q[jnp.clip(t_WB, 0, T - 1)], 0).astype(q.dtype)
    q_WKBGD = q_WBHD.reshape(W, bq, K, G, D).transpose(0, 2, 1, 3, 4)
    q_WKRD = jnp.pad(q_WKBGD, ((0, 0),) * 3 + ((0, gp - G), (0, 0))).reshape(W, K, R, D)
    o, m, l = core.attend_items(
        q_WKRD, k_pages, v_pages, k_scale, v_scale, tables, meta,
        q_div=1, gp=gp, causal=True, pages_per_block=ppb, sm_scale=sm_scale, backend=backend, interpret=interpret,
    )
    o = core.combine_splits(o[:, None], m[:, None], l[:, None])  # one split: just o / l
    o_TsHD = o.reshape(W, K, bq, gp, D)[:, :, :, :G].transpose(0, 2, 1, 3, 4).reshape(W * bq, H, D)
    out = jnp.where((slot_T >= 0)[:, None, None], o_TsHD[jnp.maximum(slot_T, 0)], 0.0)
    return out.astype(q.dtype)


def _check_ragged(q, kv_lens, block_tables, cu_q_lens, num_seqs, num_pages: int, page_size: int, scales: dict):
    """Shapes and dtypes always; with concrete values, num_seqs, cu_q_lens, kv_lens and the tables."""
    name = "ragged_paged_attention"
    if block_tables.ndim != 2:
        raise ValueError(f"{name}: block_tables must be int32[max_seqs, pages_per_seq]; got {block_tables.shape}")
    S_max = block_tables.shape[0]
    for what, x, size, label in (("cu_q_lens", cu_q_lens, S_max + 1, "max_seqs + 1"),
                                 ("kv_lens", kv_lens, S_max, "max_seqs")):
        if x.shape != (size,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}: {what} must be int32[{label}] = [{size}] for block_tables {block_tables.shape}; "
                             f"got {x.dtype}{list(x.shape)}")
    if not (is_int(num_seqs) or (getattr(num_seqs, "ndim", None) == 0 and jnp.issubdtype(num_seqs.dtype, jnp.integer))):
        raise ValueError(f"{name}: num_seqs={num_seqs!r}; accepted: an integer or an integer scalar array")
    cu, n, kl = concrete(cu_q_lens), concrete(num_seqs), concrete(kv_lens)
    if n is not None and not 0 <= int(n) <= S_max:
        raise ValueError(f"{name}: num_seqs={int(n)} outside [0, max_seqs={S_max}]")
    # Rows past num_seqs may hold anything: their lengths are not checked.
    live = kv_lens if n is None or kl is None else np.where(np.arange(S_max) < int(n), kl, 0)
    check_tables(name, live, block_tables, num_pages, page_size, rows=None, lengths_name="kv_lens", scales=scales)
    if n is None or cu is None:
        return
    n = int(n)
    q_len = np.diff(cu[: n + 1])
    if cu[0] != 0 or (q_len < 0).any() or cu[n] > q.shape[0]:
        raise ValueError(
            f"{name}: cu_q_lens[:num_seqs+1]={cu[: n + 1].tolist()} must start at 0, "
            f"not decrease, and end at most at total_tokens={q.shape[0]}"
        )
    if kl is not None and (q_len > kl[:n]).any():
        bad = int(np.flatnonzero(q_len > kl[:n])[0])
        raise ValueError(f"{name}: sequence {bad} has q_len={int(q_len[bad])} > kv_len={int(kl[bad])}")


def ragged_paged_attention(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *,
    k_scale=None, v_scale=None, sm_scale=None, pages_per_compute_block=None, block_q=BLOCK_Q, backend=None, interpret=None,
):
    """Attention for a mixed batch of prefill chunks and decode tokens over paged K/V.
    For inference: it has no gradient (train with flash_attention).

    Sequence s owns query tokens cu_q_lens[s]:cu_q_lens[s+1] of `q`; they are
    its last q_len tokens, so token i of the chunk sits at position
    kv_len - q_len + i and sees keys at or before it (causal inside the
    chunk, everything before it). Write the new keys/values into the pages
    (`write_pages`) before calling this.

    Args:
        q: [total_tokens, q_heads, head_dim]; tokens past cu_q_lens[num_seqs] are padding.
        k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] (float, or int8/fp8 with scales).
        kv_lens: i32[max_seqs] context length of each sequence, new tokens included.
        block_tables: i32[max_seqs, pages_per_seq].
        cu_q_lens: i32[max_seqs + 1] prefix sums of query lengths, cu_q_lens[0] = 0;
            only the first num_seqs + 1 entries are read (the rest may hold anything).
        num_seqs: int or i32 scalar: sequences in use.
        k_scale, v_scale: f32[kv_heads, num_pages] for int8/fp8 pages.
        sm_scale: softmax scale, 1/sqrt(head_dim) when None; a concrete or traced scalar.
        pages_per_compute_block: pages per kernel step (power of two); ~128 keys when None.
        block_q: query tokens per work item.
        backend, interpret: as in `paged_attention`.

    Returns:
        [total_tokens, q_heads, head_dim] in q's dtype; zeros for padding tokens.

    Example:
        >>> # a 5-token prefill chunk and two decode tokens
        >>> cu = jnp.array([0, 5, 6, 7], jnp.int32)
        >>> o = ragged_paged_attention(q, k_pages, v_pages, kv_lens, tables, cu, 3)
    """
    check_arrays("ragged_paged_attention", q=q)
    if q.ndim != 3:
        raise ValueError(f"ragged_paged_attention: q must be [total_tokens, q_heads, head_dim]; got {q.shape}")
    T, H, D = q.shape
    check_float("ragged_paged_attention", q=q)
    check_pages("ragged_paged_attention", H, D, k_pages, v_pages, k_scale, v_scale)
    K, N, page, _ = k_pages.shape
    kv_lens, block_tables, cu_q_lens = as_array(kv_lens), as_array(block_tables), as_array(cu_q_lens)
    _check_ragged(q, kv_lens, block_tables, cu_q_lens, num_seqs, N, page, {"k_scale": k_scale, "v_scale": v_scale})
    backend, interpret = core.resolve("ragged_paged_attention", backend, interpret)
    core.check_backend_shapes("ragged_paged_attention", backend, interpret, page, D)
    ppb = default_pages_per_block(page, block_tables.shape[1]) if pages_per_compute_block is None \
        else pages_per_compute_block
    check_pow2("ragged_paged_attention", "pages_per_compute_block", ppb)
    check_pow2("ragged_paged_attention", "block_q", block_q)
    q, scale = split_scale("ragged_paged_attention", q, sm_scale, D)
    if T == 0:  # no query tokens: nothing to attend (the kernel grid would be empty)
        return jnp.zeros(q.shape, q.dtype)
    return _ragged(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, jnp.asarray(num_seqs, jnp.int32), k_scale, v_scale,
        sm_scale=scale, pages_per_block=ppb, block_q=block_q, backend=backend, interpret=interpret,
    )
