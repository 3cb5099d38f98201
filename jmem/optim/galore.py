"""GaLore: Adam on a low-rank projection of each weight matrix's gradient.

GaLore (Zhao et al., 2024, "GaLore: Memory-Efficient LLM Training by
Gradient Low-Rank Projection") keeps Adam's moments for an `m x n` weight in
a rank-`r` subspace of its gradient. Every `update_proj_gap` steps (T), the
basis is recomputed from the current gradient's top-`r` singular vectors on
the matrix's smaller side; in between, each step

    left  (m <= n):  R = P^T G  (r x n),  update = scale * P   @ adam(R)
    right (m >  n):  R = G Q    (m x r),  update = scale * adam(R) @ Q^T

with `P` (m x r) or `Q` (n x r) held fixed. The state of a projected matrix is
two `r x n` (or `m x r`) moments plus the basis instead of two `m x n`
moments: about `r / min(m, n) + r / (2 max(m, n))` of Adam's. The moments are
carried across a basis refresh, as in the paper's reference implementation.

Which leaves are projected (the plan): a leaf is a matrix on its last two
axes; leading axes (the stacked `[L, in, out]` layer axis of a scanned model,
an expert axis) are batch axes, so every layer gets its own basis from one
batched SVD. A leaf is projected when the rule accepts it (by default: a
matrix per layer, i.e. at least 2-D besides the stacked axis of a leaf under
a `layers` key, so a stacked norm scale `[L, dim]` is no matrix, and no path
key in `exclude`, the embeddings and the LM head) and
`rank < min(m, n)`: at full rank a basis saves nothing, so those leaves, norm
scales, biases and excluded leaves run plain Adam (unscaled). Note that a
projection at full rank would not reproduce Adam either: Adam's normalisation
is per coordinate, so it changes under the rotation `P`.

The refresh is a `lax.cond` on the step count inside the update: one
compiled program, the SVD runs only on refresh steps (and on the first step
after a matrix's state was reset to zeros, e.g. by a layer-wise schedule). Singular vectors are
sign-canonicalised (largest-magnitude entry positive) so the carried moments
meet the same basis orientation on every backend's SVD.

`moments="8bit"` stores the (projected or plain) moments of leaves with at
least `min_8bit_size` elements with `jmem.optim.adam8bit`'s block-wise dynamic
8-bit code (the second moment rounded stochastically, as there), which composes
with the projection: about 2 bytes instead of 8 per moment pair entry.

Example:
    >>> tx = galore(1e-2, rank=128, update_proj_gap=200, scale=0.25)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jmem.optim import checks
from jmem.optim.adam8bit import (QuantizedMoment, dequantize, dequantize_second_moment, quantize,
                                 quantize_second_moment, uniform_noise)
from jmem.pytree import leaf_paths

MOMENTS = ("f32", "8bit")
DEFAULT_EXCLUDE = ("embed", "head")

ProjectRule = Callable[[tuple, tuple], bool]
"""`(path names, shape) -> bool`: whether a leaf may be projected (the rank check comes after)."""


class Plan(NamedTuple):
    """How one leaf is treated.

    Attributes:
        side: "left" (basis `P[..., m, r]`, moments `[..., r, n]`), "right"
            (basis `Q[..., n, r]`, moments `[..., m, r]`) or None (plain Adam).
        rank: the projection rank (0 for plain leaves).
    """

    side: Optional[str]
    rank: int


def default_rule(exclude: "str | tuple[str, ...]" = DEFAULT_EXCLUDE, stacked_key: str = "layers") -> ProjectRule:
    """Project leaves of at least 2 axes per layer (a leaf with `stacked_key` in its path has a leading layer
    axis besides) with no path key in `exclude` (one name or a tuple of names).

    Raises:
        ValueError: `exclude` is neither a string nor a sequence of strings.
    """
    exclude = checks.names("galore", "exclude", exclude)
    return lambda path, shape: (len(shape) - (stacked_key in path) >= 2 and not any(k in exclude for k in path))


def leaf_plan(path: tuple, shape: tuple, rank: int, rule: ProjectRule) -> Plan:
    """The `Plan` of one leaf: projected on its smaller side when the rule accepts it and
    `rank < min(m, n)` of its last two axes, else plain Adam."""
    if len(shape) < 2 or not rule(path, tuple(shape)):
        return Plan(None, 0)
    m, n = shape[-2:]
    if rank >= min(m, n):
        return Plan(None, 0)
    return Plan("left" if m <= n else "right", rank)


def galore_plan(tree, rank: int, *, exclude: "str | tuple[str, ...]" = DEFAULT_EXCLUDE,
                rule: ProjectRule | None = None):
    """`(plans, treedef)`: the `Plan` of every array leaf of `tree` (a params or grads pytree).

    `exclude` is one path key (a string) or a tuple of them; `rule` replaces it.

    Raises:
        ValueError: `rank` is not an integer >= 1 (as `galore`), or `exclude` is neither a string nor a
            sequence of strings.

    Example:
        >>> plans, _ = galore_plan(params, rank=4)
        >>> sum(p.side is not None for p in plans)   # projected matrices
    """
    rank = checks.integer("galore", "rank", rank, 1, shapes=True)
    rule = default_rule(exclude) if rule is None else rule
    leaves, treedef = leaf_paths(tree)
    return [leaf_plan(path, tuple(x.shape), rank, rule) for path, x in leaves], treedef


def _top_vectors(g_BMN, side: str, rank: int, batch_size: int | None = 0):
    """Top-`rank` singular vectors on the smaller side of each matrix of `g`: f32[..., m or n, r].
    `batch_size` 0: one batched SVD of the whole stack; else `lax.map` over the matrices,
    `batch_size` per SVD call (None: one matrix per call)."""
    def svd(g_KMN):
        u_KMK, _, vh_KKN = jnp.linalg.svd(g_KMN, full_matrices=False)
        return u_KMK[..., :rank] if side == "left" else jnp.swapaxes(vh_KKN[..., :rank, :], -1, -2)

    lead = g_BMN.shape[:-2]
    if batch_size == 0 or not lead:
        return svd(g_BMN)
    b = jax.lax.map(svd, g_BMN.reshape((-1,) + g_BMN.shape[-2:]), batch_size=batch_size)
    return b.reshape(lead + b.shape[-2:])


def _basis(g_BMN, side: str, rank: int, svd_batch_size: int | None):
    """Top-`rank` singular vectors on the smaller side, sign-canonicalised: f32[..., m or n, r].

    Off the CPU a stack of matrices is one batched SVD (`svd_batch_size` bounds its workspace). On
    the CPU it is one matrix per call: LAPACK's batch runs on the thread pool that also runs each
    device's program, and inside the refresh's `lax.cond` on a multi-device mesh every device's
    program waited on batch tasks that no free thread could run."""
    g = g_BMN.astype(jnp.float32)
    b = jax.lax.platform_dependent(cpu=lambda: _top_vectors(g, side, rank, None),
                                   default=lambda: _top_vectors(g, side, rank, svd_batch_size or 0))
    idx = jnp.argmax(jnp.abs(b), axis=-2, keepdims=True)
    sign = jnp.sign(jnp.take_along_axis(b, idx, axis=-2))
    return b * jnp.where(sign == 0, 1.0, sign)


# Projections are cheap (one side is r) and their error feeds Adam's per-coordinate
# division, so they run at full f32 precision even where the default matmul is TF32/bf16.
_HI = jax.lax.Precision.HIGHEST


def project(g, basis, side: str):
    """`P^T G` (left, `[..., r, n]`) or `G Q` (right, `[..., m, r]`) in f32."""
    g = g.astype(jnp.float32)
    b = basis.astype(jnp.float32)
    if side == "left":
        return jnp.einsum("...mr,...mn->...rn", b, g, precision=_HI)
    return jnp.einsum("...mn,...nr->...mr", g, b, precision=_HI)


def project_back(r, basis, side: str):
    """`P R` (left) or `R Q^T` (right): f32[..., m, n]."""
    b = basis.astype(jnp.float32)
    if side == "left":
        return jnp.einsum("...mr,...rn->...mn", b, r, precision=_HI)
    return jnp.einsum("...mr,...nr->...mn", r, b, precision=_HI)


class ScaleByGaloreState(NamedTuple):
    """GaLore-Adam state. Unused slots hold a `[1]` zero placeholder.

    Attributes:
        count: i32[] steps taken (the basis refreshes when `count % gap == 0`,
            and for any matrix whose basis is all zero).
        basis: per projected leaf, `P[..., m, r]` or `Q[..., n, r]`.
        mu, nu: per leaf, Adam's moments in the projected shape (`[..., r, n]`
            or `[..., m, r]`) or the leaf's shape; a `QuantizedMoment` with
            `moments="8bit"` for large ones.
    """

    count: jax.Array
    basis: optax.Updates
    mu: optax.Updates
    nu: optax.Updates


def _moment_shape(shape, plan: Plan) -> tuple:
    if plan.side == "left":
        return tuple(shape[:-2]) + (plan.rank, shape[-1])
    if plan.side == "right":
        return tuple(shape[:-1]) + (plan.rank,)
    return tuple(shape)


def _basis_shape(shape, plan: Plan) -> tuple:
    side_dim = shape[-2] if plan.side == "left" else shape[-1]
    return tuple(shape[:-2]) + (side_dim, plan.rank)


def scale_by_galore(rank: int = 128, update_proj_gap: int = 200, scale: float = 0.25, b1: float = 0.9,
                    b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, *,
                    exclude: tuple[str, ...] = DEFAULT_EXCLUDE, rule: ProjectRule | None = None,
                    basis_dtype="float32", moments: str = "f32", block_size: int = 256, min_8bit_size: int = 4096,
                    svd_batch_size: int | None = None) -> optax.GradientTransformation:
    """Adam's scaling with GaLore projection of matrix leaves (no learning rate, no sign flip).

    Args: see `galore`.

    Returns:
        An `optax.GradientTransformation` whose state is a `ScaleByGaloreState`.

    Raises:
        ValueError: a bad setting (see `galore`), before anything is built.
    """
    rank = checks.integer("galore", "rank", rank, 1, shapes=True)
    update_proj_gap = checks.integer("galore", "update_proj_gap", update_proj_gap, 1)
    checks.positive("galore", "scale", scale)
    checks.decay("galore", "b1", b1)
    checks.decay("galore", "b2", b2)
    checks.non_negative("galore", "eps", eps)
    checks.non_negative("galore", "eps_root", eps_root)
    checks.float_dtype("galore", "basis_dtype", basis_dtype)
    checks.one_of("galore", "moments", moments, MOMENTS)
    block_size = checks.integer("galore", "block_size", block_size, 1, shapes=True)
    min_8bit_size = checks.integer("galore", "min_8bit_size", min_8bit_size, 0, shapes=True)
    svd_batch_size = checks.integer("galore", "svd_batch_size", svd_batch_size, 1, none_ok=True, shapes=True)
    rule = default_rule(exclude) if rule is None else rule

    def eight(shape) -> bool:
        return moments == "8bit" and math.prod(shape) >= min_8bit_size

    def zeros_moment(shape, signed):
        if eight(shape):
            return quantize(jnp.zeros(shape, jnp.float32), signed=signed, block_size=block_size)
        return jnp.zeros(shape, jnp.float32)

    def load(mom, shape, signed):
        if not isinstance(mom, QuantizedMoment):
            return mom
        return dequantize(mom, shape, signed=True) if signed else dequantize_second_moment(mom, shape)

    def store(x, signed, count=None, leaf=None):
        if not eight(x.shape):
            return x
        if signed:
            return quantize(x, signed=True, block_size=block_size)
        # Rounded stochastically, as adam8bit's (see its module docstring).
        noise = uniform_noise(count, leaf, jnp.arange(x.size, dtype=jnp.int32).reshape(x.shape))
        return quantize_second_moment(x, block_size=block_size, noise=noise)

    def init(params):
        plans, treedef = galore_plan(params, rank, rule=rule)
        bases, mus, nus = [], [], []
        for p, plan in zip(treedef.flatten_up_to(params), plans):
            shape = _moment_shape(p.shape, plan)
            mus.append(zeros_moment(shape, True)), nus.append(zeros_moment(shape, False))
            bases.append(jnp.zeros((1,), basis_dtype) if plan.side is None
                         else jnp.zeros(_basis_shape(p.shape, plan), basis_dtype))
        un = treedef.unflatten
        return ScaleByGaloreState(jnp.zeros([], jnp.int32), un(bases), un(mus), un(nus))

    def update(updates, state, params=None):
        del params
        plans, treedef = galore_plan(updates, rank, rule=rule)
        grads = treedef.flatten_up_to(updates)
        old_bases = treedef.flatten_up_to(state.basis)
        proj = [i for i, plan in enumerate(plans) if plan.side is not None]

        bases = list(old_bases)
        if proj:
            periodic = state.count % update_proj_gap == 0
            # A matrix whose basis is all zero has never had one (or had its state reset, as a
            # layer-wise schedule does for newly trained layers): it gets one on this step. An all-zero
            # gradient (LoRA's A on its first step, B being zero) has no subspace: its SVD would fix
            # arbitrary axes until the next periodic refresh, so the basis stays as it was.
            unset = [jnp.all(old_bases[i] == 0, axis=(-2, -1), keepdims=True) for i in proj]

            def fresh(gs, olds, unset):
                return [jnp.where((periodic | u) & jnp.any(g != 0, axis=(-2, -1), keepdims=True),
                                  _basis(g, plans[i].side, rank, svd_batch_size).astype(basis_dtype), o)
                        for g, o, u, i in zip(gs, olds, unset, proj)]

            def keep(_, olds, unset):
                return olds

            refresh = periodic | jnp.any(jnp.stack([jnp.any(u) for u in unset]))
            new = jax.lax.cond(refresh, fresh, keep, [grads[i] for i in proj], [old_bases[i] for i in proj], unset)
            for i, b in zip(proj, new):
                bases[i] = b

        count = optax.safe_increment(state.count)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        outs, mus, nus = [], [], []
        for leaf, (g, plan, basis, mu, nu) in enumerate(zip(grads, plans, bases, treedef.flatten_up_to(state.mu),
                                                            treedef.flatten_up_to(state.nu))):
            r = g.astype(jnp.float32) if plan.side is None else project(g, basis, plan.side)
            m = b1 * load(mu, r.shape, True) + (1 - b1) * r
            v = b2 * load(nu, r.shape, False) + (1 - b2) * r * r
            n = (m / c1) / (jnp.sqrt(v / c2 + eps_root) + eps)
            if plan.side is not None:
                n = scale * project_back(n, basis, plan.side)
            outs.append(n.astype(g.dtype))
            mus.append(store(m, True)), nus.append(store(v, False, count, leaf))
        un = treedef.unflatten
        return un(outs), ScaleByGaloreState(count, un(bases), un(mus), un(nus))

    return optax.GradientTransformation(init, update)


def galore(learning_rate: "float | optax.Schedule", rank: int = 128, update_proj_gap: int = 200, scale: float = 0.25,
           b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4, *, mask=None,
           eps_root: float = 0.0, exclude: tuple[str, ...] = DEFAULT_EXCLUDE, rule: ProjectRule | None = None,
           basis_dtype="float32", moments: str = "f32", block_size: int = 256, min_8bit_size: int = 4096,
           svd_batch_size: int | None = None) -> optax.GradientTransformation:
    """GaLore-AdamW: AdamW whose matrix leaves keep rank-`rank` projected moments.

    Args:
        learning_rate: a number >= 0 or a schedule (the paper pairs `scale=0.25` with a
            learning rate about 4x AdamW's, e.g. 1e-2).
        rank: projection rank r >= 1; a matrix is projected when
            `r < min(m, n)` of its last two axes (else plain Adam).
        update_proj_gap: T >= 1, steps between SVD refreshes of the basis.
        scale: alpha > 0, multiplies the projected leaves' updates.
        b1, b2, eps, eps_root: Adam's decays and epsilons (as `optax.adam`).
        weight_decay, mask: decoupled weight decay on the full parameters (as
            `optax.adamw`).
        exclude: path keys whose leaves run plain Adam, one string or a tuple
            (default: "embed" and "head", the paper's choice: only attention and MLP matrices).
        rule: a callable `(path names, shape) -> bool` replacing `exclude`.
        basis_dtype: floating dtype of the stored bases (bf16 halves their bytes).
        moments: "f32" or "8bit" (`jmem.optim.adam8bit`'s block-wise dynamic
            code for moments with at least `min_8bit_size` elements).
        block_size, min_8bit_size: the 8-bit blocks and size threshold.
        svd_batch_size: None: one batched SVD per stacked leaf; k: `lax.map`
            over its matrices k at a time, which bounds the SVD workspace. On the CPU
            every stack runs one matrix per call whatever this is (see `_basis`).

    Returns:
        `chain(scale_by_galore, add_decayed_weights, scale_by_learning_rate)`.

    Raises:
        ValueError: a bad setting, before anything is built: learning_rate or weight_decay not a
            finite number >= 0 or a schedule (None is refused), rank, update_proj_gap, block_size or
            svd_batch_size not an integer >= 1 (bools are refused), min_8bit_size not an integer >= 0,
            scale not finite > 0, b1 or b2 outside [0, 1), eps or eps_root not finite >= 0,
            basis_dtype not a floating dtype, an unknown moments, exclude not a string or strings.

    Example:
        >>> tx = galore(1e-2, rank=4, update_proj_gap=50)     # tiny model, width 64
        >>> fns = jmem.train.step.make_train_fns(model, tx)
    """
    checks.learning_rate("galore", learning_rate)
    checks.rate("galore", "weight_decay", weight_decay)
    return optax.chain(
        scale_by_galore(rank, update_proj_gap, scale, b1, b2, eps, eps_root, exclude=exclude, rule=rule,
                        basis_dtype=basis_dtype, moments=moments, block_size=block_size,
                        min_8bit_size=min_8bit_size, svd_batch_size=svd_batch_size),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
