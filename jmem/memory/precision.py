"""Precision policies, dynamic loss scaling and fp32 master weights.

A `Policy` names three dtypes: `param` (how parameters are stored), `compute`
(what the layers compute in) and `output` (what the step returns, e.g. logits
and loss). Its string form is the same on the command line and in Python:

    >>> Policy.parse("p=f32,c=bf16,o=f32")
    Policy(param=float32, compute=bfloat16, output=float32)

Short aliases name the common policies:

    ============  =======================  ====================================
    alias         long form                use
    ============  =======================  ====================================
    ``f32``       ``p=f32,c=f32,o=f32``    full precision
    ``bf16``      ``p=f32,c=bf16,o=f32``   mixed precision, f32 params
    ``f16``       ``p=f32,c=f16,o=f32``    mixed precision with loss scaling
    ``bf16-pure`` ``p=bf16,c=bf16,o=f32``  bf16 params; pair with
                                           `with_master_weights` for an f32 copy
    ============  =======================  ====================================

Casting touches only floating-point leaves: integer token ids, step counters
and PRNG keys pass through unchanged.

fp16 training uses `DynamicLossScale` (scale the loss, unscale the grads,
`adjust` by whether the grads were finite) together with `skip_nonfinite`,
which drops a non-finite update and counts it in the optimizer state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmem.checks import check_int, is_number

_DTYPE_NAMES: dict[str, Any] = {
    "f32": jnp.float32,
    "fp32": jnp.float32,
    "float32": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
    "float16": jnp.float16,
}
_SHORT = {np.dtype(jnp.float32): "f32", np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "f16"}

ALIASES: dict[str, str] = {
    "f32": "p=f32,c=f32,o=f32",
    "bf16": "p=f32,c=bf16,o=f32",
    "f16": "p=f32,c=f16,o=f32",
    "bf16-pure": "p=bf16,c=bf16,o=f32",
}
_ALIAS_SYNONYMS = {"fp32": "f32", "float32": "f32", "bfloat16": "bf16", "fp16": "f16", "float16": "f16"}


class PrecisionError(ValueError):
    """A precision string or dtype name that does not parse."""


def _dtype(name_or_dtype) -> np.dtype:
    if isinstance(name_or_dtype, str):
        key = name_or_dtype.strip().lower()
        if key not in _DTYPE_NAMES:
            raise PrecisionError(
                f"unknown dtype {name_or_dtype!r}; accepted: {', '.join(sorted(_DTYPE_NAMES))}"
            )
        return np.dtype(_DTYPE_NAMES[key])
    try:
        dt = np.dtype(name_or_dtype)
    except TypeError:
        raise PrecisionError(f"dtype {name_or_dtype!r} is not a dtype; accepted: float32, bfloat16, float16 "
                             f"or a name among {', '.join(sorted(_DTYPE_NAMES))}") from None
    if dt not in _SHORT:
        raise PrecisionError(f"dtype {dt} is not a policy dtype; accepted: float32, bfloat16, float16")
    return dt


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _cast_leaf(x, dtype):
    if isinstance(x, jax.ShapeDtypeStruct):
        if not _is_float(x.dtype):
            return x
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None))
    if not hasattr(x, "dtype") or not _is_float(x.dtype) or x.dtype == dtype:
        return x
    return jnp.asarray(x).astype(dtype)


def cast_floating(tree, dtype):
    """Casts every floating leaf of `tree` (arrays or ShapeDtypeStructs) to `dtype`
    (float32, bfloat16 or float16, or one of their names such as "bf16").

    Raises:
        PrecisionError: `dtype` is not one of those.

    Example:
        >>> cast_floating({"w": jnp.ones(2), "step": jnp.int32(0)}, jnp.bfloat16)
    """
    dtype = _dtype(dtype)
    return jax.tree.map(lambda x: _cast_leaf(x, dtype), tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameters, computation and outputs.

    Attributes:
        param: storage dtype of parameters.
        compute: dtype the layers compute in.
        output: dtype of the step's outputs (logits, loss).
    """

    param: np.dtype = np.dtype(jnp.float32)
    compute: np.dtype = np.dtype(jnp.float32)
    output: np.dtype = np.dtype(jnp.float32)

    def __post_init__(self):
        for field in ("param", "compute", "output"):
            object.__setattr__(self, field, _dtype(getattr(self, field)))

    @classmethod
    def parse(cls, spec: "str | Policy") -> "Policy":
        """Parses `"p=f32,c=bf16,o=f32"` (any order, missing keys default to
        f32, `params=`/`compute=`/`output=` also accepted) or an alias
        (`f32`, `bf16`, `f16`, `bf16-pure`).

        Raises:
            PrecisionError: the string does not parse.
        """
        if isinstance(spec, Policy):
            return spec
        if not isinstance(spec, str) or not spec.strip():
            raise PrecisionError(f"precision {spec!r} must be a non-empty string like 'p=f32,c=bf16,o=f32'")
        text = spec.strip().lower()
        text = ALIASES.get(_ALIAS_SYNONYMS.get(text, text), text)
        keys = {"p": "param", "param": "param", "params": "param", "c": "compute", "compute": "compute",
                "o": "output", "output": "output"}
        fields: dict[str, np.dtype] = {}
        for part in text.split(","):
            if "=" not in part:
                raise PrecisionError(
                    f"precision {spec!r}: cannot parse {part!r}; accepted: 'p=DTYPE,c=DTYPE,o=DTYPE' "
                    f"or one of {', '.join(ALIASES)}"
                )
            k, v = (s.strip() for s in part.split("=", 1))
            if k not in keys:
                raise PrecisionError(f"precision {spec!r}: unknown key {k!r}; accepted: p, c, o")
            if keys[k] in fields:
                raise PrecisionError(f"precision {spec!r}: key {k!r} given twice")
            try:
                fields[keys[k]] = _dtype(v)
            except PrecisionError as e:
                raise PrecisionError(f"precision {spec!r}: {e}") from None
        return cls(**fields)

    def __str__(self) -> str:
        return f"p={_SHORT[self.param]},c={_SHORT[self.compute]},o={_SHORT[self.output]}"

    def __repr__(self) -> str:
        return f"Policy(param={self.param}, compute={self.compute}, output={self.output})"

    @property
    def needs_loss_scale(self) -> bool:
        """True when gradients flow through f16 and need dynamic loss scaling."""
        return self.compute == np.dtype(jnp.float16) or self.param == np.dtype(jnp.float16)

    def cast_to_param(self, tree):
        return cast_floating(tree, self.param)

    def cast_to_compute(self, tree):
        return cast_floating(tree, self.compute)

    def cast_to_output(self, tree):
        return cast_floating(tree, self.output)


def get_policy(spec: "str | Policy") -> Policy:
    """`Policy.parse`, the name jmp users expect."""
    return Policy.parse(spec)


def global_norm(tree) -> jax.Array:
    """f32[] L2 norm of every floating leaf of `tree`, summed in f32 (an f16 sum of squares overflows
    above a norm of 256 and loses elements below 1e-4)."""
    leaves = [jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))) for x in jax.tree.leaves(tree)
              if _is_float(jnp.asarray(x).dtype)]
    return jnp.sqrt(sum(leaves, jnp.zeros((), jnp.float32)))


def all_finite(tree) -> jax.Array:
    """bool[] True when every floating leaf of `tree` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_float(jnp.asarray(x).dtype)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack(leaves).all()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scale for fp16: grows after `growth_interval` finite steps,
    backs off on a non-finite step. A pytree (its arrays are `scale`, `counter`),
    so it can live in the train state and pass through `jit`.

    Example:
        >>> ls = DynamicLossScale.create()
        >>> grads = ls.unscale(jax.grad(lambda p: ls.scale(loss(p)))(params))
        >>> ls = ls.adjust(all_finite(grads))
    """

    scale_value: jax.Array
    counter: jax.Array
    growth_interval: int = dataclasses.field(default=2000, metadata=dict(static=True))
    growth_factor: float = dataclasses.field(default=2.0, metadata=dict(static=True))
    backoff_factor: float = dataclasses.field(default=0.5, metadata=dict(static=True))
    min_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    max_scale: float = dataclasses.field(default=2.0**24, metadata=dict(static=True))

    @classmethod
    def create(cls, initial_scale: float = 2.0**15, *, growth_interval: int = 2000, growth_factor: float = 2.0,
               backoff_factor: float = 0.5, min_scale: float = 1.0, max_scale: float = 2.0**24):
        check_int("DynamicLossScale: growth_interval", growth_interval, 1)
        finite = lambda v: is_number(v) and math.isfinite(v)  # noqa: E731 - short-circuits before comparing
        for name, value, ok, accepted in (
            ("initial_scale", initial_scale, finite(initial_scale) and initial_scale > 0, "a finite number > 0"),
            ("min_scale", min_scale, finite(min_scale) and min_scale > 0, "a finite number > 0"),
            ("max_scale", max_scale, finite(max_scale) and max_scale > 0, "a finite number > 0"),
            ("growth_factor", growth_factor, finite(growth_factor) and growth_factor > 1, "a finite number > 1"),
            ("backoff_factor", backoff_factor, finite(backoff_factor) and 0 < backoff_factor < 1,
             "a number in (0, 1)"),
        ):
            if not ok:
                raise ValueError(f"DynamicLossScale: {name}={value!r}; accepted: {accepted}")
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(f"DynamicLossScale: min_scale={min_scale!r}, initial_scale={initial_scale!r}, "
                             f"max_scale={max_scale!r}; accepted: min_scale <= initial_scale <= max_scale")
        return cls(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32), growth_interval,
                   growth_factor, backoff_factor, min_scale, max_scale)

    def scale(self, tree):
        """Multiplies floating leaves (the loss; Python numbers too) by the scale, keeping their dtype."""
        return jax.tree.map(lambda x: (x * self.scale_value).astype(x.dtype) if _is_float(x.dtype) else x,
                            jax.tree.map(jnp.asarray, tree))

    def unscale(self, tree):
        """Divides floating leaves (the grads; Python numbers too) by the scale, computed in f32.

        f16 leaves come back in f32: scaled, a small gradient fits f16, unscaled it may lie below
        f16's range (6e-8) and round to 0 (PyTorch's GradScaler refuses to unscale f16 gradients
        for this reason). Other floating leaves keep their dtype."""
        inv = 1.0 / self.scale_value

        def one(x):
            if not _is_float(x.dtype):
                return x
            return (x.astype(jnp.float32) * inv).astype(jnp.float32 if x.dtype == jnp.float16 else x.dtype)

        return jax.tree.map(one, jax.tree.map(jnp.asarray, tree))

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """New loss scale: backoff (and reset the counter) when not finite; grow
        by `growth_factor` after `growth_interval` consecutive finite steps."""
        grow = grads_finite & (self.counter + 1 >= self.growth_interval)
        new_scale = jnp.where(
            grads_finite,
            jnp.where(grow, jnp.minimum(self.scale_value * self.growth_factor, self.max_scale), self.scale_value),
            jnp.maximum(self.scale_value * self.backoff_factor, self.min_scale),
        )
        new_counter = jnp.where(grads_finite & ~grow, self.counter + 1, 0)
        return dataclasses.replace(self, scale_value=new_scale.astype(jnp.float32),
                                   counter=new_counter.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """Same interface as `DynamicLossScale` for bf16/f32 policies; does nothing."""

    def scale(self, tree):
        return tree

    def unscale(self, tree):
        return tree

    def adjust(self, grads_finite) -> "NoOpLossScale":
        del grads_finite
        return self

    @property
    def scale_value(self):
        return jnp.ones((), jnp.float32)


def loss_scale_for(policy: "Policy | str", **kw):
    """`DynamicLossScale.create(**kw)` when the policy needs it, else `NoOpLossScale()`; `kw` is checked
    either way (a bad setting is one ValueError whatever the policy)."""
    scale = DynamicLossScale.create(**kw)
    return scale if Policy.parse(policy).needs_loss_scale else NoOpLossScale()


class SkipNonFiniteState(NamedTuple):
    """State of `skip_nonfinite`: the wrapped state plus counters for the logs."""

    inner: optax.OptState
    skipped_steps: jax.Array  # i32[]: total non-finite steps skipped
    last_finite: jax.Array  # bool[]: whether the last step was applied


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Wraps `inner` so a step with any non-finite gradient is skipped: zero
    updates, inner state unchanged, `skipped_steps` incremented.

    Example:
        >>> tx = skip_nonfinite(optax.adamw(1e-3))
        >>> updates, state = tx.update(grads, state, params); state.skipped_steps
    """

    def init(params):
        return SkipNonFiniteState(inner.init(params), jnp.zeros((), jnp.int32), jnp.array(True))

    def update(updates, state, params=None, **extra):
        finite = all_finite(updates)
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        pick = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        new_inner = jax.tree.map(pick, new_inner, state.inner)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        skipped = state.skipped_steps + jnp.where(finite, 0, 1).astype(jnp.int32)
        return new_updates, SkipNonFiniteState(new_inner, skipped, finite)

    return optax.GradientTransformationExtraArgs(init, update)


class MasterWeightsState(NamedTuple):
    """State of `with_master_weights`: f32 copy of the params and the inner state."""

    master: optax.Params
    inner: optax.OptState


def with_master_weights(inner: optax.GradientTransformation, master_dtype=jnp.float32
                        ) -> optax.GradientTransformation:
    """Low-precision (e.g. bf16) params with a full-precision master copy in
    the optimizer state.

    `inner` sees f32 grads and the f32 master params; the returned updates are
    f32 and exact, so `optax.apply_updates(params, updates)` sets the params
    to the master copy rounded to the params' dtype (the master is never
    rounded). Non-floating leaves get zero updates.

    Example:
        >>> tx = with_master_weights(optax.adamw(1e-3))
        >>> state = tx.init(params_bf16)
        >>> updates, state = tx.update(grads_bf16, state, params_bf16)
        >>> params_bf16 = optax.apply_updates(params_bf16, updates)
    """
    master_dtype = _dtype(master_dtype)

    def init(params):
        master = cast_floating(params, master_dtype)
        return MasterWeightsState(master, inner.init(master))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("with_master_weights needs params in update(grads, state, params)")
        # Integer leaves' gradients (float0 from `jax.grad(..., allow_int=True)`) become zeros of their dtype.
        grads = jax.tree.map(lambda g, m: g if _is_float(m.dtype) else jnp.zeros_like(m),
                             cast_floating(updates, master_dtype), state.master)
        inner_updates, new_inner = inner.update(grads, state.inner, state.master, **extra)
        # An integer leaf's master stays as it is (weight decay would otherwise move it, truncated).
        new_master = jax.tree.map(lambda old, new: new if _is_float(old.dtype) else old, state.master,
                                  optax.apply_updates(state.master, inner_updates))

        def delta(m, p):
            if not _is_float(p.dtype):
                return jnp.zeros_like(p)
            # Both operands are representable in the master dtype, so the
            # difference is exact and p + delta rounds back to round(m).
            return m.astype(p.dtype).astype(master_dtype) - p.astype(master_dtype)

        return jax.tree.map(delta, new_master, params), MasterWeightsState(new_master, new_inner)

    return optax.GradientTransformationExtraArgs(init, update)
