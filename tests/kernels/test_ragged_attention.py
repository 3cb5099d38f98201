"""Ragged paged attention (mixed prefill + decode): Pallas kernel (interpreted on CPU) against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.kernels.paged_attention import (
    paged_attention_reference,
    quantize_pages,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731


def ragged_case(seed, q_lens, kv_lens, max_seqs, total, H, K, D, page, dtype):
    """Contiguous K/V for each sequence scattered into shuffled pages, plus the concatenated queries."""
    rng = np.random.default_rng(seed)
    npg = -(-max(kv_lens) // page)
    N = max_seqs * npg + 2
    table = rng.permutation(N)[: max_seqs * npg].reshape(max_seqs, npg).astype(np.int32)
    k = rng.standard_normal((max_seqs, npg * page, K, D)).astype(np.float32)
    v = rng.standard_normal((max_seqs, npg * page, K, D)).astype(np.float32)
    pools = []
    for x in (k, v):
        pages = 100 * rng.standard_normal((K, N, page, D)).astype(np.float32)  # garbage where unused
        pages[:, table] = x.reshape(max_seqs, npg, page, K, D).transpose(3, 0, 1, 2, 4)
        pools.append(jnp.asarray(pages, dtype))
    n = len(q_lens)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kvl = np.zeros(max_seqs, np.int32)
    kvl[:n] = kv_lens
    q = jnp.asarray(rng.standard_normal((total, H, D)), dtype)
    return q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), *pools, jnp.asarray(kvl), jnp.asarray(table), jnp.asarray(cu), n


# A prefill chunk continuing a cached prefix, decode tokens, a whole prompt, a
# one-token context, then padding tokens and an unused sequence slot.
Q_LENS = [5, 1, 20, 1, 3]
KV_LENS = [9, 30, 20, 1, 17]


@pytest.mark.parametrize(
    "backend,page,ratio,dtype",
    [("mosaic", 8, 3, jnp.float32), ("triton", 16, 1, jnp.bfloat16), ("mosaic", 32, 8, jnp.bfloat16)],
)
def test_ragged_matches_reference(backend, page, ratio, dtype):
    K, D = 2, 32
    q, k, v, kp, vp, kvl, table, cu, n = ragged_case(page, Q_LENS, KV_LENS, 6, 36, K * ratio, K, D, page, dtype)
    out = ragged_paged_attention(q, kp, vp, kvl, table, cu, n, backend=backend, block_q=4, pages_per_compute_block=2, interpret=True)
    ref = ragged_paged_attention_reference(q, kp, vp, kvl, table, cu, n)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(f32(out), f32(ref), atol=TOL[dtype], rtol=TOL[dtype])
    assert not f32(out)[sum(Q_LENS) :].any()  # padding tokens


def dense_causal(q_TKGD, k_SKD, v_SKD, offset):
    """Plain numpy attention: query t sees keys 0..offset + t."""
    s = np.einsum("tkgd,skd->tkgs", q_TKGD, k_SKD) / np.sqrt(q_TKGD.shape[-1])
    visible = np.arange(k_SKD.shape[0])[None, :] <= offset + np.arange(q_TKGD.shape[0])[:, None]
    s = np.where(visible[:, None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("tkgs,skd->tkgd", p / p.sum(-1, keepdims=True), v_SKD)


def test_reference_agrees_with_dense_and_decode():
    """The ragged reference, per sequence, equals dense causal attention with an offset (and decode for 1 token)."""
    K, D, H = 2, 16, 6
    q, k, v, kp, vp, kvl, table, cu, n = ragged_case(1, Q_LENS, KV_LENS, 6, 36, H, K, D, 8, jnp.float32)
    ref = f32(ragged_paged_attention_reference(q, kp, vp, kvl, table, cu, n))
    for s, (ql, kl) in enumerate(zip(Q_LENS, KV_LENS)):
        qs = f32(q[int(cu[s]) : int(cu[s + 1])]).reshape(ql, K, H // K, D)
        dense = dense_causal(qs, f32(k[s, :kl]), f32(v[s, :kl]), kl - ql).reshape(ql, H, D)
        np.testing.assert_allclose(ref[int(cu[s]) : int(cu[s + 1])], dense, atol=2e-5, rtol=2e-5)
    dec = paged_attention_reference(q[5:6], kp, vp, kvl[1:2], table[1:2])
    np.testing.assert_allclose(ref[5:6], f32(dec), atol=2e-5, rtol=2e-5)


def test_ragged_int8_under_jit_with_traced_metadata():
    """Serving path: cu_q_lens / num_seqs traced (one compile for every batch mix), int8 pages."""
    K, D, page = 2, 32, 16
    q, _, _, kp, vp, kvl, table, cu, n = ragged_case(5, Q_LENS, KV_LENS, 6, 36, 4, K, D, page, jnp.float32)
    kq, ks = quantize_pages(kp, jnp.int8)
    vq, vs = quantize_pages(vp, jnp.int8)
    f = jax.jit(lambda q, l, t, cu, n: ragged_paged_attention(q, kq, vq, l, t, cu, n, k_scale=ks, v_scale=vs, backend="triton", interpret=True))
    out = f(q, kvl, table, cu, jnp.int32(n))
    ref = ragged_paged_attention_reference(q, kq, vq, kvl, table, cu, n, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(f32(out), f32(ref), atol=1e-5, rtol=1e-5)
    # Fewer sequences through the same compiled function: sequence 4's tokens become padding.
    out3 = f(q, kvl, table, cu, jnp.int32(n - 1))
    np.testing.assert_allclose(f32(out3)[: int(cu[n - 1])], f32(ref)[: int(cu[n - 1])], atol=1e-5, rtol=1e-5)
    assert not f32(out3)[int(cu[n - 1]) :].any()


def test_ragged_bad_inputs():
    K, D = 2, 16
    q, _, _, kp, vp, kvl, table, cu, n = ragged_case(2, Q_LENS, KV_LENS, 6, 36, 4, K, D, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"cu_q_lens must be int32\[max_seqs \+ 1\] = \[7\]"):
        ragged_paged_attention(q, kp, vp, kvl, table, cu[:-1], n)
    with pytest.raises(ValueError, match="sequence 1 has q_len=1 > kv_len=0"):
        ragged_paged_attention(q, kp, vp, kvl.at[1].set(0), table, cu, n)
    with pytest.raises(ValueError, match="num_seqs=7 outside"):
        ragged_paged_attention(q, kp, vp, kvl, table, cu, 7)
    with pytest.raises(ValueError, match="end at most at total_tokens=36"):
        ragged_paged_attention(q, kp, vp, kvl, table, cu.at[5:].set(40), n)
    with pytest.raises(ValueError, match=r"block_tables\[2, 1\]=-1 points outside the page pool"):
        ragged_paged_attention(q, kp, vp, kvl, table.at[2, 1].set(-1), cu, n)
    with pytest.raises(ValueError, match="q_heads=3 must be a multiple of kv_heads=2"):
        ragged_paged_attention(q[:, :3], kp, vp, kvl, table, cu, n)
    with pytest.raises(ValueError, match=r"block_tables int32\[6, 0\] has no page columns; accepted: pages_per_seq"):
        ragged_paged_attention(q, kp, vp, kvl * 0, table[:, :0], cu * 0, 0)


def test_cu_q_lens_entries_past_num_seqs_are_ignored():
    """Zero-padded cu_q_lens (only the first num_seqs + 1 entries are valid) gives per-sequence dense attention."""
    # The shapes and static arguments of test_ragged_matches_reference's first case: its compiled kernel is reused.
    K, D, H, n = 2, 32, 6, 3
    q, k, v, kp, vp, kvl, table, cu, _ = ragged_case(8, Q_LENS, KV_LENS, 6, 36, H, K, D, 8, jnp.float32)
    cu_zero = cu.at[n + 1 :].set(0)
    out = ragged_paged_attention(q, kp, vp, kvl, table, cu_zero, n, backend="mosaic", block_q=4, pages_per_compute_block=2,
                                 interpret=True)
    ref = ragged_paged_attention_reference(q, kp, vp, kvl, table, cu_zero, n)
    for s, (ql, kl) in enumerate(zip(Q_LENS[:n], KV_LENS[:n])):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        qs = f32(q[rows]).reshape(ql, K, H // K, D)
        dense = dense_causal(qs, f32(k[s, :kl]), f32(v[s, :kl]), kl - ql).reshape(ql, H, D)
        np.testing.assert_allclose(f32(out)[rows], dense, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(f32(ref)[rows], dense, atol=2e-5, rtol=2e-5)
    live = int(cu[n])
    assert not f32(out)[live:].any() and not f32(ref)[live:].any()  # tokens of sequences past num_seqs: padding


def test_ragged_kv_lens_shape_and_range_are_named():
    q, _, _, kp, vp, kvl, table, cu, n = ragged_case(3, Q_LENS, KV_LENS, 6, 36, 4, 2, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"kv_lens must be int32\[max_seqs\] = \[6\] .*; got int32\[7\]"):
        ragged_paged_attention(q, kp, vp, jnp.append(kvl, 3), table, cu, n)
    # A negative length is named as such, before its q_len is compared with it.
    with pytest.raises(ValueError, match=r"kv_lens\[1\]=-2 is outside \[0, 32\]"):
        ragged_paged_attention(q, kp, vp, kvl.at[1].set(-2), table, cu, n)
