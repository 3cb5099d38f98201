"""Block-sparse attention bodies for TPU that stream only the visited tiles through the grid.

The bodies in `kernel.py` keep a kv head's whole K/V (forward, dq) or a kv-head
group's whole Q/dO (dk/dv) on chip and loop over the visited tiles inside one
program, which bounds the sequence length by TPU VMEM. Here the visit loop is
the innermost grid axis ("arbitrary", run in order on one core) and the index
lists are scalar-prefetched (`PrefetchScalarGridSpec`), so each step's BlockSpec
index map names the tile the list holds for it: the t-th non-empty key block of
the query block (dk/dv: the t-th query block of one group member, per key
block), and that tile's mask. Steps past a row's count repeat its last block
index, which Pallas does not fetch again, and compute nothing. A program holds
a few tiles whatever the length, and the mask table is fetched one tile at a
time too. The tile math is the flash kernel's, as in `kernel.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jmem.kernels.flash_attention import kernel as fk


def _params(platform):
    if platform == "tpu":
        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    return None


def _visit(counts, r, t, width):
    """Flat list index of row r's t-th visit, clamped to its last visit (its first slot when empty)."""
    return r * width + jnp.maximum(jnp.minimum(t, counts[2 * r + 1] - 1), 0)


def _at_least_one_tile(tiles):
    # A mask without partial tiles has an empty table; the tile BlockSpec needs one block to point at.
    return tiles if tiles.shape[0] else jnp.zeros((1, *tiles.shape[1:]), tiles.dtype)


def _streamed_call(platform, cfg, kernel, name, grid, in_specs, out_specs, scratch, out_shape, lists, *arrays,
                   tiles):
    """`pallas_call` of a streaming body: the three index lists scalar-prefetched, then `arrays`, then the
    mask tiles."""
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        interpret=cfg.interpret,
        compiler_params=_params(platform),
        name=name,
    )(*lists, *arrays, _at_least_one_tile(tiles))


def _when_visited(counts_ref, r, t, run):
    """`run(masked)` for visit t of row r: unmasked among its full tiles, masked among its partial ones."""
    n_full, n_total = counts_ref[2 * r], counts_ref[2 * r + 1]
    pl.when(t < n_full)(lambda: run(False))
    pl.when((t >= n_full) & (t < n_total))(lambda: run(True))


def _query_grid(q, k, cfg, max_n):
    """Grid (B, H, query blocks, visits), and the BlockSpecs of a query row block (last dim `last`),
    of the visited K/V tile and of its mask tile."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    bq, bk = cfg.block_q, cfg.block_k

    def kv_index(b, h, i, t, counts, blocks, tids):
        return b, lax.div(h, jnp.int32(G)), blocks[_visit(counts, i, t, max_n)], 0

    def tile_index(b, h, i, t, counts, blocks, tids):
        return jnp.maximum(tids[_visit(counts, i, t, max_n)], 0), 0, 0

    row = lambda last: pl.BlockSpec((None, None, bq, last), lambda b, h, i, t, *_: (b, h, i, 0))  # noqa: E731
    kv = pl.BlockSpec((None, None, bk, D), kv_index)
    tile = pl.BlockSpec((None, bq, bk), tile_index)
    return (B, H, T // bq, max_n), row, kv, tile


def _fwd_kernel(counts_ref, blocks_ref, tids_ref, q_ref, k_ref, v_ref, tile_ref, o_ref, lse_ref, visits_ref,
                m_sc, l_sc, acc_sc, n_sc, *, cfg, max_n):
    # q_ref, o_ref [bq, D]; k_ref, v_ref [bk, D]; tile_ref [bq, bk]; lse_ref [bq, 1]; visits_ref, n_sc [bq, 2] i32
    i, t = pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _():
        m_sc[...], l_sc[...], acc_sc[...] = fk.fwd_init(cfg.block_q, acc_sc.shape[-1])
        n_sc[...] = jnp.zeros(n_sc.shape, jnp.int32)

    def run(masked):
        mask = tile_ref[...] != 0 if masked else None
        carry = fk.fwd_tile(q_ref[...], k_ref[...], v_ref[...], (m_sc[...], l_sc[...], acc_sc[...]), mask, cfg.sm_scale)
        m_sc[...], l_sc[...], acc_sc[...] = carry
        col = lax.broadcasted_iota(jnp.int32, n_sc.shape, 1)
        n_sc[...] += jnp.where(col == 0, 1, int(masked))  # (tiles visited, of which masked)

    _when_visited(counts_ref, i, t, run)

    @pl.when(t == max_n - 1)
    def _():
        fk.fwd_finish((m_sc[...], l_sc[...], acc_sc[...]), o_ref, lse_ref)
        visits_ref[...] = n_sc[...]


def fwd_call(platform, counts, blocks, tids, q, k, v, tiles, cfg, max_n):
    """Forward: (o, lse f32[B, H, T, 1], visits i32[B, H, T, 2]) from padded [B, H, len, D] inputs."""
    grid, row, kv, tile = _query_grid(q, k, cfg, max_n)
    bq, D = cfg.block_q, q.shape[-1]
    return _streamed_call(
        platform, cfg, functools.partial(_fwd_kernel, cfg=cfg, max_n=max_n), "sparse_fwd_stream", grid,
        [row(D), kv, kv, tile], [row(D), row(1), row(2)],
        [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, D), jnp.float32),
         pltpu.VMEM((bq, 2), jnp.int32)],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((*q.shape[:3], 1), jnp.float32),
         jax.ShapeDtypeStruct((*q.shape[:3], 2), jnp.int32)],
        (counts, blocks, tids), q, k, v, tiles=tiles)


def _dq_kernel(counts_ref, blocks_ref, tids_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tile_ref, dq_ref,
               acc_sc, *, cfg, max_n):
    i, t = pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def run(masked):
        k = k_ref[...]
        mask = tile_ref[...] != 0 if masked else None
        _, ds = fk.bwd_tile(q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], mask, cfg.sm_scale)
        acc_sc[...] = fk.dq_update(acc_sc[...], ds, k, cfg.sm_scale)

    _when_visited(counts_ref, i, t, run)

    @pl.when(t == max_n - 1)
    def _():
        dq_ref[...] = acc_sc[...].astype(dq_ref.dtype)


def dq_call(platform, counts, blocks, tids, q, k, v, do, lse, delta, tiles, cfg, max_n):
    """dq from padded inputs and the per-query-block lists; lse with +inf for empty rows."""
    grid, row, kv, tile = _query_grid(q, k, cfg, max_n)
    bq, D = cfg.block_q, q.shape[-1]
    return _streamed_call(
        platform, cfg, functools.partial(_dq_kernel, cfg=cfg, max_n=max_n), "sparse_dq_stream", grid,
        [row(D), kv, kv, row(D), row(1), row(1), tile], row(D), [pltpu.VMEM((bq, D), jnp.float32)],
        jax.ShapeDtypeStruct(q.shape, q.dtype), (counts, blocks, tids), q, k, v, do, lse, delta, tiles=tiles)


def _dkdv_kernel(counts_ref, blocks_ref, tids_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tile_ref,
                 dk_ref, dv_ref, dk_sc, dv_sc, *, cfg, max_m, steps):
    # grid (B, K, key blocks, G * max_m): step t is visit t % max_m of group member t // max_m
    j, t = pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def run(masked):
        q, do = q_ref[...], do_ref[...]
        mask = tile_ref[...] != 0 if masked else None
        p, ds = fk.bwd_tile(q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask, cfg.sm_scale)
        dk_sc[...], dv_sc[...] = fk.dkdv_update(dk_sc[...], dv_sc[...], p, ds, q, do, cfg.sm_scale)

    _when_visited(counts_ref, j, lax.rem(t, jnp.int32(max_m)), run)

    @pl.when(t == steps - 1)
    def _():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def dkdv_call(platform, counts, blocks, tids, q, k, v, do, lse, delta, tiles, cfg, max_m):
    """(dk, dv) from padded inputs and the per-key-block lists of visited query blocks."""
    B, H, _, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    bq, bk = cfg.block_q, cfg.block_k

    def q_index(b, h, j, t, counts, blocks, tids):
        return b, h * G + lax.div(t, jnp.int32(max_m)), blocks[_visit(counts, j, lax.rem(t, jnp.int32(max_m)), max_m)], 0

    def tile_index(b, h, j, t, counts, blocks, tids):
        return jnp.maximum(tids[_visit(counts, j, lax.rem(t, jnp.int32(max_m)), max_m)], 0), 0, 0

    q_rows = lambda last: pl.BlockSpec((None, None, bq, last), q_index)  # noqa: E731
    k_rows = pl.BlockSpec((None, None, bk, D), lambda b, h, j, t, *_: (b, h, j, 0))
    return _streamed_call(
        platform, cfg, functools.partial(_dkdv_kernel, cfg=cfg, max_m=max_m, steps=G * max_m), "sparse_dkdv_stream",
        (B, K, S // bk, G * max_m),
        [q_rows(D), k_rows, k_rows, q_rows(D), q_rows(1), q_rows(1), pl.BlockSpec((None, bq, bk), tile_index)],
        [k_rows, k_rows], [pltpu.VMEM((bk, D), jnp.float32), pltpu.VMEM((bk, D), jnp.float32)],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        (counts, blocks, tids), q, k, v, do, lse, delta, tiles=tiles)
