"""Block-sparse attention kernel (Pallas, interpret mode on CPU) against the dense masked reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.kernels.masks import BigBird, BlockSparse, Causal, LocalWindow, Strided
from jmem.kernels.sparse_attention import sparse_attention, sparse_attention_reference, sparse_attention_stats, sparse_attention_visits
from tests.kernels.test_flash_attention import (
    TOL,
    _check_fwd_bwd,
    _inputs,
    compile_grad_for_tpu,
    cuda_lowering_available,
    force_head_dim_padding,
    force_streaming,
    lower_grad_for_gpu,
    tpu_topology_device,
)


def _dense_block_counts(mask, q_len, kv_len, bq, bk):
    """(non-empty, partial) tiles counted straight from the dense mask, padding keys masked."""
    dense = np.zeros((-(-q_len // bq) * bq, -(-kv_len // bk) * bk), bool)
    dense[:q_len, :kv_len] = mask.mask(q_len, kv_len)
    tiles = dense.reshape(dense.shape[0] // bq, bq, dense.shape[1] // bk, bk).transpose(0, 2, 1, 3)
    real_rows = np.arange(dense.shape[0]).reshape(-1, bq) < q_len  # padded query rows do not count
    nonempty = tiles.any(axis=(2, 3))
    full = np.array([[tiles[a, b][real_rows[a]].all() and (b + 1) * bk <= kv_len for b in range(tiles.shape[1])] for a in range(tiles.shape[0])])
    return int(nonempty.sum()), int((nonempty & ~full).sum())


CASES = [
    # (B, T, S, H, K, D, mask, dtype, body): "pad" runs the whole-row (GPU) body with head_dim 40 padded to 64
    # as on GPU, "stream" the TPU body that fetches only the visited tiles, "rows" the whole-row body as is.
    (1, 70, 70, 3, 1, 40, Causal() & LocalWindow(20), jnp.float32, "pad"),
    (1, 50, 90, 2, 2, 16, Strided(3) | BigBird(2, 5, 1, seed=1, block=16), jnp.float32, "rows"),
    (1, 64, 64, 4, 4, 16, Causal() & (LocalWindow(12) | Strided(16)), jnp.bfloat16, "rows"),
    (2, 70, 70, 6, 2, 40, Causal() & LocalWindow(20), jnp.float32, "stream"),
    (1, 50, 90, 2, 2, 16, Strided(3) | BigBird(2, 5, 1, seed=1, block=16), jnp.float32, "stream"),
    (1, 64, 64, 4, 1, 16, Causal() & (LocalWindow(12) | Strided(16)), jnp.bfloat16, "stream"),
]


@pytest.mark.parametrize("B,T,S,H,K,D,mask,dtype,body", CASES)
def test_sparse_matches_dense_reference(B, T, S, H, K, D, mask, dtype, body, monkeypatch):
    padded = "f32[1,3,80,64]" if body == "pad" else None
    if body == "pad":
        force_head_dim_padding(monkeypatch)
    if body == "stream":
        force_streaming(monkeypatch)
    q, k, v, do = _inputs(T + 3 * S + H, B, T, S, H, K, D, dtype)
    fn = lambda q, k, v: sparse_attention(q, k, v, mask, block_q=16, block_k=32, interpret=True)  # noqa: E731
    ref = lambda q, k, v: sparse_attention_reference(q, k, v, mask)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))(q, k, v))
    if padded:
        assert padded in jaxpr  # [B, H, T_pad, D_pad] inside the kernel call
    streamed = [name for name in ("sparse_fwd_stream", "sparse_dq_stream", "sparse_dkdv_stream") if name in jaxpr]
    assert len(streamed) == (3 if body == "stream" else 0), streamed
    _check_fwd_bwd(fn, ref, q, k, v, do, TOL[dtype])


@pytest.mark.parametrize("body", ["rows", "stream"])
def test_kernel_visits_exactly_the_nonempty_blocks(body, monkeypatch):
    # An empty block row (query rows that see nothing) and empty columns: skipped, output zeros,
    # no gradient from the empty row and none to the keys nobody sees.
    if body == "stream":
        force_streaming(monkeypatch)
    layout = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0]], bool)
    mask = BlockSparse(layout, block_q=16, block_k=16) & Causal()
    T, S = 48, 60
    q, k, v, do = _inputs(3, 2, T, S, 3, 1, 16, jnp.float32)
    visits = np.asarray(sparse_attention_visits(q, k, v, mask, block_q=16, block_k=16, interpret=True))
    stats = sparse_attention_stats(mask, T, S, 16, 16)
    nonempty, partial = _dense_block_counts(mask, T, S, 16, 16)
    assert (stats.visited, stats.partial, stats.num_blocks) == (nonempty, partial, 12)
    assert nonempty < stats.num_blocks
    np.testing.assert_array_equal(visits, np.broadcast_to([nonempty, partial], (2, 3, 2)))
    fn = lambda q, k, v: sparse_attention(q, k, v, mask, block_q=16, block_k=16, interpret=True)  # noqa: E731
    _check_fwd_bwd(fn, lambda q, k, v: sparse_attention_reference(q, k, v, mask), q, k, v, do, TOL[jnp.float32])
    assert not np.asarray(fn(q, k, v)[:, 16:32]).any()
    dq, dk = jax.grad(lambda q, k: (fn(q, k, v) * do).sum(), argnums=(0, 1))(q, k)
    assert not np.asarray(dq[:, 16:32]).any() and not np.asarray(dk[:, 32:]).any()


def test_stats_of_sliding_window():
    rng = np.random.default_rng()
    w = int(rng.integers(17, 200))
    mask = Causal() & LocalWindow(w)
    stats = sparse_attention_stats(mask, 1024, 1024, 64, 64)
    assert (stats.visited, stats.partial) == _dense_block_counts(mask, 1024, 1024, 64, 64)
    assert stats.visited < stats.num_blocks // 2


def test_bad_inputs_raise():
    q = jnp.zeros((1, 32, 4, 16))
    kv = jnp.zeros((1, 32, 3, 16))
    with pytest.raises(ValueError, match=r"q_heads=4 must be a multiple of kv_heads=3"):
        sparse_attention(q, kv, kv, Causal())
    kv = jnp.zeros((1, 32, 2, 16))
    with pytest.raises(ValueError, match=r"layout \(4, 4\) does not match q_len=32, kv_len=32"):
        sparse_attention(q, kv, kv, BlockSparse(np.ones((4, 4), bool), block_q=16, block_k=16))
    with pytest.raises(ValueError, match="num_global=40 is larger than the sequence kv_len=32"):
        sparse_attention(q, kv, kv, BigBird(40, 4, 1))
    with pytest.raises(ValueError, match="mask must be a jmem.kernels.masks.Mask"):
        sparse_attention(q, kv, kv, np.ones((32, 32), bool))


def test_sparse_lowers_to_triton_for_gpu():
    fn = lambda q, k, v: sparse_attention(q, k, v, Causal() & LocalWindow(100), interpret=False)  # noqa: E731
    text = lower_grad_for_gpu(fn, (1, 300, 3, 64), (1, 300, 1, 64), jnp.bfloat16)
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv


@pytest.mark.parametrize("D", [80, 96])
def test_sparse_lowers_for_gpu_with_any_head_dim(D):
    cuda_lowering_available()
    fn = lambda q, k, v: sparse_attention(q, k, v, Causal() & LocalWindow(20), interpret=False)  # noqa: E731
    text = lower_grad_for_gpu(fn, (1, 64, 2, D), (1, 64, 1, D), jnp.bfloat16)
    assert text.count("__gpu$xla.gpu.triton") == 3


def test_sparse_compiles_for_tpu():
    device = tpu_topology_device()
    mask = Causal() & (LocalWindow(100) | Strided(64))
    for dtype, (T, H, K, D) in [(jnp.bfloat16, (300, 3, 1, 64)), (jnp.float32, (256, 4, 4, 128))]:
        fn = lambda q, k, v: sparse_attention(q, k, v, mask, interpret=False)  # noqa: E731
        compiled = compile_grad_for_tpu(fn, device, (1, T, H, D), (1, T, K, D), dtype)
        assert compiled.as_text().count("tpu_custom_call") >= 3  # forward, dq, dk/dv kernels


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
def test_sparse_compiled_on_accelerator():
    T = 2048
    mask = Causal() & (LocalWindow(256) | BigBird(16, 0, 2, seed=0, block=128))
    q, k, v, do = _inputs(T, 1, T, T, 8, 2, 128, jnp.bfloat16)
    fn = lambda q, k, v: sparse_attention(q, k, v, mask, interpret=False)  # noqa: E731
    ref = lambda q, k, v: sparse_attention_reference(q, k, v, mask)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        _check_fwd_bwd(fn, ref, q, k, v, do, TOL[jnp.bfloat16])
    visits = np.asarray(sparse_attention_visits(q, k, v, mask, interpret=False))
    stats = sparse_attention_stats(mask, T, T)
    np.testing.assert_array_equal(visits, np.broadcast_to([stats.visited, stats.partial], (1, 8, 2)))


@pytest.mark.parametrize("T,H,K", [(16384, 8, 8), (4096, 32, 8)])
def test_sparse_compiles_for_tpu_at_lengths_past_vmem(T, H, K):
    """fwd + bwd of a sliding window compile for TPU v5e where a whole kv head's K/V (16k, bf16,
    head_dim 128) or a GQA group's Q/dO (Llama's 32/8 heads at 4k) would not fit the 16 MiB of
    scoped VMEM: the TPU bodies fetch only the visited tiles through the grid."""
    device = tpu_topology_device()
    fn = lambda q, k, v: sparse_attention(q, k, v, Causal() & LocalWindow(256), interpret=False)  # noqa: E731
    text = compile_grad_for_tpu(fn, device, (1, T, H, 128), (1, T, K, 128), jnp.bfloat16).as_text()
    assert all(name in text for name in ("sparse_fwd_stream", "sparse_dq_stream", "sparse_dkdv_stream"))
