"""AWQ (Lin et al. 2024): activation-aware scaling, then clip search, then round-to-nearest.

Input channels with large activations matter more. Multiplying row i of W by
`s_i > 1` and dividing the input feature by `s_i` leaves `x @ W` unchanged in
float but shrinks the relative rounding error of those rows. The scale is
`s = mean|x|^alpha` (normalised by `sqrt(max(s) * min(s))`), with alpha picked
from a grid by the output error of the quantized layers that share the input.
In a model the `1/s` is folded into the op that produces the input (an RMSNorm
or a linear layer; see `jmem.quant.api`); a standalone matrix keeps it in an
`InputScaled` leaf. A second search then shrinks each group's range (clip)
where that lowers the output error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from jmem.checks import check_bool, is_int, is_number
from jmem.models.dot import partition_specs
from jmem.quant.qtensor import (IntTensor, QTensor, check_finite, check_group_size, check_weight_shape, encode,
                                group_params)

N_GRID = 20
CLIP_GRID = 20
CLIP_MAX_SHRINK = 0.5
SEARCH_TOKENS = 4096
CLIP_TOKENS = 512


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def fake_quant(w, bits: int, group_size: int, symmetric: bool, clip=None):
    """Round-to-nearest quantize and dequantize `w[in, out]` in f32 (the search's inner step)."""
    scale, zero = group_params(w, bits, group_size, symmetric, clip)
    u = encode(w, scale, zero, bits).astype(jnp.float32)
    n_in, n_out = w.shape
    z = 2.0 ** (bits - 1) if zero is None else zero[:, None, :]
    wg = (u.reshape(-1, group_size, n_out) - z) * scale[:, None, :]
    return wg.reshape(n_in, n_out)


def _subsample(x, n: int, seed: int = 0, n_in: int | None = None) -> jax.Array:
    if n_in is not None and (np.ndim(x) < 1 or np.shape(x)[-1] != n_in):
        raise ValueError(f"x has {np.shape(x)[-1] if np.ndim(x) else 'no'} input features (its last axis, shape "
                         f"{np.shape(x)}) but the weight has {n_in} input rows; accepted: x[..., {n_in}]")
    x = jnp.asarray(x, jnp.float32).reshape(-1, np.shape(x)[-1])
    if x.shape[0] == 0:
        raise ValueError("AWQ needs at least one calibration token; got an empty input")
    if x.shape[0] > n:
        idx = np.random.default_rng(seed).choice(x.shape[0], n, replace=False)
        x = x[np.sort(idx)]
    return x


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "n_grid"))
def _scale_search(x, w_cat, x_mean, bits, group_size, symmetric, n_grid):
    ref = x @ w_cat

    def loss_for(alpha):
        s = jnp.maximum(x_mean ** alpha, 1e-4)  # as AutoAWQ: a dead channel's 0 ** alpha would be 0 (1e-8 before
        s = s / jnp.sqrt(s.max() * s.min())  # the power spread s over 11 decades and scaled w past f16)
        wq = fake_quant(w_cat * s[:, None], bits, group_size, symmetric) / s[:, None]
        return jnp.mean((x @ wq - ref) ** 2), s

    alphas = jnp.arange(n_grid, dtype=jnp.float32) / n_grid
    losses, scales = jax.lax.map(loss_for, alphas)
    # A scale whose grid overflows has a NaN loss, which argmin would pick; alpha 0 (s = 1) stays finite.
    return scales[jnp.argmin(jnp.where(jnp.isfinite(losses), losses, jnp.inf))], losses


def awq_scale(x, ws, bits: int = 4, group_size: int | None = 128, symmetric: bool = True,
              n_grid: int = N_GRID, x_mean=None) -> jax.Array:
    """Search the per-input-channel scale `s` (f32[in]) for linears `ws` ([in, out_j]) sharing input `x`.

    Args:
      x: float[..., in] calibration inputs of the linears.
      ws: list of float[in, out_j] weights that all read `x`.
      bits, group_size, symmetric: the quantization the scale is searched for (as `awq_quantize`).
      n_grid: exponents alpha = 0, 1/n_grid, ... tried for s = mean|x|^alpha.
      x_mean: optional f32[in] activation magnitude to use instead of
        mean|x| (e.g. tied across grouped-query heads).

    Returns:
      s: f32[in]; use `w * s[:, None]` and `x / s`.
    """
    _check_grid(n_grid)
    check_bool("symmetric", symmetric)  # None or 0 searched for the zero-point grid
    if not isinstance(ws, (list, tuple)):
        raise ValueError(f"ws of type {type(ws).__name__}; accepted: a list of weights [in, out_j] that read x")
    for i, w in enumerate(ws):
        check_finite(w, f"the weight ws[{i}]")
    check_finite(x, "the calibration inputs x", accepted="finite calibration inputs")
    rows = sorted({np.shape(w)[0] for w in ws})
    if not rows:
        raise ValueError("ws is empty; accepted: one or more weights [in, out_j] that read x")
    if len(rows) > 1:
        raise ValueError(f"ws have different input dimensions {rows}; accepted: weights [in, out_j] that all read x "
                         "(one input dimension)")
    x = _subsample(x, SEARCH_TOKENS, n_in=rows[0])
    w_cat = jnp.concatenate([jnp.asarray(w, jnp.float32) for w in ws], axis=1)
    group_size = check_group_size(w_cat.shape[0], group_size, bits)
    if x_mean is None:
        x_mean = jnp.abs(x).mean(axis=0)
    elif np.shape(x_mean) != (rows[0],):
        raise ValueError(f"x_mean of shape {np.shape(x_mean)}; accepted: f32[{rows[0]}] (one activation magnitude "
                         "per input channel)")
    s, _ = _scale_search(x, w_cat, jnp.asarray(x_mean, jnp.float32), bits, group_size, symmetric, n_grid)
    return s


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "n_grid", "max_shrink"))
def _clip_search(x, w, bits, group_size, symmetric, n_grid, max_shrink):
    n_in, n_out = w.shape
    n_groups = n_in // group_size
    xg = x.reshape(x.shape[0], n_groups, group_size)
    ref = jnp.einsum("ngk,gko->ngo", xg, w.reshape(n_groups, group_size, n_out))

    def err_for(ratio):
        wq = fake_quant(w, bits, group_size, symmetric, jnp.full((n_groups, n_out), ratio))
        out = jnp.einsum("ngk,gko->ngo", xg, wq.reshape(n_groups, group_size, n_out))
        return jnp.mean((out - ref) ** 2, axis=0)  # [G, out]

    n_steps = max(1, int(round(max_shrink * n_grid)))
    ratios = 1.0 - jnp.arange(n_steps, dtype=jnp.float32) / n_grid
    errs = jax.lax.map(err_for, ratios)  # [steps, G, out]
    return ratios[jnp.argmin(errs, axis=0)]


def awq_clip(x, w, bits: int = 4, group_size: int | None = 128, symmetric: bool = True,
             n_grid: int = CLIP_GRID, max_shrink: float = CLIP_MAX_SHRINK) -> jax.Array:
    """Per-group range factors f32[in/group_size, out] in (1 - max_shrink, 1] minimising each group's output error."""
    _check_grid(n_grid)
    check_bool("symmetric", symmetric)
    if not is_number(max_shrink) or not 0 < max_shrink <= 1:
        raise ValueError(f"max_shrink={max_shrink!r}; accepted: a number in (0, 1] (the largest fraction of a "
                         "group's range the clip search may cut)")
    check_finite(w, "the weight w")
    check_finite(x, "the calibration inputs x", accepted="finite calibration inputs")
    w = jnp.asarray(w, jnp.float32)
    group_size = check_group_size(w.shape[0], group_size, bits)
    x = _subsample(x, CLIP_TOKENS, seed=1, n_in=w.shape[0])
    return _clip_search(x, w, bits, group_size, symmetric, n_grid, max_shrink)


def _check_grid(n_grid) -> None:
    if not is_int(n_grid) or n_grid < 1:
        raise ValueError(f"n_grid={n_grid!r}; accepted: a positive integer (grid points searched)")


@jax.tree_util.register_pytree_node_class
class InputScaled(QTensor):
    """`x @ W == (x * inv_scale) @ inner`: AWQ's scale kept beside a weight with no op to fold into.

    Children: inner (a weight leaf [..., in, out]); inv_scale f32[..., in].
    """

    def __init__(self, inner, inv_scale):
        self.inner, self.inv_scale = inner, inv_scale

    def tree_flatten(self):
        return (self.inner, self.inv_scale), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self):
        return self.inner.shape

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + int(np.prod(self.inv_scale.shape)) * self.inv_scale.dtype.itemsize

    def dequantize(self, dtype=None):
        w = self.inner.dequantize(jnp.float32) * self.inv_scale[..., :, None]
        return w.astype(self.dtype if dtype is None else dtype)

    def __jmem_partition__(self, lead, rows, cols, row_pieces):
        """The inner weight as it splits; the input scales with the input rows."""
        return InputScaled(partition_specs(self.inner, lead, rows, cols, row_pieces), P(*lead, rows))

    def __jmem_dot__(self, x):
        return self.inner.__jmem_dot__((x * self.inv_scale.astype(x.dtype)).astype(x.dtype))


def awq_quantize(w, x, bits: int = 4, group_size: int | None = 128, symmetric: bool = True,
                 clip: bool = True) -> InputScaled:
    """AWQ for one standalone matrix `w[in, out]` with calibration inputs `x[..., in]`.

    Example:
        >>> q = awq_quantize(w, x_calib, bits=4, group_size=128)
        >>> y = jmem.models.dot.dot(x, q)
    """
    check_weight_shape(w, "awq_quantize")  # a float array: integer weights would round to integers
    check_bool("clip", clip)  # "no" clipped
    check_finite(w, "the weight w")  # x is checked by awq_scale
    dtype = jnp.asarray(w).dtype
    w = jnp.asarray(w, jnp.float32)
    s = awq_scale(x, [w], bits, group_size, symmetric)
    ws = w * s[:, None]
    c = awq_clip(jnp.asarray(x, jnp.float32) / s, ws, bits, group_size, symmetric) if clip else None
    return InputScaled(IntTensor.quantize(ws, bits, group_size, symmetric, clip=c).with_dtype(dtype), 1.0 / s)
