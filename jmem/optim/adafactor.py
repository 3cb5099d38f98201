"""Adafactor as an optax chain of small transforms, with layer-stack-aware factor rules.

Adafactor (Shazeer & Stern, 2018) keeps, for a matrix parameter, only the
row and column means of the squared gradient instead of a full second
moment, so its state is O(rows + cols) instead of O(rows * cols).

Which two axes to factor is decided by a *factor rule*. Models that run their
layers under `jax.lax.scan` store each layer's weights stacked on a leading
`layers` axis (`[L, in, out]`). Factoring over "the two largest axes" (what
`optax.adafactor` does) would then mix the layer axis into the statistics.
The rules here treat leading stacked axes as *batch* axes: every layer gets
its own row/column statistics, its own update clipping and its own parameter
scale, exactly as if the layers were stored separately.

Rules (`factor_rule=`):

    ``"stacked"`` (default)  leaves under a ``layers`` key (the stacked scan
                             axis) have their leading axis as a batch axis
                             (a `[L]` leaf holds one scalar per layer);
                             then as ``"last_two"`` on the rest.
    ``"last_two"``           all axes but the last two are batch axes; the last
                             two are factored when both are at least
                             ``min_dim_size_to_factor``; 2-D is as ``"optax"``.
    ``"optax"``              no batch axes; factor the two largest axes
                             (``optax.adafactor``'s rule).

or any callable `(path: tuple[str, ...], shape) -> Layout`.

Example:
    >>> tx = adafactor(1e-2)                     # relative step when lr is None
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmem.checks import is_int
from jmem.optim import checks
from jmem.pytree import leaf_paths


class Layout(NamedTuple):
    """How one parameter is treated.

    Attributes:
        batch_ndim: leading axes that index independent blocks (e.g. layers).
        factored: `(row_axis, col_axis)` absolute axes to factor over (both
            >= batch_ndim), or None for a full second moment.
    """

    batch_ndim: int
    factored: Optional[tuple[int, int]]


FactorRule = Callable[[tuple, tuple], Layout]


def _two_largest(shape, offset: int, min_dim: int) -> Optional[tuple[int, int]]:
    rest = shape[offset:]
    if len(rest) < 2:
        return None
    order = np.argsort(rest, kind="stable")
    small, large = int(order[-2]), int(order[-1])
    if rest[small] < min_dim:
        return None
    # Same convention as optax: the second largest is the "row" axis.
    return small + offset, large + offset


def optax_rule(min_dim_size_to_factor: int = 128) -> FactorRule:
    """`optax.adafactor`'s rule: factor the two largest axes, no batch axes."""
    return lambda path, shape: Layout(0, _two_largest(shape, 0, min_dim_size_to_factor))


def last_two_rule(min_dim_size_to_factor: int = 128) -> FactorRule:
    """Leading axes (all but the last two) are batch axes; factor the last two."""

    def rule(path, shape):
        if len(shape) <= 2:
            return Layout(0, _two_largest(shape, 0, min_dim_size_to_factor))
        b = len(shape) - 2
        ok = min(shape[-2:]) >= min_dim_size_to_factor
        return Layout(b, (b, b + 1) if ok else None)

    return rule


def stacked_rule(min_dim_size_to_factor: int = 128, stacked_key: str = "layers") -> FactorRule:
    """Leaves with `stacked_key` in their path have a leading batch (layer)
    axis; the remaining axes follow `last_two_rule`. So `[L, in, out]`
    kernels factor over (in, out) and `[L, dim]` norm scales keep a full
    per-layer second moment."""
    inner = last_two_rule(min_dim_size_to_factor)

    def rule(path, shape):
        if stacked_key in path and len(shape) >= 1:
            sub = inner(path, shape[1:])
            fact = None if sub.factored is None else (sub.factored[0] + 1, sub.factored[1] + 1)
            return Layout(sub.batch_ndim + 1, fact)
        return inner(path, shape)

    return rule


RULES = {"stacked": stacked_rule, "last_two": last_two_rule, "optax": optax_rule}


def get_rule(rule: "str | FactorRule", min_dim_size_to_factor: int = 128) -> FactorRule:
    """The rule named `rule` (or `rule` itself, a callable); one ValueError for an unknown name or a
    `min_dim_size_to_factor` that is not an integer >= 1 (an axis size)."""
    min_dim_size_to_factor = checks.integer("adafactor", "min_dim_size_to_factor", min_dim_size_to_factor, 1,
                                            shapes=True)
    if callable(rule):
        return rule
    if not isinstance(rule, str) or rule not in RULES:
        raise ValueError(f"adafactor factor_rule={rule!r}; accepted: {', '.join(RULES)} or a callable "
                         "(path, shape) -> Layout")
    return RULES[rule](min_dim_size_to_factor)


def _layouts(rule: FactorRule, tree):
    """A tree of `Layout`s (as opaque leaves in a list) matching `tree`, each checked against its leaf."""
    leaves, treedef = leaf_paths(tree)
    return [_checked_layout(rule(path, tuple(x.shape)), path, tuple(x.shape)) for path, x in leaves], treedef


def _checked_layout(layout, path: tuple, shape: tuple) -> Layout:
    """`layout` if it fits a leaf of `shape`; else one ValueError naming the leaf, the layout and what fits
    (a custom rule's mistake would give per-element statistics or an error deep in the update)."""
    n = len(shape)
    ok = isinstance(layout, Layout) and is_int(layout.batch_ndim) and 0 <= layout.batch_ndim <= n
    if ok and layout.factored is not None:
        f = layout.factored
        ok = (isinstance(f, tuple) and len(f) == 2 and all(is_int(a) and layout.batch_ndim <= a < n for a in f)
              and f[0] != f[1])
    if not ok:
        raise ValueError(f"adafactor factor_rule gave {layout!r} for {'/'.join(map(str, path))} of shape "
                         f"{list(shape)}; accepted: Layout(batch_ndim, factored) with batch_ndim in 0..{n} and "
                         "factored None or two distinct axes in batch_ndim..ndim-1")
    return layout


def _block_axes(x, layout: Layout) -> tuple[int, ...]:
    return tuple(range(layout.batch_ndim, x.ndim))


class FactoredRmsState(NamedTuple):
    """Second-moment statistics. Unused slots hold a `[1]` placeholder.

    Attributes:
        count: i32[] steps taken.
        v_row: per leaf, mean of g^2 over the column axis (factored leaves).
        v_col: per leaf, mean of g^2 over the row axis (factored leaves).
        v: per leaf, full second moment (unfactored leaves).
    """

    count: jax.Array
    v_row: optax.Updates
    v_col: optax.Updates
    v: optax.Updates


def _decay_rate(step, exponent):
    t = (step + 1).astype(jnp.float32)
    return 1.0 - t ** (-exponent)


def scale_by_factored_rms(factor_rule: "str | FactorRule" = "stacked", *, min_dim_size_to_factor: int = 128,
                          decay_rate: float = 0.8, decay_offset: int = 0, eps: float = 1e-30,
                          state_dtype="float32") -> optax.GradientTransformation:
    """Divides updates by a (factored) estimate of the gradient RMS.

    For a factored leaf with row axis r and column axis c (per batch block):
    `v_row = mean_c(g^2)`, `v_col = mean_r(g^2)`, `v ~= v_row v_col / mean_r(v_row)`.

    Args:
        factor_rule: see the module docstring.
        decay_rate: second-moment decay `1 - (t+1)^-decay_rate`.
        decay_offset: step at which a fine-tuning run restarts the schedule; before it (a fresh
            state's steps) the schedule is at its start.
        eps: added to g^2 (> 0 for `adafactor`: with 0, a zero gradient divides 0 by 0).
        state_dtype: dtype of the statistics: float32 or bfloat16 (float16's range cannot hold squared gradients).

    Raises:
        ValueError: an unknown rule name, `min_dim_size_to_factor` not an integer >= 1, `decay_rate`
            not finite > 0, `eps` not finite >= 0, `decay_offset` not an integer >= 0, or `state_dtype`
            not float32's range (float32, bfloat16).
    """
    checks.positive("adafactor", "decay_rate", decay_rate)
    checks.non_negative("adafactor", "eps", eps)
    checks.float_dtype("adafactor", "state_dtype", state_dtype, squares=True)
    decay_offset = checks.integer("adafactor", "decay_offset", decay_offset, 0)
    rule = get_rule(factor_rule, min_dim_size_to_factor)

    def init(params):
        layouts, treedef = _layouts(rule, params)
        rows, cols, full = [], [], []
        for x, lay in zip(treedef.flatten_up_to(params), layouts):
            ph = jnp.zeros((1,), state_dtype)
            if lay.factored is None:
                rows.append(ph), cols.append(ph), full.append(jnp.zeros(x.shape, state_dtype))
            else:
                r, c = lay.factored
                rows.append(jnp.zeros(np.delete(x.shape, c), state_dtype))
                cols.append(jnp.zeros(np.delete(x.shape, r), state_dtype))
                full.append(ph)
        un = treedef.unflatten
        return FactoredRmsState(jnp.zeros([], jnp.int32), un(rows), un(cols), un(full))

    def update(updates, state, params=None):
        del params
        layouts, treedef = _layouts(rule, updates)
        beta = _decay_rate(jnp.maximum(state.count - decay_offset, 0), decay_rate)
        outs, rows, cols, full = [], [], [], []
        leaves = zip(treedef.flatten_up_to(updates), treedef.flatten_up_to(state.v_row),
                     treedef.flatten_up_to(state.v_col), treedef.flatten_up_to(state.v), layouts)
        for g, v_row, v_col, v, lay in leaves:
            g32 = g.astype(jnp.float32)
            g2 = g32 * g32 + eps
            if lay.factored is None:
                new_v = beta * v.astype(jnp.float32) + (1 - beta) * g2
                outs.append((g32 * jax.lax.rsqrt(new_v)).astype(g.dtype))
                rows.append(v_row), cols.append(v_col), full.append(new_v.astype(state_dtype))
                continue
            r, c = lay.factored
            new_row = beta * v_row.astype(jnp.float32) + (1 - beta) * g2.mean(axis=c)
            new_col = beta * v_col.astype(jnp.float32) + (1 - beta) * g2.mean(axis=r)
            new_row = new_row.astype(state_dtype).astype(jnp.float32)
            new_col = new_col.astype(state_dtype).astype(jnp.float32)
            row_axis_in_row = r if r < c else r - 1  # r's position once c is removed
            row_mean = new_row.mean(axis=row_axis_in_row, keepdims=True)
            row_factor = jax.lax.rsqrt(new_row / row_mean)
            col_factor = jax.lax.rsqrt(new_col)
            u = g32 * jnp.expand_dims(row_factor, c) * jnp.expand_dims(col_factor, r)
            outs.append(u.astype(g.dtype))
            rows.append(new_row.astype(state_dtype)), cols.append(new_col.astype(state_dtype)), full.append(v)
        un = treedef.unflatten
        return un(outs), FactoredRmsState(optax.safe_increment(state.count), un(rows), un(cols), un(full))

    return optax.GradientTransformation(init, update)


def clip_by_block_rms(threshold: float, factor_rule: "str | FactorRule" = "stacked", *,
                      min_dim_size_to_factor: int = 128) -> optax.GradientTransformation:
    """Clips each block (a leaf, or one layer of a stacked leaf) to RMS <= `threshold` (finite > 0, else
    ValueError)."""
    checks.positive("adafactor", "clipping_threshold", threshold)
    rule = get_rule(factor_rule, min_dim_size_to_factor)

    def update(updates, state, params=None):
        del params
        layouts, treedef = _layouts(rule, updates)

        def clip(u, lay):
            rms = jnp.sqrt(jnp.mean(jnp.square(u.astype(jnp.float32)), axis=_block_axes(u, lay), keepdims=True))
            return (u / jnp.maximum(1.0, rms / threshold)).astype(u.dtype)

        return treedef.unflatten([clip(u, lay) for u, lay in zip(treedef.flatten_up_to(updates), layouts)]), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def scale_by_param_block_rms(min_scale: float = 1e-3, factor_rule: "str | FactorRule" = "stacked", *,
                             min_dim_size_to_factor: int = 128) -> optax.GradientTransformation:
    """Multiplies updates by `max(RMS(param block), min_scale)` (relative step size; `min_scale` finite
    >= 0, else ValueError)."""
    checks.non_negative("adafactor", "min_scale", min_scale)
    rule = get_rule(factor_rule, min_dim_size_to_factor)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_param_block_rms needs params in update(grads, state, params)")
        layouts, treedef = _layouts(rule, updates)

        def scale(u, p, lay):
            rms = jnp.sqrt(jnp.mean(jnp.square(p.astype(jnp.float32)), axis=_block_axes(p, lay), keepdims=True))
            return (u * jnp.maximum(rms, min_scale)).astype(u.dtype)

        out = [scale(u, p, lay) for u, p, lay in
               zip(treedef.flatten_up_to(updates), treedef.flatten_up_to(params), layouts)]
        return treedef.unflatten(out), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def relative_step_size(max_lr: float = 1e-2) -> optax.Schedule:
    """The paper's default step size `min(max_lr, 1/sqrt(t))`, t counted from 1."""
    return lambda count: jnp.minimum(max_lr, jax.lax.rsqrt((count + 1).astype(jnp.float32)))


def adafactor(learning_rate: "float | optax.Schedule | None" = None, *, factor_rule: "str | FactorRule" = "stacked",
              min_dim_size_to_factor: int = 128, decay_rate: float = 0.8, decay_offset: int = 0,
              multiply_by_parameter_scale: bool = True, clipping_threshold: Optional[float] = 1.0,
              momentum: Optional[float] = None, momentum_dtype="bfloat16", weight_decay_rate: Optional[float] = None,
              weight_decay_mask=None, eps: float = 1e-30, state_dtype="float32") -> optax.GradientTransformation:
    """Adafactor: factored second moments, update clipping, relative step size.

    The chain is `scale_by_factored_rms -> clip_by_block_rms -> learning rate
    -> scale_by_param_block_rms -> [ema momentum] -> [weight decay] -> -1`,
    the same order as `optax.adafactor`, so with `factor_rule="optax"` (or on
    2-D parameters outside the stacked `layers`, whose leading axis the "stacked"
    rule treats as a batch axis) it computes the same updates; with `momentum`,
    give both the same momentum dtype (bf16 here by default, f32 in optax).

    Args:
        learning_rate: a number >= 0 or a schedule; None uses the paper's relative step
            `min(1e-2, 1/sqrt(t))` (times the parameter RMS when
            `multiply_by_parameter_scale`).
        factor_rule: "stacked" (default), "last_two", "optax" or a callable;
            see the module docstring.
        min_dim_size_to_factor: factor only when both axes are at least this.
        decay_rate, decay_offset, eps: second-moment schedule and epsilon.
        multiply_by_parameter_scale: scale steps by each block's parameter RMS (floored at 1e-3).
            Turn it off for parameters that start at or near zero, such as LoRA's B
            (`experiments/train.py --lora-rank` does): their steps would be 1e-3 of the rate.
        clipping_threshold: clip each block's update RMS to this (None: off).
        momentum: optional first-moment decay (e.g. 0.9); costs one buffer
            per parameter in `momentum_dtype` (a floating dtype, bf16 by default:
            half of f32; None: the updates' dtype).
        weight_decay_rate, weight_decay_mask: decoupled weight decay.
        state_dtype: dtype of the second-moment statistics: float32 or bfloat16 (not float16, see
            `scale_by_factored_rms`).

    Returns:
        An `optax.GradientTransformation`.

    Raises:
        ValueError: a bad setting, before anything is built: learning_rate not None, a finite
            number >= 0 or a schedule, momentum outside [0, 1), clipping_threshold or decay_rate
            not finite > 0, eps not finite > 0, weight_decay_rate not finite >= 0, min_dim_size_to_factor
            not an integer >= 1, decay_offset not an integer >= 0, state_dtype or
            momentum_dtype not a floating dtype, multiply_by_parameter_scale not a bool, an unknown
            factor_rule name.
    """
    checks.learning_rate("adafactor", learning_rate, none_ok=True)
    checks.decay("adafactor", "momentum", momentum, none_ok=True)
    checks.positive("adafactor", "clipping_threshold", clipping_threshold, none_ok=True)
    checks.positive("adafactor", "eps", eps)  # 0: a zero gradient's rsqrt(0) spreads NaN through its block
    checks.rate("adafactor", "weight_decay_rate", weight_decay_rate, none_ok=True)
    checks.float_dtype("adafactor", "momentum_dtype", momentum_dtype, none_ok=True)
    checks.flag("adafactor", "multiply_by_parameter_scale", multiply_by_parameter_scale)
    get_rule(factor_rule, min_dim_size_to_factor)  # a bad rule name or min_dim_size_to_factor, before the chain
    kw = dict(min_dim_size_to_factor=min_dim_size_to_factor)
    lr = relative_step_size() if learning_rate is None else learning_rate
    tx = [scale_by_factored_rms(factor_rule, decay_rate=decay_rate, decay_offset=decay_offset, eps=eps,
                                state_dtype=state_dtype, **kw)]
    if clipping_threshold is not None:
        tx.append(clip_by_block_rms(clipping_threshold, factor_rule, **kw))
    tx.append(optax.scale_by_learning_rate(lr, flip_sign=False))
    if multiply_by_parameter_scale:
        tx.append(scale_by_param_block_rms(1e-3, factor_rule, **kw))
    if momentum is not None:
        tx.append(optax.ema(momentum, debias=False, accumulator_dtype=momentum_dtype))
    if weight_decay_rate is not None:
        tx.append(optax.add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    tx.append(optax.scale(-1.0))
    return optax.chain(*tx)
