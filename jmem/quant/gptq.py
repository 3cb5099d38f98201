"""GPTQ (Frantar et al. 2023): column-by-column quantization with Hessian-based error feedback.

For one linear layer with calibration inputs X (tokens x in) the layer-wise
objective `||X W - X Q||^2` has Hessian `H = 2 X^T X`. Columns of the
`[out, in]` view of W (one per input feature) are quantized in order; the
rounding error of column i, divided by `[H^-1]_ii`, is pushed onto the
not-yet-quantized columns through row i of the upper Cholesky factor of H^-1.
Updates are applied lazily per block of 128 columns, so the large rank-128
update is one matmul.

The column loop and the Cholesky factorisation of the dampened Hessian run
compiled in float32, as in the paper's implementation (`jax.lax.fori_loop`);
a plain NumPy loop beside it is the reference it is tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg  # noqa: F401  (cho_solve)
import numpy as np

from jmem.checks import check_bool, is_int, is_number
from jmem.quant.qtensor import (IntTensor, check_finite, check_group_size, check_scale_range, check_weight_shape,
                                group_params)

BLOCK = 128
DAMP = 0.01


def hessian(x) -> np.ndarray:
    """`2 X^T X / n` (f64[in, in]) from inputs `x[..., in]`; the 1/n keeps the dampening scale-free."""
    if np.ndim(x) == 0:
        raise ValueError(f"GPTQ calibration inputs of shape {np.shape(x)}; accepted: an array x[..., in]")
    if np.shape(x)[0] == 0 or np.size(x) == 0:
        raise ValueError("GPTQ needs at least one calibration token; got an empty input")
    x2 = jnp.asarray(x, jnp.float32).reshape(-1, np.shape(x)[-1])
    h = jnp.matmul(x2.T, x2, precision=jax.lax.Precision.HIGHEST)
    return 2.0 * np.asarray(h, np.float64) / x2.shape[0]


_group_params = jax.jit(group_params, static_argnums=(1, 2, 3))


def _grid(w_rows: np.ndarray, bits: int, symmetric: bool):
    """Scale and zero point (f32[out]) for one group, from its columns `w_rows[out, g]`."""
    s, z = _group_params(np.ascontiguousarray(w_rows.T), bits, w_rows.shape[1], symmetric)
    s = np.asarray(s)[0]
    z = np.full_like(s, 2 ** (bits - 1)) if z is None else np.asarray(z)[0]
    return s, z


def gptq_quantize(w, h: np.ndarray, bits: int = 4, group_size: int | None = 128, symmetric: bool = True,
                  act_order: bool = False, damp: float = DAMP, block: int = BLOCK,
                  reference: bool = False) -> IntTensor:
    """Quantize one float weight `w[in, out]` given its input Hessian `h[in, in]`.

    Args:
      w: float[in, out] (the layer computes `x @ w`).
      h: f64[in, in], e.g. `hessian(x)` for calibration inputs x[..., in];
        finite and not all zero. Zero diagonal entries (dead input
        channels) are allowed: those columns quantize to 0.
      bits: 2, 3, 4 or 8.
      group_size: input rows per scale (a divisor of `in`, multiple of 8) or
        None for per channel.
      symmetric: scale only, or scale plus zero point per group.
      act_order: quantize columns by decreasing Hessian diagonal. Group
        parameters are then fixed up front from the original weight, so the
        stored groups stay contiguous in the original order.
      damp: fraction of the mean Hessian diagonal added to the diagonal, a
        finite number >= 0. Dead channels take that mean as their diagonal,
        so scaling the calibration inputs changes nothing.
      block: columns per lazy batch update, a positive integer (whole
        groups; the compiled loop uses the nearest size that divides `in`).
      reference: run the plain NumPy loop instead of the compiled one.

    Returns:
      An `IntTensor` [in, out].

    Example:
        >>> q = gptq_quantize(w, hessian(x_calib), bits=4, group_size=128)
    """
    check_weight_shape(w, "gptq_quantize")  # a float array: integer weights would round to integers
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"gptq_quantize takes one [in, out] matrix; got shape {w.shape}")
    n_in, n_out = w.shape
    group_size = check_group_size(n_in, group_size, bits)
    if np.shape(h) != (n_in, n_in):
        raise ValueError(f"Hessian shape {np.shape(h)} does not match the weight's input dimension {n_in}")
    check_bool("symmetric", symmetric)
    check_bool("act_order", act_order)
    if not (is_number(damp) and np.isfinite(damp) and damp >= 0):
        raise ValueError(f"damp={damp!r}; accepted: a finite number >= 0 (a fraction of the mean Hessian diagonal)")
    if not is_int(block) or block < 1:
        raise ValueError(f"block={block!r}; accepted: a positive integer (columns per lazy update)")
    check_finite(w, "the weight w")
    check_scale_range(w, bits, group_size, symmetric, "the weight w")
    check_finite(h, "the Hessian h", accepted="a finite Hessian (hessian(x) of finite calibration inputs)")
    if not np.any(np.diag(np.asarray(h))):
        raise ValueError("the Hessian h is all zero on its diagonal (the calibration inputs are all zero: no "
                         "calibration signal); accepted: a Hessian with some non-zero diagonal entries, i.e. "
                         "hessian(x) of calibration inputs that are not all zero")

    W = w.astype(np.float32).T.copy()  # [out, in]: one column per input feature
    H = np.array(h, np.float64, copy=True)
    if np.any(np.diag(H) < 0):
        raise ValueError("the Hessian h has negative diagonal entries; accepted: a positive semi-definite "
                         "Hessian, e.g. hessian(x) of the calibration inputs")
    dead = np.diag(H) == 0
    H[dead, dead] = np.mean(np.diag(H)[~dead])  # the scale of the live channels, not a constant
    W[:, dead] = 0.0

    n_groups = n_in // group_size
    scales = np.zeros((n_groups, n_out), np.float32)
    zeros = np.full((n_groups, n_out), 2 ** (bits - 1), np.float32)
    if act_order:  # group grid from the original weight, before any error feedback
        s, z = _group_params(np.ascontiguousarray(W.T), bits, group_size, symmetric)
        scales = np.asarray(s)
        zeros = zeros if z is None else np.asarray(z)

    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(n_in)
    W = W[:, perm]
    H = H[np.ix_(perm, perm)]
    H[np.diag_indices(n_in)] += damp * np.mean(np.diag(H))
    Hinv = np.asarray(_inverse_cholesky(jnp.asarray(H, jnp.float32)))
    if not np.all(np.isfinite(Hinv)):
        raise ValueError("GPTQ: the dampened Hessian is not positive definite; raise `damp` (now "
                         f"{damp}) or give more calibration tokens")
    group_of = (perm // group_size).astype(np.int32)

    if reference:
        Q, scales, zeros = _columns_numpy(W, Hinv, scales, zeros, group_of, bits, group_size, symmetric,
                                          not act_order, _block_size(n_in, group_size, block, ragged=True))
    else:
        Q, scales, zeros = _columns_jax(W, Hinv, scales, zeros, group_of, bits=bits, group_size=group_size,
                                        symmetric=symmetric, dynamic_groups=not act_order,
                                        block=_block_size(n_in, group_size, block, ragged=False))
    u = np.empty((n_out, n_in), np.int32)
    u[:, perm] = np.asarray(Q)
    return IntTensor.from_codes(u.T, np.asarray(scales), None if symmetric else np.asarray(zeros), bits, w.dtype)


@jax.jit
def _inverse_cholesky(H):
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U): row i holds the update coefficients of column i.

    float32, as in the GPTQ paper's implementation; the 1% dampening keeps it well conditioned.
    """
    L = jnp.linalg.cholesky(H)
    Hinv = jax.scipy.linalg.cho_solve((L, True), jnp.eye(H.shape[0], dtype=H.dtype))
    return jnp.linalg.cholesky(Hinv).T


def _block_size(n_in: int, group_size: int, block: int, ragged: bool) -> int:
    """Columns per lazy update: whole groups; for the compiled loop also a divisor of `n_in`."""
    if group_size >= block:
        return group_size
    b = group_size * max(1, block // group_size)
    if not ragged:
        while n_in % b:
            b -= group_size
    return b


def _columns_numpy(W, Hinv, scales, zeros, group_of, bits, group_size, symmetric, dynamic_groups, block):
    """The plain loop over columns (the reference for `_columns_jax`)."""
    n_out, n_in = W.shape
    W, scales, zeros = W.copy(), scales.copy(), zeros.copy()
    maxq, lo_code = 2 ** bits - 1, (1 if symmetric else 0)
    Q = np.zeros((n_out, n_in), np.int32)
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        W1 = W[:, i1:i2].copy()
        Err1 = np.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = group_of[col]
            if dynamic_groups and col % group_size == 0:
                scales[g], zeros[g] = _grid(W1[:, i:i + group_size], bits, symmetric)
            s, z = scales[g], zeros[g]
            q = np.clip(np.round(W1[:, i] / s) + z, lo_code, maxq)
            Q[:, col] = q
            err = (W1[:, i] - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= np.outer(err, Hinv1[i, i:])
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q, scales, zeros


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "dynamic_groups", "block"))
def _columns_jax(W, Hinv, scales, zeros, group_of, *, bits, group_size, symmetric, dynamic_groups, block):
    """The same loop compiled: blocks of `block` columns, each column's error pushed right.

    Hinv is upper triangular, so `outer(err, Hinv[i])` leaves the columns left
    of i untouched and no masking is needed inside a block.
    """
    n_out, n_in = W.shape
    maxq, lo_code = 2 ** bits - 1, (1 if symmetric else 0)
    hi = jax.lax.Precision.HIGHEST

    def grid(cols):
        s, z = group_params(cols.T, bits, group_size, symmetric)
        z = jnp.full_like(s, 2 ** (bits - 1)) if z is None else z
        return s[0], z[0]

    def block_body(b, carry):
        W, Q, scales, zeros = carry
        i1 = b * block
        W1 = jax.lax.dynamic_slice(W, (0, i1), (n_out, block))
        Hinv1 = jax.lax.dynamic_slice(Hinv, (i1, i1), (block, block))

        def col_body(i, c):
            W1, Q1, Err1, scales, zeros = c
            col = i1 + i
            g = group_of[col]
            if dynamic_groups:
                def new_grid(sz):
                    s, z = grid(jax.lax.dynamic_slice(W1, (0, i), (n_out, group_size)))
                    return sz[0].at[g].set(s), sz[1].at[g].set(z)
                scales, zeros = jax.lax.cond(col % group_size == 0, new_grid, lambda sz: sz, (scales, zeros))
            s, z = scales[g], zeros[g]
            w = W1[:, i]
            q = jnp.clip(jnp.round(w / s) + z, lo_code, maxq)
            err = (w - (q - z) * s) / Hinv1[i, i]
            W1 = W1 - err[:, None] * Hinv1[i][None, :]
            return W1, Q1.at[:, i].set(q.astype(jnp.int32)), Err1.at[:, i].set(err), scales, zeros

        init = (W1, jnp.zeros((n_out, block), jnp.int32), jnp.zeros_like(W1), scales, zeros)
        W1, Q1, Err1, scales, zeros = jax.lax.fori_loop(0, block, col_body, init)
        rows = jax.lax.dynamic_slice(Hinv, (i1, 0), (block, n_in))
        later = (jnp.arange(n_in) >= i1 + block)[None, :]
        W = W - jnp.where(later, jnp.matmul(Err1, rows, precision=hi), 0.0)
        W = jax.lax.dynamic_update_slice(W, W1, (0, i1))
        Q = jax.lax.dynamic_update_slice(Q, Q1, (0, i1))
        return W, Q, scales, zeros

    Q = jnp.zeros((n_out, n_in), jnp.int32)
    _, Q, scales, zeros = jax.lax.fori_loop(0, n_in // block, block_body, (W, Q, scales, zeros))
    return Q, scales, zeros
