"""Block-sparse attention in Pallas: only non-empty tiles are visited, only partial ones masked.

The mask's block metadata (`jmem.kernels.masks.BlockInfo`) is turned, once per
shape in numpy, into index lists: for each query block, its non-empty key
blocks ordered full-first then partial, with the id of each partial tile's mask
in a deduplicated tile table. The forward and dq kernels loop over their query
block's list; the dk/dv kernel loops over the transposed list of its key block.
Loop trip counts come from the lists, so empty tiles cost nothing, and the
forward kernel counts what it visits so tests can check the skipping.

The lists are read as scalars: from SMEM on TPU, from global memory under
Triton. `flash_attention.kernel.per_platform` picks the memory space (and the
backend's compiler parameters) at lowering time, so one traced function
compiles for either backend.

On-chip memory: the bodies here, which Triton runs, stage the whole K/V of a
head (forward, dq) or the whole Q/dO of a kv-head group (dk/dv) and loop over
the visited tiles inside one program. On TPU that would bound the sequence
length by VMEM, so TPU runs the bodies of `streaming.py`, which fetch only the
visited tiles through the grid (scalar-prefetched lists in the BlockSpec index
maps). On GPU, head_dim is zero-padded to a power of two inside the call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jmem.kernels.flash_attention import kernel as fk
from jmem.kernels.masks import EMPTY, FULL, Mask
from jmem.kernels.scale import split_scale
from jmem.kernels.sparse_attention import streaming

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
# Key tiles come from data-dependent indices, so Triton's multi-stage prefetch buys little
# and its extra shared-memory buffers (with the mask tile) overflow an H200's 227 KiB at 128x128.
_GPU_STAGES = 1


@dataclasses.dataclass(frozen=True)
class SparseStats:
    """Tile counts of one mask at one shape and tiling (per batch row and head).

    Attributes:
        num_blocks: all (q_block, k_block) tiles.
        nonempty: tiles with at least one visible (query, key) pair.
        full: tiles entirely visible (computed without a mask).
        partial: non-empty tiles that need their mask.
        visited: tiles the kernel visits; equals `nonempty`.
        density: nonempty / num_blocks.
        block_q, block_k: the tile sizes used.
    """

    num_blocks: int
    nonempty: int
    full: int
    partial: int
    visited: int
    density: float
    block_q: int
    block_k: int


@dataclasses.dataclass(frozen=True)
class _Lists:
    """Index lists for one mask and tiling (numpy, int32, flattened for SMEM)."""

    kv_counts: np.ndarray  # [nq * 2]: (n_full, n_total) per q block
    kv_blocks: np.ndarray  # [nq * max_n]: key block of the t-th visit
    kv_tiles: np.ndarray  # [nq * max_n]: tile id (-1: full)
    max_n: int
    q_counts: np.ndarray  # [nk * 2]: (n_full, n_total) per k block
    q_blocks: np.ndarray  # [nk * max_m]
    q_tiles: np.ndarray  # [nk * max_m]
    max_m: int
    tiles: np.ndarray  # int32[num_unique, bq, bk]


def _order(status_row, tile_row):
    """Non-empty blocks of one row, full first; with their tile ids."""
    full = np.nonzero(status_row == FULL)[0]
    part = np.nonzero((status_row != EMPTY) & (status_row != FULL))[0]
    blocks = np.concatenate([full, part])
    return len(full), blocks, tile_row[blocks]


def _flatten(rows, width):
    counts = np.array([[n_full, len(b)] for n_full, b, _ in rows], np.int32).reshape(-1)
    blocks = np.zeros((len(rows), width), np.int32)
    tiles = np.full((len(rows), width), -1, np.int32)
    for r, (_, b, t) in enumerate(rows):
        blocks[r, : len(b)], tiles[r, : len(t)] = b, t
    return counts, blocks.reshape(-1), tiles.reshape(-1)


@functools.lru_cache(maxsize=64)
def _lists(mask: Mask, q_len: int, kv_len: int, block_q: int, block_k: int) -> _Lists:
    info = mask.block_info(q_len, kv_len, block_q, block_k)
    rows = [_order(info.status[r], info.tile_id[r]) for r in range(info.status.shape[0])]
    cols = [_order(info.status[:, c], info.tile_id[:, c]) for c in range(info.status.shape[1])]
    max_n = max(1, max(len(b) for _, b, _ in rows))
    max_m = max(1, max(len(b) for _, b, _ in cols))
    kv = _flatten(rows, max_n)
    qq = _flatten(cols, max_m)
    return _Lists(*kv, max_n, *qq, max_m, info.tiles.astype(np.int32))


def _blocks(block_q, block_k, q_len, kv_len, name="sparse_attention"):
    return (fk.effective_block(block_q, q_len, f"{name}: block_q"),
            fk.effective_block(block_k, kv_len, f"{name}: block_k"))


def _check_mask(name: str, mask, q_len, kv_len) -> None:
    if not isinstance(mask, Mask):
        raise ValueError(f"{name}: mask must be a jmem.kernels.masks.Mask (e.g. Causal() & LocalWindow(256)); got {type(mask).__name__}")
    mask.check(q_len, kv_len)


def sparse_attention_stats(mask: Mask, q_len: int, kv_len: int, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K) -> SparseStats:
    """Tile counts `sparse_attention` will use for this mask and shape.

    Example:
        >>> s = sparse_attention_stats(Causal() & LocalWindow(256), 4096, 4096)
        >>> s.visited, s.num_blocks
        (93, 1024)
    """
    _check_mask("sparse_attention_stats", mask, q_len, kv_len)  # before the block sizes are fitted to the lengths
    bq, bk = _blocks(block_q, block_k, q_len, kv_len, "sparse_attention_stats")
    info = mask.block_info(q_len, kv_len, bq, bk)
    return SparseStats(
        num_blocks=info.num_blocks,
        nonempty=info.num_nonempty,
        full=info.num_full,
        partial=info.num_partial,
        visited=info.num_nonempty,
        density=info.num_nonempty / info.num_blocks,
        block_q=bq,
        block_k=bk,
    )


@dataclasses.dataclass(frozen=True)
class _Cfg:
    mask: Mask
    sm_scale: float
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    interpret: bool
    pad_platforms: tuple[str, ...] = ()
    stream_platforms: tuple[str, ...] = ()  # platforms that run `streaming.py`'s bodies


def _fwd_kernel(counts_ref, blocks_ref, tids_ref, q_ref, k_ref, v_ref, tiles_ref, o_ref, lse_ref, visits_ref, *, cfg, max_n):
    # counts_ref [nq*2], blocks_ref/tids_ref [nq*max_n] (scalars); q_ref, o_ref [bq, D];
    # k_ref, v_ref [S_pad, D]; tiles_ref [U, bq, bk]; lse_ref [bq, 1]; visits_ref [bq, 2] i32
    i = pl.program_id(2)
    q = q_ref[...]

    def body(masked):
        def step(t, carry):
            n_seen, n_masked, inner = carry
            kb = blocks_ref[i * max_n + t]
            mask = tiles_ref[tids_ref[i * max_n + t]] != 0 if masked else None
            inner = fk.fwd_tile(q, fk.kv_tile(k_ref, kb, cfg.block_k), fk.kv_tile(v_ref, kb, cfg.block_k), inner, mask, cfg.sm_scale)
            return n_seen + 1, n_masked + int(masked), inner

        return step

    n_full, n_total = counts_ref[2 * i], counts_ref[2 * i + 1]
    zero = jnp.zeros((), jnp.int32)
    carry = lax.fori_loop(0, n_full, body(False), (zero, zero, fk.fwd_init(cfg.block_q, q.shape[-1])))
    n_seen, n_masked, inner = lax.fori_loop(n_full, n_total, body(True), carry)
    fk.fwd_finish(inner, o_ref, lse_ref)
    col = lax.broadcasted_iota(jnp.int32, visits_ref.shape, 1)
    visits_ref[...] = jnp.where(col == 0, n_seen, n_masked)


def _dq_kernel(counts_ref, blocks_ref, tids_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tiles_ref, dq_ref, *, cfg, max_n):
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def body(masked):
        def step(t, dq):
            kb = blocks_ref[i * max_n + t]
            k = fk.kv_tile(k_ref, kb, cfg.block_k)
            mask = tiles_ref[tids_ref[i * max_n + t]] != 0 if masked else None
            _, ds = fk.bwd_tile(q, k, fk.kv_tile(v_ref, kb, cfg.block_k), do, lse, delta, mask, cfg.sm_scale)
            return fk.dq_update(dq, ds, k, cfg.sm_scale)

        return step

    n_full, n_total = counts_ref[2 * i], counts_ref[2 * i + 1]
    dq = lax.fori_loop(0, n_full, body(False), jnp.zeros(q.shape, jnp.float32))
    dq = lax.fori_loop(n_full, n_total, body(True), dq)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(counts_ref, blocks_ref, tids_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tiles_ref, dk_ref, dv_ref, *, cfg, max_m, group):
    # q_ref, do_ref [G, T_pad, D]; lse_ref, delta_ref [G, T_pad, 1]; k/v/dk/dv refs [bk, D]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    bq = cfg.block_q
    n_full, n_total = counts_ref[2 * j], counts_ref[2 * j + 1]

    def per_head(g, acc):
        def body(masked):
            def step(t, acc):
                qb = blocks_ref[j * max_m + t]
                rows = pl.ds(pl.multiple_of(qb * bq, bq), bq)
                q, do = q_ref[g, rows, :], do_ref[g, rows, :]
                mask = tiles_ref[tids_ref[j * max_m + t]] != 0 if masked else None
                p, ds = fk.bwd_tile(q, k, v, do, lse_ref[g, rows, :], delta_ref[g, rows, :], mask, cfg.sm_scale)
                return fk.dkdv_update(*acc, p, ds, q, do, cfg.sm_scale)

            return step

        acc = lax.fori_loop(0, n_full, body(False), acc)
        return lax.fori_loop(n_full, n_total, body(True), acc)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, per_head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _tiles_for(platform, tiles):
    # int8 keeps Triton's pipelined shared-memory buffers small; Mosaic prefers 32-bit tiles.
    return tiles.astype(jnp.int8) if platform == "gpu" else tiles


def _scalar_specs(n_arrays, platform):
    if platform == "tpu":
        return [pl.BlockSpec(memory_space=pltpu.SMEM)] * n_arrays
    return [pl.BlockSpec()] * n_arrays


def _fwd_call(q, k, v, cfg: _Cfg):
    B, H, T, D0 = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    lists = _lists(cfg.mask, cfg.q_len, cfg.kv_len, cfg.block_q, cfg.block_k)
    tiles = jnp.asarray(lists.tiles)
    tiles_spec = pl.BlockSpec(tiles.shape, lambda b, h, i: (0, 0, 0))

    def call(platform, counts, blocks, tids, q, k, v, tiles):
        q, k, v = fk.pad_head_dim(platform, cfg.pad_platforms, q, k, v)
        if platform in cfg.stream_platforms:
            o, lse, visits = streaming.fwd_call(platform, counts, blocks, tids, q, k, v, tiles, cfg, lists.max_n)
            return o[..., :D0], lse, visits
        D = q.shape[3]
        kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, lax.div(h, jnp.int32(G)), 0, 0))
        o, lse, visits = pl.pallas_call(
            functools.partial(_fwd_kernel, cfg=cfg, max_n=lists.max_n),
            grid=(B, H, T // cfg.block_q),
            in_specs=[*_scalar_specs(3, platform), fk.row_spec(cfg.block_q, D), kv_spec, kv_spec, tiles_spec],
            out_specs=[fk.row_spec(cfg.block_q, D), fk.row_spec(cfg.block_q, 1), fk.row_spec(cfg.block_q, 2)],
            out_shape=[
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((B, H, T, 1), jnp.float32),
                jax.ShapeDtypeStruct((B, H, T, 2), jnp.int32),
            ],
            interpret=cfg.interpret,
            compiler_params=fk.compiler_params(platform, gpu_stages=_GPU_STAGES),
            name="sparse_fwd",
        )(counts, blocks, tids, q, k, v, _tiles_for(platform, tiles))
        return o[..., :D0], lse, visits

    return fk.per_platform(call, cfg.interpret, jnp.asarray(lists.kv_counts), jnp.asarray(lists.kv_blocks), jnp.asarray(lists.kv_tiles), q, k, v, tiles)


def _bwd_call(q, k, v, o, lse, do, cfg: _Cfg):
    B, H, T, D0 = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    bq, bk = cfg.block_q, cfg.block_k
    lists = _lists(cfg.mask, cfg.q_len, cfg.kv_len, bq, bk)
    tiles = jnp.asarray(lists.tiles)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    lse = jnp.where(lse == fk.NEG_INF, jnp.inf, lse)
    tiles_spec = pl.BlockSpec(tiles.shape, lambda b, h, i: (0, 0, 0))
    group_spec = lambda last: pl.BlockSpec((None, G, T, last), lambda b, h, j: (b, h, 0, 0))  # noqa: E731

    def padded(platform, q, k, v, do, *rest):
        """The arrays with head_dim padded for `platform`, and that head_dim."""
        q, k, v, do = fk.pad_head_dim(platform, cfg.pad_platforms, q, k, v, do)
        return (q, k, v, do, *rest), q.shape[3]

    def dq_call(platform, counts, blocks, tids, *arrays):
        arrays, D = padded(platform, *arrays)
        if platform in cfg.stream_platforms:
            return streaming.dq_call(platform, counts, blocks, tids, *arrays, cfg, lists.max_n)[..., :D0]
        kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, lax.div(h, jnp.int32(G)), 0, 0))
        dq = pl.pallas_call(
            functools.partial(_dq_kernel, cfg=cfg, max_n=lists.max_n),
            grid=(B, H, T // bq),
            in_specs=[*_scalar_specs(3, platform), fk.row_spec(bq, D), kv_spec, kv_spec, fk.row_spec(bq, D), fk.row_spec(bq, 1), fk.row_spec(bq, 1), tiles_spec],
            out_specs=fk.row_spec(bq, D),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            interpret=cfg.interpret,
            compiler_params=fk.compiler_params(platform, gpu_stages=_GPU_STAGES),
            name="sparse_dq",
        )(counts, blocks, tids, *arrays[:-1], _tiles_for(platform, arrays[-1]))
        return dq[..., :D0]

    def dkdv_call(platform, counts, blocks, tids, *arrays):
        arrays, D = padded(platform, *arrays)
        if platform in cfg.stream_platforms:
            dk, dv = streaming.dkdv_call(platform, counts, blocks, tids, *arrays, cfg, lists.max_m)
            return dk[..., :D0], dv[..., :D0]
        dk, dv = pl.pallas_call(
            functools.partial(_dkdv_kernel, cfg=cfg, max_m=lists.max_m, group=G),
            grid=(B, K, S // bk),
            in_specs=[*_scalar_specs(3, platform), group_spec(D), fk.row_spec(bk, D), fk.row_spec(bk, D), group_spec(D), group_spec(1), group_spec(1), tiles_spec],
            out_specs=[fk.row_spec(bk, D), fk.row_spec(bk, D)],
            out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
            interpret=cfg.interpret,
            compiler_params=fk.compiler_params(platform, gpu_stages=_GPU_STAGES),
            name="sparse_dkdv",
        )(counts, blocks, tids, *arrays[:-1], _tiles_for(platform, arrays[-1]))
        return dk[..., :D0], dv[..., :D0]

    arrays = (q, k, v, do, lse, delta, tiles)
    kv_lists = (jnp.asarray(lists.kv_counts), jnp.asarray(lists.kv_blocks), jnp.asarray(lists.kv_tiles))
    q_lists = (jnp.asarray(lists.q_counts), jnp.asarray(lists.q_blocks), jnp.asarray(lists.q_tiles))
    dq = fk.per_platform(dq_call, cfg.interpret, *kv_lists, *arrays)
    dk, dv = fk.per_platform(dkdv_call, cfg.interpret, *q_lists, *arrays)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sparse_bhtd(q, k, v, cfg):
    return _fwd_call(q, k, v, cfg)[0]


_SPARSE_GUARD = ("sparse_attention", "jmem.kernels.sparse_attention.sparse_attention_reference")


def _sparse_bhtd_fwd(q, k, v, cfg):
    o, lse, _ = fk.first_order_only(*_SPARSE_GUARD, lambda *a: _fwd_call(*a, cfg))(q, k, v)
    return o, (q, k, v, o, lse)


def _sparse_bhtd_bwd(cfg, res, do):
    return fk.first_order_only(*_SPARSE_GUARD, lambda *a: _bwd_call(*a, cfg))(*res, do)


_sparse_bhtd.defvjp(_sparse_bhtd_fwd, _sparse_bhtd_bwd)


def _config(name, q, k, v, mask, sm_scale, block_q, block_k, interpret):
    """(q, cfg): validated inputs, q with a traced sm_scale folded in (`jmem.kernels.scale`)."""
    fk.check_qkv(name, q, k, v)
    T, S, D = q.shape[1], k.shape[1], q.shape[3]
    _check_mask(name, mask, T, S)
    bq, bk = _blocks(block_q, block_k, T, S, name)
    interpret = fk.resolve_interpret(interpret)
    fk.check_kernel_dtype(name, q.dtype, interpret)
    q, scale = split_scale(name, q, sm_scale, D)
    return q, _Cfg(mask, scale, bq, bk, T, S, interpret, fk.POW2_HEAD_DIM_PLATFORMS, fk.STREAM_PLATFORMS)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _sparse_jit(q, k, v, cfg: _Cfg):
    T = q.shape[1]
    o = _sparse_bhtd(fk.to_padded_bhtd(q, cfg.block_q), fk.to_padded_bhtd(k, cfg.block_k), fk.to_padded_bhtd(v, cfg.block_k), cfg)
    return o.transpose(0, 2, 1, 3)[:, :T]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _visits_jit(q, k, v, cfg: _Cfg):
    _, _, visits_BHT2 = _fwd_call(fk.to_padded_bhtd(q, cfg.block_q), fk.to_padded_bhtd(k, cfg.block_k), fk.to_padded_bhtd(v, cfg.block_k), cfg)
    # Every row of a query block holds that block's counts; take the first row of each.
    return visits_BHT2[:, :, :: cfg.block_q].sum(axis=2)


def sparse_attention(q, k, v, mask: Mask, *, sm_scale=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, interpret=None):
    """Attention under a structured mask, visiting only the tiles the mask touches; differentiable (first
    order).

    Validation and the mask's block metadata (cached per shape) happen in Python;
    the kernel call is jitted with the mask as a static argument.

    Args:
        q: [batch, q_len, q_heads, head_dim].
        k, v: [batch, kv_len, kv_heads, head_dim]; q_heads a multiple of kv_heads.
        mask: a `jmem.kernels.masks.Mask`; it alone decides visibility (use
            `Causal() & ...` for a causal model). Rows that see no key give zeros.
        sm_scale: softmax scale; 1/sqrt(head_dim) when None. A Python/NumPy/JAX
            scalar, or a traced one (folded into q, see `jmem.kernels.scale`).
        block_q, block_k: tile sizes (powers of two >= 16), shrunk for short sequences.
        interpret: run in the Pallas interpreter; None picks it on CPU.

    Returns:
        [batch, q_len, q_heads, head_dim] in q's dtype.

    Raises:
        ValueError: bad shapes, dtypes or mask.

    Any head_dim works: lowered for GPU, a head_dim that is not a power of two
    is zero-padded to the next one inside the kernel call.

    Example:
        >>> from jmem.kernels.masks import Causal, LocalWindow
        >>> o = sparse_attention(q, k, v, Causal() & LocalWindow(256))
    """
    q, cfg = _config("sparse_attention", q, k, v, mask, sm_scale, block_q, block_k, interpret)
    if q.size == 0:  # no batch rows or no heads: the kernel grid would be empty
        return jnp.zeros(q.shape, q.dtype)
    return _sparse_jit(q, k, v, cfg)


def sparse_attention_visits(q, k, v, mask: Mask, *, sm_scale=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, interpret=None):
    """Tiles the forward kernel actually visited, counted inside the kernel (arguments as `sparse_attention`).

    Returns:
        i32[batch, q_heads, 2]: (tiles visited, of which masked) per batch row and head;
        equal to `sparse_attention_stats(...)`'s (visited, partial).
    """
    q, cfg = _config("sparse_attention_visits", q, k, v, mask, sm_scale, block_q, block_k, interpret)
    if q.size == 0:
        return jnp.zeros((q.shape[0], q.shape[2], 2), jnp.int32)
    return _visits_jit(q, k, v, cfg)
