"""On-chip (VMEM) budget of the sparse kernel on TPU, checked before lowering.

The block-sparse kernel (like the GPU body of the flash kernel) keeps whole
rows of one head on chip: the forward and dq programs hold all of one kv
head's K and V ([kv_len, head_dim] each), the dk/dv program all of one
kv-head group's Q and dO ([G, q_len, head_dim] each, G = q_heads // kv_heads).
Mosaic double-buffers every block and pads head_dim to 128 lanes, and its
scoped VMEM is 16 MiB by default, so the bound is roughly

    forward, dq:  4 * kv_len * roundup(head_dim, 128) * itemsize        <= 16 MiB
    dk/dv:        6 * G * q_len * roundup(head_dim, 128) * itemsize     <= 16 MiB

In bf16 at head_dim 128 (and below: head_dim is padded to 128 lanes) that
is kv_len below 16k for the forward pass and G * q_len up to about 10k for
training: G=1 reaches q_len 8k, G=4 (Llama's 32 query / 8 kv heads) 2k, G=8
1k (lengths in powers of two). f32 halves these. The factors come from
libtpu's reported allocations (AOT compiles for v5e of the whole-row flash
body, which the sparse kernel shares: 16.12 MiB for the forward at kv_len
16384, 24.12 MiB for dk/dv at G=4, q_len 4096, head_dim 64 or 128 in bf16,
twice that in f32); the dk/dv blocks cost three buffers' worth of Q and dO
there, not two. The estimate errs towards refusing: a shape it accepts
compiles, one at the edge it refuses may also have compiled.

When the platform compiled for is a TPU (`jmem.kernels.dispatch.target_platform`),
`sparse_attention` raises a ValueError for shapes over the budget. The flash
kernel has no such bound on TPU: its TPU body streams tiles through the grid
(`jmem.kernels.flash_attention.streaming`).
"""

from __future__ import annotations

import jax.numpy as jnp

SCOPED_VMEM_BYTES = 16 * 2**20  # Mosaic's default scoped VMEM limit (v5e)
LANES = 128
_BUFFERS = 2  # Pallas double-buffers each block
_DKDV_GROUP_BUFFERS = 3  # measured: the [G, T, D] Q and dO blocks of dk/dv cost three buffers each


def _lanes(n: int) -> int:
    return -(-n // LANES) * LANES


def _padded(n: int, block: int) -> int:
    return -(-n // block) * block


def whole_row_bytes(q_shape, k_shape, dtype, block_q: int, block_k: int, extra_per_program: int = 0) -> int:
    """Estimated VMEM of the largest forward, dq and dk/dv program of a whole-row body (sparse, GPU flash).

    Args:
        q_shape: [batch, q_len, q_heads, head_dim].
        k_shape: [batch, kv_len, kv_heads, head_dim].
        dtype: q/k/v dtype.
        block_q, block_k: the tile sizes the kernel uses (after shrinking for short sequences).
        extra_per_program: bytes every program also holds (the sparse kernel's mask tiles).

    Returns:
        Bytes.
    """
    _, T, H, D = q_shape
    S, K = k_shape[1], k_shape[2]
    G = H // max(K, 1)
    e = jnp.dtype(dtype).itemsize
    row = _lanes(D) * e
    T_pad, S_pad = _padded(T, block_q), _padded(S, block_k)
    lse_block = block_q * LANES * 4  # f32 [bq, 1], lane padded
    # Forward: q, o [bq, D], lse; dq: q, do, dq [bq, D], lse, delta; both with all of K and V.
    rows_fwd = _BUFFERS * (2 * S_pad * row + 2 * block_q * row + lse_block)
    rows_dq = _BUFFERS * (2 * S_pad * row + 3 * block_q * row + 2 * lse_block)
    # dk/dv: the group's Q and dO [G, T, D], lse and delta [G, T, 1], k, v, dk, dv [bk, D].
    group = _DKDV_GROUP_BUFFERS * 2 * G * T_pad * row + _BUFFERS * (2 * G * T_pad * 4 + 4 * block_k * row)
    return max(rows_fwd, rows_dq, group) + extra_per_program


def sparse_bytes(q_shape, k_shape, dtype, block_q: int, block_k: int, num_tiles: int) -> int:
    """`whole_row_bytes` plus the sparse kernel's table of partial-tile masks (i32[num_tiles, bq, bk], on chip)."""
    tiles = _BUFFERS * max(num_tiles, 1) * block_q * _lanes(block_k) * 4
    return whole_row_bytes(q_shape, k_shape, dtype, block_q, block_k, extra_per_program=tiles)


def check(name: str, q_shape, k_shape, dtype, nbytes: int) -> None:
    """ValueError when compiling for TPU and `nbytes` exceeds the scoped VMEM; nothing on other platforms.

    Args:
        name: the public entry point, for the message.
        q_shape, k_shape: [batch, len, heads, head_dim] of q and k.
        dtype: q's dtype.
        nbytes: the estimate (`sparse_bytes`).
    """
    from jmem.kernels.dispatch import target_platform

    if target_platform() != "tpu" or nbytes <= SCOPED_VMEM_BYTES:
        return
    _, T, H, D = q_shape
    S, K = k_shape[1], k_shape[2]
    raise ValueError(
        f"{name}: q_len={T}, kv_len={S}, GQA group size G=q_heads/kv_heads={H}/{K}={H // K}, head_dim={D} "
        f"({jnp.dtype(dtype).name}) needs about {nbytes / 2**20:.1f} MiB of TPU VMEM per program, over the "
        f"{SCOPED_VMEM_BYTES // 2**20} MiB scoped limit; the kernel holds a kv head's whole K/V and a group's "
        f"whole Q/dO on chip (about 4*kv_len and 6*G*q_len rows of roundup(head_dim, 128) elements). Accepted: "
        "shorter sequences or a smaller G, or flash_attention / attention(), whose TPU kernel streams tiles"
    )
