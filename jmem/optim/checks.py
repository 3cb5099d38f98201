"""Argument checks shared by the optimizers, run when an optimizer is built.

Each check raises one `ValueError` naming the optimizer, the argument, the
value and what is accepted (`adam8bit b2=1.0; accepted: a value in [0, 1)`).
Numbers may be Python, NumPy or concrete 0-d JAX scalars (booleans are not
numbers). JAX tracers are skipped: `optax.inject_hyperparams` passes
hyperparameters as arrays, traced inside a jitted update, and they were
checked as concrete arrays when the optimizer's state was initialised; one
that sets array shapes (a rank, a block size) is refused traced, naming
`static_args`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def fail(who: str, name: str, value, accepted: str):
    raise ValueError(f"{who} {name}={value!r}; accepted: {accepted}")


def _traced(v) -> bool:
    return isinstance(v, jax.core.Tracer)


def _scalar(v, kinds: tuple):
    """`v` as a Python float/int if it is a real scalar of a dtype kind in `kinds` ("i", "f"), else None."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)) and "i" in kinds:
        return int(v)
    if isinstance(v, (float, np.floating)) and "f" in kinds:
        return float(v)
    if isinstance(v, (np.ndarray, jax.Array)) and v.ndim == 0:
        if "i" in kinds and jnp.issubdtype(v.dtype, jnp.integer):
            return int(v)
        if "f" in kinds and (jnp.issubdtype(v.dtype, jnp.floating) or jnp.issubdtype(v.dtype, jnp.integer)):
            return float(v)
    return None


def number(who: str, name: str, v, ok, accepted: str, *, none_ok: bool = False):
    """Checks that `v` is a real number with `ok(float(v))` (None passes when `none_ok`); returns `v`."""
    if _traced(v) or (v is None and none_ok):
        return v
    x = _scalar(v, ("i", "f"))
    if x is None or not ok(x):
        fail(who, name, v, accepted)
    return v


def integer(who: str, name: str, v, minimum: int, *, none_ok: bool = False, shapes: bool = False):
    """Checks that `v` is an integer (not a bool) >= `minimum`; returns it as a Python int (or `v` if traced/None).

    `shapes`: the value sets array shapes (a rank, a block size), so a traced one is refused with
    the `static_args` hint (optax.inject_hyperparams traces hyperparameters inside a jitted update)."""
    if _traced(v) and shapes:
        fail(who, name, v, f"a Python integer (it sets array shapes); with optax.inject_hyperparams, list {name!r} "
                           "in static_args")
    if _traced(v) or (v is None and none_ok):
        return v
    x = _scalar(v, ("i",))
    if x is None or x < minimum:
        fail(who, name, v, ("None or " if none_ok else "") + f"an integer >= {minimum}")
    return x


def decay(who: str, name: str, v, *, none_ok: bool = False):
    """A decay rate such as Adam's b1, b2: in [0, 1)."""
    return number(who, name, v, lambda x: 0 <= x < 1, ("None or " if none_ok else "") + "a value in [0, 1)",
                  none_ok=none_ok)


def non_negative(who: str, name: str, v, *, none_ok: bool = False):
    """A finite number >= 0 (epsilons, weight decay)."""
    return number(who, name, v, lambda x: math.isfinite(x) and x >= 0,
                  ("None or " if none_ok else "") + "a finite number >= 0", none_ok=none_ok)


def positive(who: str, name: str, v, *, none_ok: bool = False):
    """A finite number > 0."""
    return number(who, name, v, lambda x: math.isfinite(x) and x > 0,
                  ("None or " if none_ok else "") + "a finite number > 0", none_ok=none_ok)


def rate(who: str, name: str, v, *, none_ok: bool = False):
    """A finite number >= 0 or a schedule (a callable): a learning rate or weight decay.

    None passes only where `none_ok` (adafactor's relative step); elsewhere optax would
    silently treat it as a rate of 1 and take steps up the gradient."""
    if callable(v):
        return v
    accepted = "a finite number >= 0 or a schedule (callable)" + (", or None" if none_ok else "")
    return number(who, name, v, lambda x: math.isfinite(x) and x >= 0, accepted, none_ok=none_ok)


def learning_rate(who: str, v, *, none_ok: bool = False):
    return rate(who, "learning_rate", v, none_ok=none_ok)


def float_dtype(who: str, name: str, v, *, none_ok: bool = False, squares: bool = False):
    """A floating dtype (anything `jnp.dtype` accepts, e.g. jnp.bfloat16 or "float32"); returns `v`.
    `squares`: the dtype holds squared gradients, which need float32's exponent range (float16's overflow above
    |g| = 256, and an eps of 1e-30 is 0 in it)."""
    if _traced(v) or (v is None and none_ok):
        return v
    accepted = ("None or " if none_ok else "") + "a floating dtype (e.g. jnp.float32, jnp.bfloat16, 'float32')"
    if squares:
        accepted = "a floating dtype with float32's range (float32, bfloat16): it holds squared gradients"
    if isinstance(v, (np.ndarray, jax.Array)):  # optax.inject_hyperparams calls a dtype like a schedule
        fail(who, name, v, accepted + f"; with optax.inject_hyperparams, list {name!r} in static_args")
    if v is None:
        fail(who, name, v, accepted)
    try:
        dt = jnp.dtype(v)
    except TypeError:
        fail(who, name, v, accepted)
    if not jnp.issubdtype(dt, jnp.floating) or (squares and jnp.finfo(dt).maxexp < jnp.finfo(jnp.float32).maxexp):
        fail(who, name, v, accepted)
    return v


def flag(who: str, name: str, v):
    """A bool (Python or NumPy): a string such as "no" is truthy and would silently mean True."""
    if not isinstance(v, (bool, np.bool_)):
        fail(who, name, v, "True or False")
    return bool(v)


def one_of(who: str, name: str, v, options: tuple[str, ...]):
    if not isinstance(v, str) or v not in options:
        fail(who, name, v, ", ".join(options))
    return v


def names(who: str, name: str, v) -> tuple[str, ...]:
    """A tuple of strings; a single string is one name (not its characters)."""
    if isinstance(v, str):
        return (v,)
    try:
        out = tuple(v)
    except TypeError:
        out = None
    if out is None or not all(isinstance(s, str) for s in out):
        fail(who, name, v, "a string or a tuple of strings")
    return out
