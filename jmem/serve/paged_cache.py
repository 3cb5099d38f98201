"""`PagedKVCache`: the model's KV-cache protocol over a paged pool, for a ragged batch of sequences.

Pages are `[layers, kv_heads, num_pages, page_size, head_dim]`; a sequence's
pages are listed in its block table. One step feeds the model a flat (ragged)
run of tokens from many sequences (`ids [1, T]`): each token writes its K/V to
`(write_page, write_offset)` and attends to its own sequence's cached keys up
to its position.

Attention is computed over query tiles: the host lays each sequence's tokens
into tiles of `TILE` rows that belong to one sequence, so a tile gathers only
its own sequence's pages. Decodes fill one row of a tile; a prefill chunk of n
tokens fills ceil(n / TILE) tiles. The model's dense layers still run on the
unpadded flat tokens.

KV dtypes: the compute dtype, bf16, fp8_e4m3 (cast with a unit scale, clipped
to the fp8 range: half the bytes of bf16), or int8 with one f32 scale per
token and head (absmax / 127).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jmem.kernels.dispatch import masked_softmax

TILE = 8  # query rows per attention tile
KV_DTYPES = ("auto", "bf16", "fp8_e4m3", "int8")
_FP8_MAX = 448.0


def kv_storage_dtype(kv_dtype: str, compute_dtype):
    """Storage dtype for a `--kv-cache-dtype` name."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
    from jmem.models.config import as_dtype

    return {"auto": jnp.dtype(as_dtype(compute_dtype)), "bf16": jnp.dtype(jnp.bfloat16),
            "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn), "int8": jnp.dtype(jnp.int8)}[kv_dtype]


def kv_bytes_per_token(config, kv_dtype: str) -> int:
    """Bytes of K and V (and scales) one token occupies across all layers."""
    itemsize = kv_storage_dtype(kv_dtype, config.compute_dtype).itemsize
    per_head = config.head_dim * itemsize + (4 if kv_dtype == "int8" else 0)
    return 2 * config.n_layers * config.n_kv_heads * per_head


def quantize(x, dtype):
    """x [..., D] -> (stored [..., D] in `dtype`, f32 scale [...] or None)."""
    if dtype == jnp.int8:
        scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / 127.0
        scale = jnp.where(scale == 0, 1.0, scale)
        q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127).astype(jnp.int8)
        return q, scale
    if dtype == jnp.float8_e4m3fn:
        return jnp.clip(x.astype(jnp.float32), -_FP8_MAX, _FP8_MAX).astype(dtype), None
    return x.astype(dtype), None


def dequantize(x, scale, dtype):
    if scale is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale[..., None]).astype(dtype)


@flax.struct.dataclass
class StepLayout:
    """Where each token of a ragged step writes and which tile computes its attention (all int32).

    Shapes: T flat tokens (padded), N tiles, M pages per tile.
        write_page, write_offset: [T] page and slot each token's K/V goes to (padding: a spare page).
        tile_tokens: [N, TILE] flat index of each tile row's token (padding: T, reads zeros).
        tile_positions: [N, TILE] position of each tile row (padding: -1, sees nothing).
        tile_pages: [N, M] the tile's sequence's pages (padding: the spare page).
        tile_kv_len: [N] keys valid in the tile's sequence after this step.
        token_tile_row: [T] flat index `tile * TILE + row` holding each token's output.
        tile_new_src: [N, M * page_size] flat index of the token of this step whose K/V sits at
            each key position of the tile's sequence (T where the key comes from the pages).

    The same step for the ragged kernels (`jmem.kernels.paged_attention`), R = rows:
        slot_mapping: [T] page * page_size + offset (padding: -1).
        seq_kv_lens: [R] keys of each sequence after this step (padding rows: 0).
        seq_pages: [R, M] block table of each sequence.
        cu_q_lens: [R + 1] prefix sums of the tokens each sequence computes.
        num_seqs: scalar, sequences in use.
    """

    write_page: jax.Array
    write_offset: jax.Array
    tile_tokens: jax.Array
    tile_positions: jax.Array
    tile_pages: jax.Array
    tile_kv_len: jax.Array
    token_tile_row: jax.Array
    tile_new_src: jax.Array
    slot_mapping: jax.Array
    seq_kv_lens: jax.Array
    seq_pages: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


def build_layout(seqs, num_tokens_padded: int, num_tiles: int, pages_per_tile: int, page_size: int,
                 spare_page: int, max_seqs: int | None = None) -> StepLayout:
    """Host side: the layout for `seqs` = [(start position, num tokens, page list), ...] in flat order."""
    T, N, M = num_tokens_padded, num_tiles, pages_per_tile
    R = max_seqs or len(seqs)
    slot_mapping = np.full(T, -1, np.int32)
    seq_kv_lens = np.zeros(R, np.int32)
    seq_pages = np.full((R, M), spare_page, np.int32)
    cu_q_lens = np.zeros(R + 1, np.int32)
    write_page = np.full(T, spare_page, np.int32)
    write_offset = np.zeros(T, np.int32)
    tile_tokens = np.full((N, TILE), T, np.int32)
    tile_positions = np.full((N, TILE), -1, np.int32)
    tile_pages = np.full((N, M), spare_page, np.int32)
    tile_kv_len = np.zeros(N, np.int32)
    token_tile_row = np.zeros(T, np.int32)
    tile_new_src = np.full((N, M * page_size), T, np.int32)
    t = tile = 0
    for i, (start, n, pages) in enumerate(seqs):
        pos = np.arange(start, start + n)
        pages = np.asarray(pages, np.int32)
        write_page[t : t + n] = pages[pos // page_size]
        write_offset[t : t + n] = pos % page_size
        slot_mapping[t : t + n] = write_page[t : t + n] * page_size + write_offset[t : t + n]
        n_pages = -(-(start + n) // page_size)
        seq_kv_lens[i] = start + n
        seq_pages[i, :n_pages] = pages[:n_pages]
        cu_q_lens[i + 1] = cu_q_lens[i] + n
        for j in range(0, n, TILE):
            rows = min(TILE, n - j)
            tile_tokens[tile, :rows] = np.arange(t + j, t + j + rows)
            tile_positions[tile, :rows] = pos[j : j + rows]
            tile_pages[tile, :n_pages] = pages[:n_pages]
            tile_kv_len[tile] = start + n
            token_tile_row[t + j : t + j + rows] = tile * TILE + np.arange(rows)
            tile_new_src[tile, start : start + n] = np.arange(t, t + n)
            tile += 1
        t += n
    cu_q_lens[len(seqs) + 1 :] = cu_q_lens[len(seqs)]
    return StepLayout(*(jnp.asarray(a) for a in (write_page, write_offset, tile_tokens, tile_positions,
                                                   tile_pages, tile_kv_len, token_tile_row, tile_new_src, slot_mapping,
                                                   seq_kv_lens, seq_pages, cu_q_lens, np.int32(len(seqs)))))


def tiles_needed(seq_lens) -> int:
    return sum(-(-n // TILE) for n in seq_lens)


def tiled_paged_attention(q_THD, k_pages_KPSD, v_pages_KPSD, k_scale, v_scale, layout: StepLayout, sm_scale=None,
                          new_kv=None):
    """Ragged attention over paged K/V (plain jnp; the CPU path).

    Args:
        q_THD: queries of the flat tokens [T, q_heads, head_dim].
        k_pages_KPSD, v_pages_KPSD: one layer's pages [kv_heads, pages, page_size, head_dim].
        k_scale, v_scale: f32 [kv_heads, pages, page_size] for int8 pages, else None.
        layout: see `StepLayout`.
        new_kv: optional (k, v) [kv_heads, T, head_dim] of this step's tokens, not yet in the
            pages: they are laid over the gathered keys (`layout.tile_new_src`), so the pool
            is written once after all layers instead of copied per layer.

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

    def gather(pages, scales, new_KTD):
        x_KNMSD = pages[:, layout.tile_pages]
        s = None if scales is None else scales[:, layout.tile_pages]
        x = dequantize(x_KNMSD, s, q_THD.dtype).reshape(K, N, M * S, D)
        if new_KTD is not None:
            new_pad = jnp.concatenate([new_KTD.astype(x.dtype), jnp.zeros((K, 1, D), x.dtype)], axis=1)
            src_NC = layout.tile_new_src
            x = jnp.where((src_NC < T)[None, :, :, None], new_pad[:, src_NC], x)
        return x

    k_new, v_new = new_kv if new_kv is not None else (None, None)
    k_KNCD, v_KNCD = gather(k_pages_KPSD, k_scale, k_new), gather(v_pages_KPSD, v_scale, v_new)
    s_NKGRC = jnp.einsum("nrkgd,kncd->nkgrc", q_NRKGD, k_KNCD, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(M * S)
    mask_NRC = (key_pos[None, None, :] <= layout.tile_positions[:, :, None]) & (
        key_pos[None, None, :] < layout.tile_kv_len[:, None, None])
    p = masked_softmax(s_NKGRC, mask_NRC[:, None, None])
    o_NRKGD = jnp.einsum("nkgrc,kncd->nrkgd", p.astype(v_KNCD.dtype), v_KNCD, preferred_element_type=jnp.float32)
    o_flat = o_NRKGD.reshape(N * TILE, H, D)
    return o_flat[layout.token_tile_row].astype(q_THD.dtype)


@flax.struct.dataclass
class PagedKVCache:
    """Paged K/V pages for every layer plus this step's ragged layout; satisfies the model's cache protocol.

    Example:
        >>> cache = PagedKVCache.create(config, num_pages=65, page_size=16, kv_dtype="auto")
        >>> cache = cache.replace(layout=build_layout(seqs, 32, 8, 4, 16, spare_page=64))
        >>> h, cache = model.hidden(ids_1T, positions=pos_1T, cache=cache)
    """

    k_pages: jax.Array  # [L, K, P, S, D]
    v_pages: jax.Array
    k_scale: jax.Array | None = None  # [L, K, P, S] f32 for int8
    v_scale: jax.Array | None = None
    layout: StepLayout | None = None
    impl: str = flax.struct.field(pytree_node=False, default="tiled")

    @classmethod
    def create(cls, config, num_pages: int, page_size: int, kv_dtype: str = "auto",
               impl: str = "auto") -> "PagedKVCache":
        """Zeroed pages. `impl`: "tiled" (plain jnp, any backend), "kernel" (the Pallas ragged
        paged-attention kernel; not for int8, whose scales are per token here) or "auto"
        (kernel on GPU/TPU when the dtype allows, tiled otherwise)."""
        dtype = kv_storage_dtype(kv_dtype, config.compute_dtype)
        if impl not in ("auto", "tiled", "kernel"):
            raise ValueError(f"paged attention impl={impl!r}; accepted: auto, tiled, kernel")
        if impl == "kernel" and dtype == jnp.int8:
            raise ValueError("impl='kernel' does not take int8 pages (per-token scales); use 'tiled'")
        if impl == "auto":
            impl = "kernel" if jax.default_backend() in ("gpu", "tpu") and dtype != jnp.int8 else "tiled"
        shape = (config.n_layers, config.n_kv_heads, num_pages, page_size, config.head_dim)
        scales = (jnp.ones(shape[:-1], jnp.float32), jnp.ones(shape[:-1], jnp.float32)) if dtype == jnp.int8 else (None, None)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), *scales, impl=impl)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    def layer_arrays(self):
        return (self.k_pages, self.v_pages, self.k_scale, self.v_scale)

    def with_layers(self, arrays) -> "PagedKVCache":
        """Write this step's tokens, as `attend` returned them for every layer, into the pool.

        `attend` returns only the new tokens (stored form, [L, K, T, D] and scales
        [L, K, T] once stacked by the layer scan), not whole layers: one scatter into
        the donated pool then updates it in place, where returning whole layers would
        copy the pool every step.
        """
        k_new, v_new, ks_new, vs_new = arrays
        lay = self.layout
        put = lambda pool, x: None if pool is None else pool.at[:, :, lay.write_page, lay.write_offset].set(x)
        return self.replace(k_pages=put(self.k_pages, k_new), v_pages=put(self.v_pages, v_new),
                            k_scale=put(self.k_scale, ks_new), v_scale=put(self.v_scale, vs_new))

    def attend(self, layer_arrays, q_BTHD, k_BTKD, v_BTKD, positions_BT):
        k_pages, v_pages, k_scale, v_scale = layer_arrays
        lay = self.layout
        if q_BTHD.shape[0] != 1:
            raise ValueError(f"PagedKVCache expects one ragged row of tokens [1, T, ...]; got q {q_BTHD.shape}")

        # This step's tokens in their stored form (what later steps will read back).
        kq, ks = quantize(jnp.swapaxes(k_BTKD[0], 0, 1), k_pages.dtype)
        vq, vs = quantize(jnp.swapaxes(v_BTKD[0], 0, 1), v_pages.dtype)
        new_layer = (kq, vq, ks, vs)
        if self.impl == "kernel":
            return self._attend_kernel(layer_arrays, q_BTHD, kq, vq), new_layer
        new_kv = (dequantize(kq, ks, q_BTHD.dtype), dequantize(vq, vs, q_BTHD.dtype))
        o_THD = tiled_paged_attention(q_BTHD[0], k_pages, v_pages, k_scale, v_scale, lay, new_kv=new_kv)
        return o_THD[None], new_layer

    def _attend_kernel(self, layer_arrays, q_BTHD, kq_KTD, vq_KTD):
        """The Pallas ragged kernel reads the new tokens from the pages: write them into this
        layer's slice first (stored values, so fp8 gets the unit scale the tiled path uses)."""
        from jmem.kernels.paged_attention import ragged_paged_attention

        k_pages, v_pages, _, _ = layer_arrays
        lay = self.layout
        scales = {}
        if k_pages.dtype == jnp.float8_e4m3fn:
            ones = jnp.ones(k_pages.shape[:2], jnp.float32)
            scales = dict(k_scale=ones, v_scale=ones)
        k_pages = k_pages.at[:, lay.write_page, lay.write_offset].set(kq_KTD)
        v_pages = v_pages.at[:, lay.write_page, lay.write_offset].set(vq_KTD)
        o_THD = ragged_paged_attention(q_BTHD[0], k_pages, v_pages, lay.seq_kv_lens, lay.seq_pages, lay.cu_q_lens,
                                       lay.num_seqs, **scales)
        return o_THD[None]
