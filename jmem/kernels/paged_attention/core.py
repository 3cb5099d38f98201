"""Pallas bodies shared by paged decode and ragged attention.

Both kernels reduce to "work items": item w owns a block of R query rows
(`q_NKRD[w // q_div]`, for every kv head), a window [lo, hi) of its
sequence's tokens, and the pages that cover the window (`item_tables`,
relative to token `lo`). For causal items, row r sits at position
`pos0 + r // gp` and sees keys at or before it. Each item returns the
unnormalised flash accumulators (o = sum p v, m = running max, l = sum p), so
decode can split a long context over several items and combine them after.

Two bodies behind one call: Triton (GPU) gathers the item's pages from the
whole pool inside the kernel; Mosaic (TPU) scalar-prefetches the tables and
lets BlockSpec index maps fetch one page per spec, `pages_per_block` specs per
grid step, so Pallas pipelines the page DMAs. Keys past `hi` re-use the last
needed page's block index, which Pallas does not fetch again.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jmem.checks import check_bool
from jmem.kernels.paged_attention.checks import is_quantized

BACKENDS = ("triton", "mosaic")
META = 4  # per-item ints: lo, hi, pos0, unused (a power of two for Triton)


def default_backend() -> str:
    """Kernel body for the platform being compiled for (`jmem.kernels.dispatch.target_platform`):
    Mosaic on TPU, Triton on GPU, Mosaic (interpreted) on CPU."""
    from jmem.kernels.dispatch import target_platform

    return "triton" if target_platform() == "gpu" else "mosaic"


def resolve(fn: str, backend, interpret):
    """(backend, interpret) of a call of `fn`, defaults filled in from the platform compiled for."""
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend={backend!r}; accepted: None (the platform's), "
                         f"{', '.join(map(repr, BACKENDS))} (GPU: 'triton', TPU: 'mosaic')")
    if interpret is None:
        from jmem.kernels.dispatch import target_platform

        interpret = target_platform() == "cpu"
    check_bool("interpret", interpret)
    return backend, interpret


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_fits(page_size: int, head_dim: int) -> bool:
    """Whether the Triton (GPU) kernels compile for these sizes: only power-of-two tiles do."""
    return _power_of_two(page_size) and _power_of_two(head_dim)


def check_backend_shapes(name: str, backend: str, interpret: bool, page_size: int, head_dim: int):
    """Triton compiles only power-of-two tiles: the page size and head_dim must be powers of two."""
    if backend == "triton" and not interpret:
        for what, n in (("page_size", page_size), ("head_dim", head_dim)):
            if not _power_of_two(n):
                raise ValueError(f"{name}: the Triton (GPU) kernel needs a power-of-two {what}; got {n}")


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _dot_nt(a, b, precision):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _dot(a, b, precision):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _online_update(s, valid, m_prev, l_prev, acc_prev):
    """One flash step: masked scores s [R, bk] -> (p, alpha, m, l); acc scaled by alpha."""
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    # A row with no visible key yet keeps m=-inf; exponentiate against 0 so it stays exactly 0.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    return p, m_new, alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True), alpha * acc_prev


def _triton_kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, *rest, ppb, causal, gp_log2, sm_scale, quant, precision):
    # meta_ref [META]; bt_ref [pages of this item]; q_ref [R, D];
    # k_ref/v_ref [num_pages, page_size, D]; (ks_ref/vs_ref [num_pages]);
    # o_ref [R, D]; m_ref/l_ref [R]
    if quant:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    lo, hi, pos0 = meta_ref[0], meta_ref[1], meta_ref[2]
    R, D = q_ref.shape
    page = k_ref.shape[1]
    bk = ppb * page
    q = q_ref[...]
    cdt = q.dtype
    row_pos = pos0 + jax.lax.shift_right_logical(jnp.arange(R, dtype=jnp.int32), jnp.int32(gp_log2))

    def body(i, carry):
        acc, m, l = carry
        idx = bt_ref[pl.ds(i * ppb, ppb)]
        k = k_ref[idx].reshape(bk, D).astype(cdt)
        s = _dot_nt(q, k, precision) * sm_scale
        if quant:
            s = s * jnp.broadcast_to(ks_ref[idx][:, None], (ppb, page)).reshape(1, bk)
        key = lo + i * bk + jnp.arange(bk, dtype=jnp.int32)
        # Slots past the length may hold a reused page's stale values: a weight of 0 times inf is NaN.
        v = jnp.where((key < hi)[:, None], v_ref[idx].reshape(bk, D).astype(cdt), 0)
        valid = (key < hi)[None, :]
        if causal:
            valid = valid & (key[None, :] <= row_pos[:, None])
        p, m, l, acc = _online_update(s, valid, m, l, acc)
        if quant:
            p = p * jnp.broadcast_to(vs_ref[idx][:, None], (ppb, page)).reshape(1, bk)
        return acc + _dot(p.astype(cdt), v, precision), m, l

    n = pl.cdiv(jnp.maximum(hi - lo, 0), bk)
    init = (jnp.zeros((R, D), jnp.float32), jnp.full((R, 1), -jnp.inf, jnp.float32), jnp.zeros((R, 1), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n, body, init)
    o_ref[...] = acc
    m_ref[...] = m.reshape(R)
    l_ref[...] = l.reshape(R)


def _mosaic_kernel(meta_ref, bt_ref, q_ref, *refs, ppb, nbp, causal, gp_log2, sm_scale, quant, precision):
    # meta_ref SMEM [W*META]; bt_ref SMEM [W*nbp]; q_ref [R, D];
    # refs: ppb k pages [page, D], ppb v pages [page, D], (ppb k scales [1, 1], ppb v scales [1, 1]),
    # then o_ref [R, D] f32, m_ref/l_ref [R, 1] f32, resident across the last grid axis.
    del bt_ref, nbp
    k_refs, v_refs = refs[:ppb], refs[ppb : 2 * ppb]
    ks_refs = refs[2 * ppb : 3 * ppb] if quant else None
    vs_refs = refs[3 * ppb : 4 * ppb] if quant else None
    o_ref, m_ref, l_ref = refs[-3:]
    w, i = pl.program_id(0), pl.program_id(2)
    lo, hi, pos0 = meta_ref[w * META], meta_ref[w * META + 1], meta_ref[w * META + 2]
    R, D = q_ref.shape
    page = k_refs[0].shape[0]
    start = lo + i * (ppb * page)

    @pl.when(i == 0)
    def _init():
        o_ref[...] = jnp.zeros_like(o_ref)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros_like(l_ref)

    @pl.when(start < hi)
    def _step():
        q = q_ref[...]
        cdt = q.dtype
        col = jax.lax.broadcasted_iota(jnp.int32, (R, page), 1)
        row_pos = pos0 + jax.lax.shift_right_logical(jax.lax.broadcasted_iota(jnp.int32, (R, page), 0), jnp.int32(gp_log2))
        s_list = []
        for j in range(ppb):
            s = _dot_nt(q, k_refs[j][...].astype(cdt), precision) * sm_scale
            if quant:
                s = s * ks_refs[j][...]
            key = start + j * page + col
            valid = key < hi
            if causal:
                valid = valid & (key <= row_pos)
            s_list.append(jnp.where(valid, s, -jnp.inf))
        m_prev = m_ref[...]
        m_cur = functools.reduce(jnp.maximum, [jnp.max(s, axis=1, keepdims=True) for s in s_list])
        m_new = jnp.maximum(m_prev, m_cur)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_safe)
        acc = o_ref[...] * alpha
        l = l_ref[...] * alpha
        slot = jax.lax.broadcasted_iota(jnp.int32, (page, D), 0)
        for j in range(ppb):
            p = jnp.exp(s_list[j] - m_safe)
            l = l + jnp.sum(p, axis=1, keepdims=True)
            if quant:
                p = p * vs_refs[j][...]
            # Slots past the length may hold a reused page's stale values: a weight of 0 times inf is NaN.
            v = jnp.where(start + j * page + slot < hi, v_refs[j][...].astype(cdt), 0)
            acc = acc + _dot(p.astype(cdt), v, precision)
        o_ref[...] = acc
        m_ref[...] = m_new
        l_ref[...] = l


def attend_items(
    q_NKRD, k_pages, v_pages, k_scale, v_scale, item_tables_WP, meta_WM, *,
    q_div, gp, causal, pages_per_block, sm_scale, backend, interpret, num_warps=4, num_stages=2,
):
    """Runs the work items; returns unnormalised (o f32[W,K,R,D], m f32[W,K,R], l f32[W,K,R]).

    Args:
        q_NKRD: query rows, [N, kv_heads, R, head_dim]; item w reads block w // q_div.
        item_tables_WP: i32[W, P] physical page of each of the item's pages,
            starting at token lo; P a multiple of pages_per_block; entries must
            lie in the pool (the callers clamp them).
        meta_WM: i32[W, META] (lo, hi, pos0, 0); lo a multiple of the block tokens.
        gp: query rows per token (power of two), for causal row positions.
    """
    N, K, R, D = q_NKRD.shape
    W, P = item_tables_WP.shape
    _, num_pages, page, _ = k_pages.shape
    ppb = pages_per_block
    nb = P // ppb
    quant = is_quantized(k_pages.dtype)
    precision = jax.lax.Precision.HIGHEST if q_NKRD.dtype == jnp.float32 else None
    kw = dict(causal=causal, gp_log2=int(math.log2(gp)), sm_scale=float(sm_scale), quant=quant, precision=precision)
    out_shape = [
        jax.ShapeDtypeStruct((W, K, R, D), jnp.float32),
        jax.ShapeDtypeStruct((W, K, R) if backend == "triton" else (W, K, R, 1), jnp.float32),
        jax.ShapeDtypeStruct((W, K, R) if backend == "triton" else (W, K, R, 1), jnp.float32),
    ]
    if backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        pool = pl.BlockSpec((None, num_pages, page, D), lambda w, h: (h, 0, 0, 0))
        scale = pl.BlockSpec((None, num_pages), lambda w, h: (h, 0))
        in_specs = [
            pl.BlockSpec((None, META), lambda w, h: (w, 0)),
            pl.BlockSpec((None, P), lambda w, h: (w, 0)),
            pl.BlockSpec((None, None, R, D), lambda w, h: (w // q_div, h, 0, 0)),
            pool,
            pool,
        ] + ([scale, scale] if quant else [])
        args = [meta_WM, item_tables_WP, q_NKRD, k_pages, v_pages] + ([k_scale, v_scale] if quant else [])
        o, m, l = pl.pallas_call(
            functools.partial(_triton_kernel, ppb=ppb, **kw),
            grid=(W, K),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, R, D), lambda w, h: (w, h, 0, 0)),
                pl.BlockSpec((None, None, R), lambda w, h: (w, h, 0)),
                pl.BlockSpec((None, None, R), lambda w, h: (w, h, 0)),
            ],
            out_shape=out_shape,
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="paged_attention_triton",
        )(*args)
        return o, m, l

    from jax.experimental.pallas import tpu as pltpu

    def page_map(j):
        def index_map(w, h, i, meta, bt):
            lo, hi = meta[w * META], meta[w * META + 1]
            last = jnp.maximum((hi - lo + page - 1) // page - 1, 0)
            return (h, bt[w * P + jnp.minimum(i * ppb + j, last)], 0, 0)

        return index_map

    page_specs = [pl.BlockSpec((None, None, page, D), page_map(j)) for j in range(ppb)]
    in_specs = [pl.BlockSpec((None, None, R, D), lambda w, h, i, meta, bt: (w // q_div, h, 0, 0))]
    in_specs += page_specs + page_specs
    args = [q_NKRD] + [k_pages] * ppb + [v_pages] * ppb
    if quant:
        scale_specs = [pl.BlockSpec((None, None, 1, 1), page_map(j)) for j in range(ppb)]
        in_specs += scale_specs + scale_specs
        args += [k_scale.reshape(K, num_pages, 1, 1)] * ppb + [v_scale.reshape(K, num_pages, 1, 1)] * ppb
    row_spec = pl.BlockSpec((None, None, R, 1), lambda w, h, i, meta, bt: (w, h, 0, 0))
    o, m, l = pl.pallas_call(
        functools.partial(_mosaic_kernel, ppb=ppb, nbp=P, **kw),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(W, K, nb),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, None, R, D), lambda w, h, i, meta, bt: (w, h, 0, 0)), row_spec, row_spec],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_attention_mosaic",
    )(meta_WM.reshape(-1), item_tables_WP.reshape(-1), *args)
    return o, m[..., 0], l[..., 0]


def combine_splits(o_BSKRD, m_BSKR, l_BSKR):
    """Merges per-split flash accumulators into normalised outputs [B, K, R, D] (f32)."""
    m_max = jnp.max(m_BSKR, axis=1, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m_BSKR - m_max)
    den = jnp.sum(w * l_BSKR, axis=1)
    o = jnp.sum(w[..., None] * o_BSKRD, axis=1)
    return o / jnp.where(den == 0, 1.0, den)[..., None]
