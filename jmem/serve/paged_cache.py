"""`PagedKVCache`: the model's KV-cache protocol over a paged pool, for a ragged batch of sequences.

Pages are `[layers, kv_heads, num_pages, page_size, head_dim]`; a sequence's
pages are listed in its block table. One step feeds the model a flat (ragged)
run of tokens from many sequences (`ids [1, T]`): each token writes its K/V to
`(write_page, write_offset)` and attends to its own sequence's cached keys up
to its position.

How a step's tokens are laid out (query tiles for prefill chunks, decode rows
for single tokens) is `jmem.serve.step_layout`; the host builds each step's
`StepLayout` there and the model's dense layers run on the unpadded flat tokens.

KV dtypes: the compute dtype, bf16, or fp8_e4m3 / int8 pages with one f32
scale per page per kv head (`k_scale`, `v_scale` f32[layers, kv_heads, pages],
beside the pages). Scales are maintained as tokens are written
(`jmem.kernels.paged_attention.write`): each step gathers the pages its tokens
land in (the layout lists them: a decode touches one page per sequence), sets each
page's scale to max(scale, absmax(new tokens) / qmax), requantizes the page's
earlier tokens when the scale grew, and writes the new tokens. A write at a
page's slot 0 starts it afresh (scale 0), so a reused page never inherits a
stale scale, and a prefix-cached page, full and never written again, keeps
its scale for every request that shares it. The attention of the step reads
these rewritten pages, so it sees exactly what later steps read back.

Budget: the scales cost 2 * layers * kv_heads * 4 bytes per page, counted in
`kv_bytes_per_token(..., page_size)`; fp8 still holds about twice the tokens
of bf16 (99.6% of twice for SmolLM2 at page size 16).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jmem.checks import check_int
from jmem.kernels.dispatch import masked_softmax
from jmem.kernels.paged_attention.checks import is_quantized
from jmem.kernels.paged_attention.core import triton_fits
from jmem.kernels.paged_attention.reference import quantize as quantize_with_scale
from jmem.kernels.paged_attention.write import page_scales, requantize_pages, safe_scale
from jmem.serve.paged_decode import decode_attention, dequantize
from jmem.serve.step_layout import TILE, StepLayout

KV_DTYPES = ("auto", "bf16", "fp8_e4m3", "int8")
ATTENTION_IMPLS = ("auto", "tiled", "kernel")
_FP8_MAX = 448.0
_SCALE_BYTES = 4  # one f32 per page per kv head, for K and for V


def kv_storage_dtype(kv_dtype: str, compute_dtype):
    """Storage dtype for a `--kv-cache-dtype` name."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
    from jmem.models.config import as_dtype

    return {"auto": jnp.dtype(as_dtype(compute_dtype)), "bf16": jnp.dtype(jnp.bfloat16),
            "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn), "int8": jnp.dtype(jnp.int8)}[kv_dtype]


def kv_bytes_per_token(config, kv_dtype: str, page_size: int | None = None) -> int:
    """Bytes of K and V one token occupies across all layers.

    Args:
        config: the model config (n_layers, n_kv_heads, head_dim, compute_dtype).
        kv_dtype: auto | bf16 | fp8_e4m3 | int8.
        page_size: tokens per page. Given, int8/fp8 pages' per-page scales
            (2 * n_layers * n_kv_heads f32 per page) are included, spread over the
            page's tokens and rounded up; None: the K/V values alone.

    Example:
        >>> per_block = kv_bytes_per_token(config, "fp8_e4m3", 16) * 16
    """
    dtype = kv_storage_dtype(kv_dtype, config.compute_dtype)
    values = 2 * config.n_layers * config.n_kv_heads * config.head_dim * dtype.itemsize
    if page_size is not None:
        check_int("page_size", page_size, 1)
    if page_size is None or not is_quantized(dtype):
        return values
    scales_per_page = 2 * config.n_layers * config.n_kv_heads * _SCALE_BYTES
    return values + -(-scales_per_page // page_size)


def quantize(x, dtype):
    """Per-slot quantization: x [..., D] -> (stored [..., D] in `dtype`, f32 scale [...] or None).

    int8 gets an absmax scale per slot and fp8 a plain cast; the serving cache
    uses per-page scales instead (`PagedKVCache`). Kept for callers of
    `tiled_paged_attention` with per-slot scales.
    """
    if dtype == jnp.int8:
        scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / 127.0
        scale = jnp.where(scale == 0, 1.0, scale)
        q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127).astype(jnp.int8)
        return q, scale
    if dtype == jnp.float8_e4m3fn:
        return jnp.clip(x.astype(jnp.float32), -_FP8_MAX, _FP8_MAX).astype(dtype), None
    return x.astype(dtype), None


def tiled_paged_attention(q_THD, k_pages_KPSD, v_pages_KPSD, k_scale, v_scale, layout: StepLayout, sm_scale=None,
                          new_kv=None, new_pages=None):
    """Ragged attention over paged K/V (plain jnp; the CPU path).

    Args:
        q_THD: queries of the flat tokens [T, q_heads, head_dim].
        k_pages_KPSD, v_pages_KPSD: one layer's pages [kv_heads, pages, page_size, head_dim].
        k_scale, v_scale: for int8/fp8 pages, f32 [kv_heads, pages] (per page) or
            [kv_heads, pages, page_size] (per slot); else None.
        layout: see `StepLayout`.
        new_kv: optional (k, v) [kv_heads, T, head_dim] of this step's tokens, not yet in the
            pages: they are laid over the gathered keys (`layout.tile_new_src`), so the pool
            is written once after all layers instead of copied per layer.
        new_pages: optional (k_rows, v_rows, k_row_scale, v_row_scale), the pages this step
            writes ([kv_heads, W, page_size, head_dim] and f32 [kv_heads, W], rows as in
            `layout.upd_pages`), laid over the gathered pages in place of `new_kv`.

    Returns:
        [T, q_heads, head_dim] in q's dtype.
    """
    T, H, D = q_THD.shape
    K, _, S, _ = k_pages_KPSD.shape
    G = H // K
    N, M = layout.tile_pages.shape
    scale = sm_scale if sm_scale is not None else D**-0.5
    q_pad = jnp.concatenate([q_THD, jnp.zeros((1, H, D), q_THD.dtype)])
    q_NRKGD = q_pad[layout.tile_tokens].reshape(N, TILE, K, G, D)

    def gather(pages, scales, new_KTD, rows=None, row_scale=None):
        x_KNMSD = pages[:, layout.tile_pages]
        s = None if scales is None else scales[:, layout.tile_pages]
        if rows is not None:
            hit = layout.tile_upd < rows.shape[1]
            rows = jnp.concatenate([rows, jnp.zeros_like(rows[:, :1])], axis=1)[:, layout.tile_upd]
            x_KNMSD = jnp.where(hit[None, :, :, None, None], rows, x_KNMSD)
            row_scale = jnp.concatenate([row_scale, jnp.zeros_like(row_scale[:, :1])], axis=1)[:, layout.tile_upd]
            s = jnp.where(hit[None], row_scale, s)
        x = dequantize(x_KNMSD, s, q_THD.dtype).reshape(K, N, M * S, D)
        if new_KTD is not None:
            new_pad = jnp.concatenate([new_KTD.astype(x.dtype), jnp.zeros((K, 1, D), x.dtype)], axis=1)
            src_NC = layout.tile_new_src
            x = jnp.where((src_NC < T)[None, :, :, None], new_pad[:, src_NC], x)
        return x

    k_new, v_new = new_kv if new_kv is not None else (None, None)
    k_rows, v_rows, k_rs, v_rs = new_pages if new_pages is not None else (None,) * 4
    k_KNCD = gather(k_pages_KPSD, k_scale, k_new, k_rows, k_rs)
    v_KNCD = gather(v_pages_KPSD, v_scale, v_new, v_rows, v_rs)
    # Batch axes (kv head, tile) leading on every operand: XLA's CPU backend runs such batched
    # matmuls without transposing the gathered keys/values.
    q_KNQD = jnp.transpose(q_NRKGD, (2, 0, 3, 1, 4)).reshape(K, N, G * TILE, D)
    s_KNQC = jnp.einsum("knqd,kncd->knqc", q_KNQD, k_KNCD, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(M * S)
    written_NC = key_pos[None, :] < layout.tile_kv_len[:, None]  # the tile's sequence's keys after this step
    mask_NRC = (key_pos[None, None, :] <= layout.tile_positions[:, :, None]) & written_NC[:, None, :]
    mask_NQC = jnp.broadcast_to(mask_NRC[:, None], (N, G, TILE, M * S)).reshape(N, G * TILE, M * S)
    p = masked_softmax(s_KNQC, mask_NQC[None])
    # Stale slots past the written keys to 0: a reused page keeps them, and 0 * inf would be NaN.
    v_KNCD = jnp.where(written_NC[None, :, :, None], v_KNCD, 0)
    o_KNQD = jnp.einsum("knqc,kncd->knqd", p.astype(v_KNCD.dtype), v_KNCD, preferred_element_type=jnp.float32)
    o_flat = jnp.transpose(o_KNQD.reshape(K, N, G, TILE, D), (1, 3, 0, 2, 4)).reshape(N * TILE, H, D)
    o_dec = decode_attention(q_pad[layout.dec_token].reshape(-1, K, G, D), k_pages_KPSD, v_pages_KPSD, k_scale,
                             v_scale, current_page(k_pages_KPSD, k_scale, k_new, k_rows, k_rs, layout),
                             current_page(v_pages_KPSD, v_scale, v_new, v_rows, v_rs, layout), layout, scale)
    o_all = jnp.concatenate([o_flat, o_dec.reshape(-1, H, D)])
    return o_all[layout.token_out_row].astype(q_THD.dtype)


def current_page(pages_KPSD, scale, new_KTD, rows, row_scale, layout: StepLayout):
    """The page each decode row writes, as it stands after this step: (pages [K, Rd, S, D], scales or None).

    int8/fp8 pages: the rewritten rows (`new_pages`); float pages: the stored page with this
    step's token (`new_kv`) in its slot; neither given: the pages as they are (already written).
    """
    if rows is not None:
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)[:, layout.dec_cur_upd]
        return pad(rows), pad(row_scale)
    page = pages_KPSD[:, layout.dec_cur_page]
    page_scale = None if scale is None else scale[:, layout.dec_cur_page]
    if new_KTD is not None:
        T = new_KTD.shape[1]
        new_pad = jnp.concatenate([new_KTD, jnp.zeros_like(new_KTD[:, :1])], axis=1)[:, layout.dec_token]
        slot = (jnp.arange(page.shape[2])[None, :] == (layout.dec_pos % page.shape[2])[:, None]) & (
            layout.dec_token < T)[:, None]
        page = jnp.where(slot[None, :, :, None], new_pad[:, :, None].astype(page.dtype), page)
    return page, page_scale


def rewrite_pages(pages_KPSD, scale_KP, new_TKD, layout: StepLayout):
    """The pages one step writes, with their grown scales and the new tokens in place.

    Args:
        pages_KPSD: one layer's int8/fp8 pages [kv_heads, pages, page_size, head_dim].
        scale_KP: f32[kv_heads, pages] their scales.
        new_TKD: this step's keys or values [T, kv_heads, head_dim] (float).
        layout: the step (`upd_pages`, `upd_kept`, `token_upd`, `write_offset`).

    Returns:
        (rows [kv_heads, W, page_size, head_dim] in the pages' dtype, scales f32[kv_heads, W]),
        row w being page `layout.upd_pages[w]` after the step.
    """
    W = layout.upd_pages.shape[0]
    old_KWSD = pages_KPSD[:, layout.upd_pages]
    old_scale_KW = scale_KP[:, layout.upd_pages]
    scale_KW = page_scales(old_scale_KW, layout.upd_kept, new_TKD, layout.token_upd, pages_KPSD.dtype)
    rows_KWSD = requantize_pages(old_KWSD, old_scale_KW, scale_KW, layout.upd_kept)
    tok_scale_KT = safe_scale(scale_KW[:, jnp.minimum(layout.token_upd, W - 1)])
    x_KTD = quantize_with_scale(jnp.swapaxes(new_TKD, 0, 1), tok_scale_KT[:, :, None], pages_KPSD.dtype)
    rows_KWSD = rows_KWSD.at[:, layout.token_upd, layout.write_offset].set(x_KTD, mode="drop")
    return rows_KWSD, scale_KW


def as_bits(x):
    """A 1- or 2-byte array (fp8, bf16, int8) as unsigned-integer bits; other arrays and None unchanged.

    The pool crosses the layer scan, and is written, as bits: XLA's CPU backend has
    no fp8/bf16 gather, dynamic-slice or scatter, and converted the whole pool to a
    wider float and back around every step, a cost that grew with the pool rather
    than with the tokens read and written. Bits are moved exactly and in place;
    only what a step gathers is reinterpreted (`PageBits`).
    """
    if x is None or x.dtype.itemsize not in (1, 2):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.uint8 if x.dtype.itemsize == 1 else jnp.uint16)


def from_bits(bits, dtype):
    """Inverse of `as_bits` for arrays of `dtype`."""
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


class PageBits:
    """One layer's pages held as bits, read as `dtype`: indexing gathers bits, then reinterprets them."""

    def __init__(self, bits, dtype):
        self.bits, self.dtype, self.shape = bits, jnp.dtype(dtype), bits.shape

    def __getitem__(self, index):
        return from_bits(self.bits[index], self.dtype)

    @property
    def array(self):
        return from_bits(self.bits, self.dtype)


@flax.struct.dataclass
class PagedKVCache:
    """Paged K/V pages for every layer plus this step's ragged layout; satisfies the model's cache protocol.

    Example:
        >>> from jmem.serve.step_layout import build_layout
        >>> cache = PagedKVCache.create(config, num_pages=65, page_size=16, kv_dtype="fp8_e4m3")
        >>> cache = cache.replace(layout=build_layout(seqs, 32, 8, 4, 16, spare_page=64))
        >>> h, cache = model.hidden(ids_1T, positions=pos_1T, cache=cache)
    """

    k_pages: jax.Array  # [L, K, P, S, D]
    v_pages: jax.Array
    k_scale: jax.Array | None = None  # [L, K, P] f32 per page per kv head, for int8/fp8 pages
    v_scale: jax.Array | None = None
    layout: StepLayout | None = None
    impl: str = flax.struct.field(pytree_node=False, default="tiled")
    # Tensor parallelism: the pool's kv-head axis lies on this mesh's `tensor` axis (None: one device).
    mesh: jax.sharding.Mesh | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, config, num_pages: int, page_size: int, kv_dtype: str = "auto",
               impl: str = "auto", mesh: jax.sharding.Mesh | None = None) -> "PagedKVCache":
        """Zeroed pages (and zero scales for int8/fp8). `impl`: "tiled" (plain jnp, any backend),
        "kernel" (the Pallas ragged paged-attention kernel) or "auto" (the kernel on a TPU, and on a
        GPU when page_size and head_dim are powers of two, which Triton's tiles need; tiled
        otherwise). `mesh`: a tensor-parallel mesh (`jmem.serve.tensor_parallel.tensor_mesh`);
        each device then holds the pages of its own kv heads, created in place (the whole pool
        never exists on one device)."""
        dtype = kv_storage_dtype(kv_dtype, config.compute_dtype)
        check_int("num_pages", num_pages, 1)
        check_int("page_size", page_size, 1)
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"paged attention impl={impl!r}; accepted: {', '.join(ATTENTION_IMPLS)}")
        if impl == "auto":
            backend = jax.default_backend()
            fits = backend == "tpu" or (backend == "gpu" and triton_fits(page_size, config.head_dim))
            impl = "kernel" if fits else "tiled"
        shape = (config.n_layers, config.n_kv_heads, num_pages, page_size, config.head_dim)
        if mesh is None:
            zeros = jnp.zeros
        else:
            from jmem.serve.tensor_parallel import kv_pool_sharding

            def zeros(shp, dt):
                return jax.jit(lambda: jnp.zeros(shp, dt), out_shardings=kv_pool_sharding(mesh, len(shp)))()
        scales = (None, None)
        if is_quantized(dtype):
            scales = (zeros(shape[:3], jnp.float32), zeros(shape[:3], jnp.float32))
        return cls(zeros(shape, dtype), zeros(shape, dtype), *scales, impl=impl, mesh=mesh)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    def layer_arrays(self):
        """What the layer scan slices: the pages as bits (`as_bits`) and their scales."""
        return (as_bits(self.k_pages), as_bits(self.v_pages), self.k_scale, self.v_scale)

    def with_layers(self, arrays) -> "PagedKVCache":
        """Write this step's tokens, as `attend` returned them for every layer, into the pool.

        `attend` returns only what the step writes, not whole layers: float pages get
        the new tokens ([L, K, T, D] once stacked by the layer scan), int8/fp8 pages the
        rewritten pages and their scales ([L, K, W, S, D], [L, K, W]), pages as bits
        (`as_bits`). One scatter into the donated pool then updates it in place, where
        returning whole layers would copy the pool every step.
        """
        k_new, v_new, ks_new, vs_new = arrays
        lay = self.layout
        index = (slice(None), slice(None)) + (
            (lay.upd_pages,) if is_quantized(self.k_pages.dtype) else (lay.write_page, lay.write_offset))
        put = lambda pool, x: None if pool is None else self._keep_sharding(
            from_bits(as_bits(pool).at[index].set(x), pool.dtype))
        return self.replace(k_pages=put(self.k_pages, k_new), v_pages=put(self.v_pages, v_new),
                            k_scale=put(self.k_scale, ks_new), v_scale=put(self.v_scale, vs_new))

    def _keep_sharding(self, pool):
        """Pin a written pool to its kv-head sharding, so the donated input and the output agree."""
        if self.mesh is None:
            return pool
        from jmem.serve.tensor_parallel import kv_pool_sharding

        return jax.lax.with_sharding_constraint(pool, kv_pool_sharding(self.mesh, pool.ndim))

    def attend(self, layer_arrays, q_BTHD, k_BTKD, v_BTKD, positions_BT):
        """Attention of this step's tokens for one layer, and what the step writes (pages as bits)."""
        o, (k_new, v_new, ks_new, vs_new) = self._attend(layer_arrays, q_BTHD, k_BTKD, v_BTKD)
        return o, (as_bits(k_new), as_bits(v_new), ks_new, vs_new)

    def _attend(self, layer_arrays, q_BTHD, k_BTKD, v_BTKD):
        k_bits, v_bits, k_scale, v_scale = layer_arrays
        k_pages, v_pages = PageBits(k_bits, self.k_pages.dtype), PageBits(v_bits, self.v_pages.dtype)
        layer_arrays = (k_pages, v_pages, k_scale, v_scale)
        lay = self.layout
        if q_BTHD.shape[0] != 1:
            raise ValueError(f"PagedKVCache expects one ragged row of tokens [1, T, ...]; got q {q_BTHD.shape}")
        if is_quantized(k_pages.dtype):
            k_rows, k_rs = rewrite_pages(k_pages, k_scale, k_BTKD[0], lay)
            v_rows, v_rs = rewrite_pages(v_pages, v_scale, v_BTKD[0], lay)
            new_layer = (k_rows, v_rows, k_rs, v_rs)
            if self.impl == "kernel":
                return self._attend_kernel(layer_arrays, q_BTHD, new_layer), new_layer
            o_THD = tiled_paged_attention(q_BTHD[0], k_pages, v_pages, k_scale, v_scale, lay, new_pages=new_layer)
            return o_THD[None], new_layer

        # Float pages: this step's tokens in their stored dtype (what later steps will read back).
        kq = jnp.swapaxes(k_BTKD[0], 0, 1).astype(k_pages.dtype)
        vq = jnp.swapaxes(v_BTKD[0], 0, 1).astype(v_pages.dtype)
        new_layer = (kq, vq, None, None)
        if self.impl == "kernel":
            return self._attend_kernel(layer_arrays, q_BTHD, new_layer), new_layer
        new_kv = (kq.astype(q_BTHD.dtype), vq.astype(q_BTHD.dtype))
        o_THD = tiled_paged_attention(q_BTHD[0], k_pages, v_pages, None, None, lay, new_kv=new_kv)
        return o_THD[None], new_layer

    def _attend_kernel(self, layer_arrays, q_BTHD, new_layer):
        """The Pallas ragged kernel reads the new tokens from the pages: write them (float pages)
        or the rewritten pages and their scales (int8/fp8) into this layer's slice first."""
        from jmem.kernels.paged_attention import ragged_paged_attention

        k_pages, v_pages, k_scale, v_scale = layer_arrays
        k_pages, v_pages = k_pages.array, v_pages.array
        k_new, v_new, ks_new, vs_new = new_layer
        lay = self.layout
        scales = {}
        if is_quantized(k_pages.dtype):
            k_pages = k_pages.at[:, lay.upd_pages].set(k_new)
            v_pages = v_pages.at[:, lay.upd_pages].set(v_new)
            scales = dict(k_scale=k_scale.at[:, lay.upd_pages].set(ks_new),
                          v_scale=v_scale.at[:, lay.upd_pages].set(vs_new))
        else:
            k_pages = k_pages.at[:, lay.write_page, lay.write_offset].set(k_new)
            v_pages = v_pages.at[:, lay.write_page, lay.write_offset].set(v_new)

        def run(q_THD, k_KPSD, v_KPSD, kv_lens, pages, cu_q_lens, num_seqs, *ks):
            return ragged_paged_attention(q_THD, k_KPSD, v_KPSD, kv_lens, pages, cu_q_lens, num_seqs,
                                          **dict(zip(("k_scale", "v_scale"), ks)))

        args = (q_BTHD[0], k_pages, v_pages, lay.seq_kv_lens, lay.seq_pages, lay.cu_q_lens, lay.num_seqs,
                *scales.values())
        if self.mesh is not None and self.mesh.shape.get("tensor", 1) > 1:
            # GSPMD cannot split a Pallas call: run it per device on that device's heads (whole
            # GQA groups, since q heads and kv heads split alike), the layout replicated.
            from jax.sharding import PartitionSpec as P

            heads = (P(None, "tensor", None), P("tensor", None, None, None), P("tensor", None, None, None))
            specs = heads + (P(),) * 4 + (P("tensor", None),) * len(scales)
            run = jax.shard_map(run, mesh=self.mesh, in_specs=specs, out_specs=P(None, "tensor", None),
                                check_vma=False)
        return run(*args)[None]
