"""The serving cache's tiled paged attention against the kernels' ragged reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from jmem.kernels.paged_attention import ragged_paged_attention_reference
from jmem.serve.paged_cache import dequantize, quantize, tiled_paged_attention
from jmem.serve.step_layout import build_layout, tiles_needed

K, H, D, PAGE, NPAGES = 2, 4, 16, 4, 24


def random_step(rng):
    """Three sequences (a decode, a mid-prompt chunk, a fresh prefill) on shuffled pages."""
    perm = rng.permutation(NPAGES - 1)  # the last page is the spare
    seqs, used = [], 0
    for start, n in ((13, 1), (5, 9), (0, 6)):
        npg = -(-(start + n) // PAGE)
        seqs.append((start, n, list(perm[used : used + npg])))
        used += npg
    return seqs


@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_tiled_matches_ragged_reference(dtype):
    rng = np.random.default_rng(0)
    seqs = random_step(rng)
    T = sum(n for _, n, _ in seqs)
    q = jnp.asarray(rng.normal(size=(T + 3, H, D)), jnp.float32)  # 3 padding tokens
    k_pages = jnp.asarray(rng.normal(size=(K, NPAGES, PAGE, D)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(K, NPAGES, PAGE, D)), jnp.float32)
    M = max(len(p) for _, _, p in seqs)
    lay = build_layout(seqs, T + 3, tiles_needed([n for _, n, _ in seqs]) + 1, M, PAGE, NPAGES - 1, max_seqs=4)
    ks = vs = None
    if dtype == "int8":
        (k_pages, ks), (v_pages, vs) = quantize(k_pages, jnp.int8), quantize(v_pages, jnp.int8)
    got = tiled_paged_attention(q, k_pages, v_pages, ks, vs, lay)
    # The reference reads float pages: give it the same dequantized values.
    kf, vf = dequantize(k_pages, ks, jnp.float32), dequantize(v_pages, vs, jnp.float32)
    want = ragged_paged_attention_reference(q, kf, vf, lay.seq_kv_lens, lay.seq_pages, lay.cu_q_lens, lay.num_seqs)
    np.testing.assert_allclose(np.asarray(got)[:T], np.asarray(want)[:T], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)[T:]).all()  # padding rows are finite, not NaN or inf


def test_int8_roundtrip_error_bound():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 7, D)), jnp.float32)
    q, s = quantize(x, jnp.int8)
    err = np.abs(np.asarray(dequantize(q, s, jnp.float32) - x))
    assert (err <= np.asarray(s)[..., None] / 2 + 1e-7).all()


def test_overlay_of_new_tokens_equals_writing_them_first():
    """Attention with this step's K/V laid over stale pages equals attention after writing them."""
    rng = np.random.default_rng(2)
    seqs = random_step(rng)
    T = sum(n for _, n, _ in seqs)
    M = max(len(p) for _, _, p in seqs)
    lay = build_layout(seqs, T, tiles_needed([n for _, n, _ in seqs]), M, PAGE, NPAGES - 1, max_seqs=3)
    q = jnp.asarray(rng.normal(size=(T, H, D)), jnp.float32)
    stale_k = jnp.asarray(rng.normal(size=(K, NPAGES, PAGE, D)), jnp.float32)
    stale_v = jnp.asarray(rng.normal(size=(K, NPAGES, PAGE, D)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(K, T, D)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(K, T, D)), jnp.float32)
    got = tiled_paged_attention(q, stale_k, stale_v, None, None, lay, new_kv=(k_new, v_new))
    k_full = stale_k.at[:, lay.write_page, lay.write_offset].set(k_new)
    v_full = stale_v.at[:, lay.write_page, lay.write_offset].set(v_new)
    want = ragged_paged_attention_reference(q, k_full, v_full, lay.seq_kv_lens, lay.seq_pages, lay.cu_q_lens,
                                            lay.num_seqs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def poison_past_context(pages, seqs, value):
    """`pages` [K, P, S, ...] with every slot of the sequences' pages past their context set to `value`."""
    out = np.array(pages)
    for start, n, pgs in seqs:
        for p in range(start + n, len(pgs) * PAGE):
            out[:, pgs[p // PAGE], p % PAGE] = value
    return jnp.asarray(out)


@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("stale", ["finite", "nonfinite"])
def test_decode_rows_split_over_chunks_match_reference(dtype, stale):
    """Decode rows whose contexts span several chunks (and one page), mixed with a prefill chunk,
    with this step's tokens laid over stale pages: equal to attention after writing them. Stale
    slots past a context may hold inf or NaN (a reused page keeps them): no NaN reaches the output."""
    from jmem.serve.paged_decode import DECODE_CHUNK_KEYS

    rng = np.random.default_rng(4)
    npages = 160
    perm = rng.permutation(npages - 1)
    starts = [0, 3, DECODE_CHUNK_KEYS - 1, DECODE_CHUNK_KEYS, 2 * DECODE_CHUNK_KEYS + 5, 3 * DECODE_CHUNK_KEYS + 17]
    seqs, used = [], 0
    for start, n in [(s, 1) for s in starts] + [(9, 6)]:  # the chunk's last page part-filled
        npg = -(-(start + n) // PAGE)
        seqs.append((start, n, list(perm[used : used + npg])))
        used += npg
    T = sum(n for _, n, _ in seqs) + 2
    M = max(len(p) for _, _, p in seqs)
    lay = build_layout(seqs, T, tiles_needed([n for _, n, _ in seqs]) + 1, M, PAGE, npages - 1, max_seqs=8,
                       decode_rows=8, decode_chunks=12)
    assert int(np.sum(np.asarray(lay.dec_chunk_len) > 0)) == sum(-(-(s // PAGE) // (DECODE_CHUNK_KEYS // PAGE))
                                                                 for s in starts)
    q = jnp.asarray(rng.normal(size=(T, H, D)), jnp.float32)
    stale_k = jnp.asarray(rng.normal(size=(K, npages, PAGE, D)), jnp.float32)
    stale_v = jnp.asarray(rng.normal(size=(K, npages, PAGE, D)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(K, T, D)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(K, T, D)), jnp.float32)
    k_full = stale_k.at[:, lay.write_page, lay.write_offset].set(k_new)
    v_full = stale_v.at[:, lay.write_page, lay.write_offset].set(v_new)
    bad = (lambda x, v: poison_past_context(x, seqs, v)) if stale == "nonfinite" else (lambda x, v: x)
    if dtype == "f32":
        got = tiled_paged_attention(q, bad(stale_k, np.nan), bad(stale_v, np.inf), None, None, lay,
                                    new_kv=(k_new, v_new))
        kf, vf = k_full, v_full
    else:  # pages already written, per-slot int8 scales
        (kq, ks), (vq, vs) = quantize(k_full, jnp.int8), quantize(v_full, jnp.int8)
        got = tiled_paged_attention(q, kq, vq, bad(ks, np.nan), bad(vs, np.inf), lay)
        kf, vf = dequantize(kq, ks, jnp.float32), dequantize(vq, vs, jnp.float32)
    want = ragged_paged_attention_reference(q, kf, vf, lay.seq_kv_lens, lay.seq_pages, lay.cu_q_lens, lay.num_seqs)
    n = T - 2
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, page_size, head_dim, impl", [
    ("gpu", 16, 64, "kernel"), ("gpu", 24, 64, "tiled"), ("gpu", 16, 80, "tiled"),
    ("tpu", 24, 80, "kernel"), ("cpu", 16, 64, "tiled"),
])
def test_auto_takes_the_kernel_where_it_compiles(monkeypatch, backend, page_size, head_dim, impl):
    """On a GPU the Triton kernel needs power-of-two pages and heads; 'auto' serves other sizes tiled
    rather than fail when the first step is traced."""
    import jax

    from jmem.models import LlamaConfig
    from jmem.serve.paged_cache import PagedKVCache

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    config = LlamaConfig.tiny(head_dim=head_dim)
    assert PagedKVCache.create(config, num_pages=4, page_size=page_size).impl == impl


def test_pool_sizes_and_page_dtypes_are_checked():
    """A page size of 2.5 gave a fractional byte count, True a page of one token, and 0 pages an empty
    pool; an unknown page dtype was NumPy's own TypeError."""
    from jmem.kernels.paged_attention import quantize_pages
    from jmem.models import LlamaConfig
    from jmem.serve.paged_cache import PagedKVCache, kv_bytes_per_token

    config = LlamaConfig.tiny()
    for bad in (2.5, True, 0):
        with pytest.raises(ValueError, match=rf"^page_size={bad!r}; accepted: an integer >= 1$"):
            kv_bytes_per_token(config, "int8", bad)
        with pytest.raises(ValueError, match=rf"^page_size={bad!r}; accepted: an integer >= 1$"):
            PagedKVCache.create(config, 4, bad, "int8")
        with pytest.raises(ValueError, match=rf"^num_pages={bad!r}; accepted: an integer >= 1$"):
            PagedKVCache.create(config, bad, 16, "int8")
    for bad in ("foo", None, jnp.float32):
        with pytest.raises(ValueError, match=r"quantize_pages: dtype=.*; accepted: int8, float8_e4m3fn"):
            quantize_pages(jnp.ones((1, 1, 2, 4)), bad)
