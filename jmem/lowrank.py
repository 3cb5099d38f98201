"""Low-rank factorization of linear weights: `W[in, out] ~ U[in, r] @ V[r, out]`.

A rank-r factor pair stores `r * (in + out)` numbers instead of `in * out` and
costs as many FLOPs per token, so keeping a fraction `keep` of a matrix's
parameters keeps that fraction of its bytes and matmul work.

Two ways to choose the factors:

- plain truncated SVD (Eckart-Young: the best rank-r approximation of W in
  Frobenius norm), no data needed;
- whitened by calibration inputs (SVD-LLM, Wang et al. 2024): the best rank-r
  approximation of W *as the layer uses it*, minimising `||X W - X W_r||_F`
  over the layer's own calibration inputs X. With `X^T X = L L^T`,
  `||X D||_F = ||L^T D||_F`, so `W_r = L^-T trunc_r(L^T W)`: one Cholesky and
  one SVD per matrix. Layers are factorized in order, each seeing the
  already-factorized earlier layers' activations (as GPTQ does).

The factors are one weight leaf (`LowRank`) behind `jmem.models.dot.dot`, so a
factorized model runs, jits, shards and takes LoRA adapters like any other.

Example:
    >>> small = factorize(model, keep=0.5, calibration=ids_BT)
    >>> logits, _ = small(ids_BT)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem.checks import check_bool, is_int, is_number
from jmem.models.dot import dot
from jmem.quant.qtensor import check_finite
from jmem.calibrate import STAGES, calibrate_layers, calibration_tokens, check_calibration_ids
from jmem.calibrate import linear_targets, run_layer, stack_records


class LowRank:
    """A weight leaf `[..., in, out]` stored as `u[..., in, r] @ v[r, out]`.

    Example:
        >>> w = LowRank.from_svd(w_IO, rank=16)
        >>> y = jmem.models.dot.dot(x, w)   # (x @ u) @ v
    """

    def __init__(self, u, v):
        self.u, self.v = u, v

    def tree_flatten_with_keys(self):
        k = jax.tree_util.GetAttrKey
        return ((k("u"), self.u), (k("v"), self.v)), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @classmethod
    def from_svd(cls, w, rank: int, gram=None, damp: float = 0.01) -> "LowRank":
        """The best rank-`rank` factors of `w[..., in, out]`: plain SVD, or whitened by `gram`.

        Args:
            w: float weight (leading axes, e.g. stacked layers, are batched).
            rank: kept rank, 1..min(in, out).
            gram: optional `X^T X` f64/f32 `[..., in, in]` of the layer's inputs: the factors
                then minimise `||X (w - u v)||_F` instead of `||w - u v||_F`.
            damp: added to the gram's diagonal, as a fraction of its mean diagonal (keeps
                channels the calibration never used from being singular); a finite number >= 0.

        Raises:
            ValueError: w not a float matrix or holding NaN/inf, a bad rank or damp, or a gram that is not a finite
                [..., in, in] matching w, has a mean diagonal <= 0 or is not positive definite
                after damping.
        """
        shape, dtype = getattr(w, "shape", None), getattr(w, "dtype", None)
        if shape is None or len(shape) < 2 or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            what = f"w of type {type(w).__name__}" if shape is None else f"w of shape {tuple(shape)} and dtype {dtype}"
            raise ValueError(f"{what}; accepted: a float [..., in, out] matrix (at least 2 axes)")
        check_damp(damp)
        n_in, n_out = w.shape[-2:]
        check_rank(rank, n_in, n_out)
        w64 = np.asarray(w, np.float64)
        check_finite(w64, "the weight w", lead="layer")
        if gram is None:
            u, s, vt = np.linalg.svd(w64, full_matrices=False)
            u_r = u[..., :rank] * s[..., None, :rank]
        else:
            chol = _gram_cholesky(gram, damp, tuple(w.shape))  # g = L L^T
            lt = np.swapaxes(chol, -1, -2)
            u, s, vt = np.linalg.svd(lt @ w64, full_matrices=False)
            u_r = np.linalg.solve(lt, u[..., :rank] * s[..., None, :rank])  # L^-T U_r S_r
        dtype = w.dtype
        return cls(jnp.asarray(u_r, dtype), jnp.asarray(vt[..., :rank, :], dtype))

    @property
    def rank(self) -> int:
        return self.u.shape[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.u.shape[:-1], self.v.shape[-1])

    @property
    def dtype(self):
        return self.u.dtype

    @property
    def nbytes(self) -> int:
        return int(self.u.nbytes + self.v.nbytes)

    def __getitem__(self, index) -> "LowRank":
        """Index the leading (stacked-layers) axes of both factors."""
        return LowRank(self.u[index], self.v[index])

    def dequantize(self, dtype=None) -> jax.Array:
        """The dense product `u @ v`."""
        w = jnp.matmul(self.u.astype(jnp.float32), self.v.astype(jnp.float32))
        return w.astype(self.dtype if dtype is None else dtype)

    def __jmem_dot__(self, x: jax.Array) -> jax.Array:
        return dot(dot(x, self.u), self.v)


jax.tree_util.register_pytree_with_keys_class(LowRank)


def _gram_cholesky(gram, damp: float, w_shape: tuple) -> np.ndarray:
    """L with `L L^T` = the damped gram; one ValueError for a gram of the wrong shape or not positive definite."""
    *lead, n_in, _ = w_shape
    shapes = f"[{n_in}, {n_in}]" + (f" or {[*lead, n_in, n_in]} (w's leading axes)" if lead else "")
    accepted = f"accepted: a positive semi-definite input Gram X^T X of shape {shapes}, with a positive mean diagonal"
    try:
        g = np.asarray(gram, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"gram of type {type(gram).__name__}; {accepted}") from None
    try:
        fits = g.shape[-2:] == (n_in, n_in) and np.broadcast_shapes(g.shape[:-2], tuple(lead)) == tuple(lead)
    except ValueError:
        fits = False
    if g.ndim < 2 or not fits:
        raise ValueError(f"gram of shape {g.shape} for a w of shape {w_shape}; {accepted}")
    mean_diag = np.mean(np.diagonal(g, axis1=-2, axis2=-1), axis=-1)
    if not np.all(np.isfinite(g)):
        raise ValueError(f"gram with {int(np.sum(~np.isfinite(g)))} non-finite entries; {accepted}")
    if not np.all(mean_diag > 0):
        raise ValueError(f"gram with mean diagonal {np.min(mean_diag):g}; {accepted}")
    try:
        return np.linalg.cholesky(g + damp * mean_diag[..., None, None] * np.eye(n_in))
    except np.linalg.LinAlgError:
        raise ValueError(f"gram not positive definite after damp={damp!r}; {accepted} (or a larger damp)") from None


def check_rank(rank, n_in: int, n_out: int) -> None:
    """One clear error unless `rank` is an integer in 1..min(n_in, n_out)."""
    if not is_int(rank) or not 1 <= rank <= min(n_in, n_out):
        raise ValueError(f"rank={rank!r} for a [{n_in}, {n_out}] weight; accepted: an integer in "
                         f"1..{min(n_in, n_out)}")


def check_damp(damp) -> None:
    """One clear error unless `damp` is a finite number >= 0."""
    if not is_number(damp) or not (math.isfinite(damp) and damp >= 0):
        raise ValueError(f"damp={damp!r}; accepted: a finite number >= 0 (a fraction of the gram's mean diagonal)")


def rank_for(keep: float, n_in: int, n_out: int) -> int:
    """The rank whose factors hold at most `keep` of an `[n_in, n_out]` matrix's parameters (at least 1).

    `keep` is a fraction in (0, 1].
    """
    if not is_number(keep) or not 0 < keep <= 1:
        raise ValueError(f"keep={keep!r}; accepted: the fraction of the matrix's parameters to keep, in (0, 1]")
    return max(1, math.floor(keep * n_in * n_out / (n_in + n_out)))


def _plan(model, rank, keep, targets) -> dict[str, int]:
    if (rank is None) == (keep is None):
        raise ValueError(f"give exactly one of rank={rank!r} or keep={keep!r}")
    if keep is not None and (not is_number(keep) or not 0 < keep < 1):
        raise ValueError(f"keep={keep!r}; accepted: the fraction of each matrix's parameters to keep, in (0, 1)")
    targets = linear_targets(model, targets)
    weights = model.layers.weights()
    shapes = {}
    for name in targets:
        w = weights[name]
        if not isinstance(w, jax.Array) or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"target {name!r} holds a {type(w).__name__}; accepted: float kernels "
                             "(factorize before quantizing or adding adapters)")
        shapes[name] = w.shape[-2:]
    # The largest rank whose factors store fewer numbers than each dense weight (below min(n_in, n_out)).
    most = {name: math.ceil(n_in * n_out / (n_in + n_out)) - 1 for name, (n_in, n_out) in shapes.items()}
    plan = {}
    for name, (n_in, n_out) in shapes.items():
        r = rank if rank is not None else rank_for(keep, n_in, n_out)
        if is_int(r) and r > most[name]:  # one bound over every target, not one per target in turn
            raise ValueError(f"rank={r} for {name} [{n_in}, {n_out}] stores {r * (n_in + n_out)} numbers, not fewer "
                             f"than the {n_in * n_out} of the dense weight; accepted: an integer in "
                             f"1..{min(most.values())} (for every target)")
        check_rank(r, n_in, n_out)
        plan[name] = r
    return plan


def factorize(model, rank: int | None = None, *, keep: float | None = None, targets=None, calibration=None,
              tokenizer=None, seq_len: int = 512, max_seqs: int = 32, damp: float = 0.01, inplace: bool = False,
              log=None):
    """Replace the target linear kernels of a jmem Llama model by low-rank factors.

    Args:
        model: a `jmem.models.Llama` with float kernels.
        rank: one rank for every target; or
        keep: the fraction (0, 1) of each target's parameters (and bytes, and matmul FLOPs)
            to keep; each matrix gets `rank_for(keep, in, out)`.
        targets: names among wq, wk, wv, wo, w_gate, w_up, w_down (default None: every linear the blocks
            have, the four attention linears of a mixture-of-experts model).
        calibration: optional text(s) (with `tokenizer`) or token ids `[B, T]`: factors
            whitened by each layer's own inputs (SVD-LLM), layer by layer; without it,
            plain truncated SVD.
        seq_len, max_seqs: calibration windows; damp: gram dampening (fraction of its mean diagonal,
            a finite number >= 0).
        inplace: modify `model` instead of a copy.
        log: optional callable taking one progress line per calibrated layer.

    Returns:
        The model with `LowRank` leaves in the targets' `layers.<name>.kernel`.

    Example:
        >>> small = factorize(model, keep=0.5, calibration=ids_BT)
    """
    plan = _plan(model, rank, keep, targets)
    check_damp(damp)
    check_bool("inplace", inplace)
    ids = None
    if calibration is not None:
        ids = calibration_tokens(calibration, tokenizer, seq_len, max_seqs)
        check_calibration_ids(ids, model.config.vocab_size)
    if not inplace:
        model = nnx.clone(model)
    weights = model.layers.weights()
    if ids is None:
        new = {n: LowRank.from_svd(weights[n], r) for n, r in plan.items()}
    else:
        new = _whitened(model, weights, jnp.asarray(ids), plan, damp, log)
    for name, leaf in new.items():
        getattr(model.layers, name).kernel.set_value(leaf)
    return model


def _gram(x) -> np.ndarray:
    x2 = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    return np.asarray(jnp.matmul(x2.T, x2, precision=jax.lax.Precision.HIGHEST), np.float64) / x2.shape[0]


def _whitened(model, weights: dict, ids_BT, plan: dict, damp: float, log) -> dict:
    def rewrite(cfg, w, x, positions):
        for stage in STAGES:  # each stage sees the earlier stages factorized
            names = [n for n in stage if n in plan]
            if names:
                _, inputs = run_layer(cfg, w, x, positions)
                gram = _gram(inputs[names[0]])  # the linears of a stage share their input
                for n in names:
                    w[n] = LowRank.from_svd(w[n], plan[n], gram, damp)
        dtype = {n: weights[n].dtype for n in plan}
        return w, {n: LowRank(w[n].u.astype(dtype[n]), w[n].v.astype(dtype[n])) for n in plan}

    return stack_records(calibrate_layers(model, ids_BT, rewrite, log=log, label="low-rank"))
