"""Masks: dense semantics against the definitions, block metadata against the dense mask."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jmem.kernels.masks import EMPTY, FULL, PARTIAL, BigBird, BlockSparse, Causal, LocalWindow, Strided
from jmem.kernels.sparse_attention import sparse_attention_stats


def _brute(pred, q_len, kv_len):
    return np.array([[pred(i, j) for j in range(kv_len)] for i in range(q_len)], bool)


@pytest.mark.parametrize("q_len,kv_len", [(13, 13), (7, 19), (21, 5)])
def test_primitive_masks_match_definitions(q_len, kv_len):
    np.testing.assert_array_equal(Causal().mask(q_len, kv_len), _brute(lambda i, j: j <= i, q_len, kv_len))
    np.testing.assert_array_equal(LocalWindow(4).mask(q_len, kv_len), _brute(lambda i, j: abs(i - j) < 4, q_len, kv_len))
    np.testing.assert_array_equal(Strided(3).mask(q_len, kv_len), _brute(lambda i, j: (i - j) % 3 == 0, q_len, kv_len))


def test_combinations():
    rng = np.random.default_rng(0)
    w, s = int(rng.integers(2, 6)), int(rng.integers(2, 5))
    got = (Causal() & (LocalWindow(w) | Strided(s))).mask(17, 17)
    want = _brute(lambda i, j: j <= i and (abs(i - j) < w or (i - j) % s == 0), 17, 17)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal((Causal() | LocalWindow(w)).mask(9, 9), _brute(lambda i, j: j <= i or abs(i - j) < w, 9, 9))


def test_block_sparse_and_bigbird_definitions():
    rng = np.random.default_rng(1)
    layout = rng.random((3, 4)) < 0.5
    m = BlockSparse(layout, block_q=4, block_k=5)
    np.testing.assert_array_equal(m.mask(10, 18), _brute(lambda i, j: layout[i // 4, j // 5], 10, 18))
    bb = BigBird(num_global=2, window=3, num_random=2, seed=7, block=4)
    rand = bb.random_layout(20, 24)
    assert rand.shape == (5, 6) and (rand.sum(axis=1) == 2).all()
    want = _brute(lambda i, j: i < 2 or j < 2 or abs(i - j) < 3 or rand[i // 4, j // 4], 20, 24)
    np.testing.assert_array_equal(bb.mask(20, 24), want)
    # Same seed, same draw; a different seed draws differently.
    np.testing.assert_array_equal(BigBird(2, 3, 2, seed=7, block=4).mask(20, 24), want)
    assert not np.array_equal(BigBird(2, 3, 2, seed=8, block=4).random_layout(20, 24), rand)


@pytest.mark.parametrize(
    "mask,q_len,kv_len,bq,bk",
    [
        (Causal(), 40, 40, 16, 16),
        (Causal() & LocalWindow(9), 37, 50, 8, 16),
        (Strided(4) | BigBird(1, 2, 1, seed=3, block=8), 30, 41, 16, 8),
    ],
)
def test_block_info_matches_dense_mask(mask, q_len, kv_len, bq, bk):
    info = mask.block_info(q_len, kv_len, bq, bk)
    dense = mask.mask(q_len, kv_len)
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    assert info.status.shape == (nq, nk)
    for qb, kb in itertools.product(range(nq), range(nk)):
        real = dense[qb * bq : (qb + 1) * bq, kb * bk : (kb + 1) * bk]
        padded_keys = (kb + 1) * bk > kv_len
        want = EMPTY if not real.any() else FULL if real.all() and not padded_keys else PARTIAL
        assert info.status[qb, kb] == want, (qb, kb)
        if want == PARTIAL:
            tile = info.tiles[info.tile_id[qb, kb]]
            np.testing.assert_array_equal(tile[: real.shape[0], : real.shape[1]], real)
            assert not tile[:, real.shape[1] :].any()  # padded keys stay masked
        else:
            assert info.tile_id[qb, kb] == -1
    assert info.num_nonempty == info.num_full + info.num_partial


def test_identical_partial_tiles_are_stored_once():
    info = Causal().block_info(64, 64, 16, 16)
    assert info.num_partial == 4 and info.tiles.shape[0] == 1


def test_bad_masks_raise():
    with pytest.raises(ValueError, match="LocalWindow size"):
        LocalWindow(0)
    with pytest.raises(ValueError, match="Strided stride"):
        Strided(-2)
    with pytest.raises(ValueError, match="LocalWindow size"):
        LocalWindow(True)
    with pytest.raises(ValueError, match=r"BlockSparse block sizes must be integers >= 1; got 16.0, 16"):
        BlockSparse(np.ones((2, 2), bool), block_q=16.0, block_k=16)
    with pytest.raises(ValueError, match=r"BigBird block must be an integer >= 1; got 2.5"):
        BigBird(1, 1, 1, block=2.5)
    assert LocalWindow(np.int32(3)).size == 3
    with pytest.raises(ValueError, match=r"layout \(2, 2\) does not match"):
        BlockSparse(np.ones((2, 2), bool), block_q=4, block_k=4).mask(12, 8)
    with pytest.raises(ValueError, match="num_global=9 is larger than the sequence kv_len=8"):
        (Causal() & BigBird(9, 1, 0)).block_info(8, 8, 16, 16)
    for other in (3, None, np.ones((4, 4), bool)):  # refused at the operator, not deep inside the kernel
        with pytest.raises(ValueError, match=f"Mask & {type(other).__name__}: accepted: a jmem.kernels.masks.Mask"):
            Causal() & other
        with pytest.raises(ValueError, match=f"Mask \\| {type(other).__name__}: accepted"):
            LocalWindow(2) | other
    with pytest.raises(ValueError, match="BlockSparse layout must be a non-empty 2-D bool array; got ragged rows"):
        BlockSparse([[1, 0], [1]], 16, 16)
    for layout, what in (([["0", "1"]], r"<U1 values \('0', ...\)"),  # each counted as True before
                         ([[0.0, np.nan]], "the value nan"), ([[1, -1]], "the value -1"),
                         ([[True, None]], r"object values \('True', ...\)")):
        with pytest.raises(ValueError, match=f"BlockSparse layout holds {what}; accepted: booleans, or numbers 0 "
                                             "and 1"):
            BlockSparse(layout, 16, 16)
    for same in (np.array([[1, 0]], np.int8), np.array([[1.0, 0.0]]), jnp.array([[1.0, 0.0]], jnp.bfloat16)):
        assert BlockSparse(same, 16, 16) == BlockSparse([[True, False]], 16, 16)
    for q_len in (-3, 2.5, 0):
        with pytest.raises(ValueError, match=f"mask needs integers q_len >= 1 and kv_len >= 1; got q_len={q_len}"):
            sparse_attention_stats(Causal(), q_len, 16)


def test_block_info_refuses_a_block_size_below_one():
    for kw, name in ((dict(block_q=0, block_k=16), "block_q=0"), (dict(block_q=16, block_k=-1), "block_k=-1"),
                     (dict(block_q=16, block_k=2.0), "block_k=2.0")):
        with pytest.raises(ValueError, match=rf"^Causal.block_info: {name}; accepted: an integer >= 1$"):
            Causal().block_info(10, 10, **kw)
    assert Causal().block_info(10, 10, 16, 16) is not None
