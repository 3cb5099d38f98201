"""Flash attention bodies for TPU that stream K/V (and Q/dO) tiles through the grid.

The single-source bodies in `kernel.py` keep a head's whole K/V (or a group's
whole Q/dO) on chip and loop over it inside one program, which Triton needs
(it cannot revisit an output block) but which bounds the sequence length by
TPU VMEM. Here the loop is the innermost grid axis instead ("arbitrary", so
Mosaic runs it in order on one core): each step brings one K/V tile (dk/dv:
one Q/dO tile of one group member) into VMEM, and the running softmax state
or gradient sums live in VMEM scratch until the last step writes them out.
Per-program VMEM is a few tiles, whatever the length.

Tiles a causal row block never sees are skipped with `pl.when`, and their
index maps repeat the previous block index, which Pallas does not fetch again.
The tile math is `kernel.py`'s (`fwd_tile`, `bwd_tile`, ...), so both bodies
compute the same numbers.
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


def _last_k(cfg, i):
    """Last key block query block i sees (its key tiles are [0, last])."""
    return fk._k_range(cfg, i)[1] - 1


def _first_q(cfg, j):
    """First query block that sees key block j."""
    return jnp.minimum(fk._q_range(cfg, j)[0], pl.cdiv(cfg.q_len, cfg.block_q) - 1)


def _for_key_tile(cfg, i, j, tile):
    """Run `tile(mask)` for key tile j of query block i: without a mask below the causal band, with
    one inside it, not at all past it."""
    n_full, n_total = fk._k_range(cfg, i)
    pl.when(j < n_full)(lambda: tile(None))
    pl.when((j >= n_full) & (j < n_total))(lambda: tile(fk._tile_mask(cfg, i, j)))


def _query_grid(q, k, cfg):
    """The grid (B, H, query blocks, key blocks) of the forward and dq calls, with the BlockSpec of a
    query row block (last dim `last`) and of the K/V tile each step streams in."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    bq, bk = cfg.block_q, cfg.block_k
    row = lambda last: pl.BlockSpec((None, None, bq, last), lambda b, h, i, j: (b, h, i, 0))  # noqa: E731
    kv = pl.BlockSpec((None, None, bk, D), lambda b, h, i, j: (b, lax.div(h, jnp.int32(G)), jnp.minimum(j, _last_k(cfg, i)), 0))
    return (B, H, T // bq, k.shape[2] // bk), row, kv


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, cfg, nk):
    # q_ref, o_ref [bq, D]; k_ref, v_ref [bk, D]; lse_ref [bq, 1]; scratch m, l [bq, 1], acc [bq, D] f32
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_sc[...], l_sc[...], acc_sc[...] = fk.fwd_init(cfg.block_q, acc_sc.shape[-1])

    def tile(mask):
        carry = fk.fwd_tile(q_ref[...], k_ref[...], v_ref[...], (m_sc[...], l_sc[...], acc_sc[...]), mask, cfg.sm_scale)
        m_sc[...], l_sc[...], acc_sc[...] = carry

    _for_key_tile(cfg, i, j, tile)

    @pl.when(j == nk - 1)
    def _():
        fk.fwd_finish((m_sc[...], l_sc[...], acc_sc[...]), o_ref, lse_ref)


def fwd_call(platform, q, k, v, cfg):
    """Forward: (o [B, H, T, D], lse f32[B, H, T, 1]) from padded [B, H, len, D] inputs."""
    (B, H, nq, nk), row, kv = _query_grid(q, k, cfg)
    bq, D = cfg.block_q, q.shape[-1]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, nk=nk),
        grid=(B, H, nq, nk),
        in_specs=[row(D), kv, kv],
        out_specs=[row(D), row(1)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((*q.shape[:3], 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, D), jnp.float32)],
        interpret=cfg.interpret,
        compiler_params=_params(platform),
        name="flash_fwd_stream",
    )(q, k, v)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_sc, *, cfg, nk):
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def tile(mask):
        k = k_ref[...]
        _, ds = fk.bwd_tile(q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], mask, cfg.sm_scale)
        acc_sc[...] = fk.dq_update(acc_sc[...], ds, k, cfg.sm_scale)

    _for_key_tile(cfg, i, j, tile)

    @pl.when(j == nk - 1)
    def _():
        dq_ref[...] = acc_sc[...].astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, cfg, nq, steps):
    # grid (B, K, nk, G * nq): step t visits query block t % nq of group member t // nq
    j, t = pl.program_id(2), pl.program_id(3)
    i = lax.rem(t, jnp.int32(nq))

    @pl.when(t == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def step(masked):
        def run():
            q, do = q_ref[...], do_ref[...]
            mask = fk._tile_mask(cfg, i, j) if masked else None
            p, ds = fk.bwd_tile(q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask, cfg.sm_scale)
            dk_sc[...], dv_sc[...] = fk.dkdv_update(dk_sc[...], dv_sc[...], p, ds, q, do, cfg.sm_scale)

        return run

    lo, masked_end = fk._q_range(cfg, j)
    pl.when((i >= lo) & (i < masked_end))(step(True))
    pl.when(i >= masked_end)(step(False))

    @pl.when(t == steps - 1)
    def _():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def bwd_call(platform, q, k, v, do, lse, delta, cfg):
    """Backward: (dq, dk, dv) from padded inputs; lse with +inf for empty rows, delta = rowsum(dO * O)."""
    (B, H, nq, nk), row, kv = _query_grid(q, k, cfg)
    K, G, D = k.shape[1], H // k.shape[1], q.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, nk=nk),
        grid=(B, H, nq, nk),
        in_specs=[row(D), kv, kv, row(D), row(1), row(1)],
        out_specs=row(D),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, D), jnp.float32)],
        interpret=cfg.interpret,
        compiler_params=_params(platform),
        name="flash_dq_stream",
    )(q, k, v, do, lse, delta)

    def q_index(b, h, j, t):
        return (b, h * G + lax.div(t, jnp.int32(nq)), jnp.maximum(lax.rem(t, jnp.int32(nq)), _first_q(cfg, j)), 0)

    q_rows = lambda last: pl.BlockSpec((None, None, bq, last), q_index)  # noqa: E731
    k_rows = pl.BlockSpec((None, None, bk, D), lambda b, h, j, t: (b, h, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, nq=nq, steps=G * nq),
        grid=(B, K, nk, G * nq),
        in_specs=[q_rows(D), k_rows, k_rows, q_rows(D), q_rows(1), q_rows(1)],
        out_specs=[k_rows, k_rows],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, D), jnp.float32), pltpu.VMEM((bk, D), jnp.float32)],
        interpret=cfg.interpret,
        compiler_params=_params(platform),
        name="flash_dkdv_stream",
    )(q, k, v, do, lse, delta)
    return dq, dk, dv
