"""The softmax scale every attention kernel accepts: a Python float, a NumPy/JAX scalar, or a traced one.

The Pallas kernels bake the scale into their compiled body (a static value),
so a concrete scale is turned into a Python float. A traced scale (a learned
temperature, or a value computed inside `jax.jit`) has no value at trace time;
it is folded into the queries instead: softmax(s * (q k^T)) = softmax((s q) k^T),
and the kernel runs with scale 1. The result, and the gradient with respect to
the scale, then come out of the same kernel. Folding rounds s * q to q's
dtype, which in bf16 is one extra rounding of the queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def split_scale(name: str, q, sm_scale, head_dim: int):
    """(queries, float scale) for a kernel whose scale must be static.

    Args:
        name: the public entry point, for error messages.
        q: the queries (any layout; only multiplied elementwise).
        sm_scale: None (1/sqrt(head_dim)), a concrete real scalar, or a traced scalar.
        head_dim: the real head dimension (before any padding).

    Returns:
        (q, scale): q unchanged with float(sm_scale), or q * sm_scale (in q's
        dtype) with 1.0 when sm_scale is traced.

    Example:
        >>> q, scale = split_scale("flash_attention", q, sm_scale, q.shape[-1])
    """
    scale = check_scale(name, sm_scale)
    if sm_scale is None:
        return q, float(head_dim) ** -0.5
    if scale is None:  # traced
        return (q * sm_scale.reshape(())).astype(q.dtype), 1.0
    return q, scale


def check_scale(name: str, sm_scale) -> float | None:
    """ValueError naming `sm_scale` unless it is None, one real scalar (returned as a finite float), or a
    traced real scalar (None is returned: its value is not known)."""
    if sm_scale is None:
        return None
    if isinstance(sm_scale, jax.core.Tracer):
        real = jnp.issubdtype(sm_scale.dtype, jnp.floating) or jnp.issubdtype(sm_scale.dtype, jnp.integer)
        if sm_scale.size != 1 or not real:
            raise ValueError(f"{name}: sm_scale is a traced {sm_scale.dtype}{list(sm_scale.shape)}; accepted: one real scalar")
        return None
    try:
        value = np.asarray(sm_scale)
    except Exception as e:  # noqa: BLE001 - anything that is not array-like is a bad scale
        raise ValueError(f"{name}: sm_scale={sm_scale!r}; accepted: None or one real scalar") from e
    if value.size != 1 or not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
        raise ValueError(f"{name}: sm_scale={sm_scale!r} ({value.dtype}{list(value.shape)}); accepted: None or one real scalar")
    scale = float(value.reshape(()))
    if not np.isfinite(scale):  # every logit would be NaN or infinite
        raise ValueError(f"{name}: sm_scale={sm_scale!r}; accepted: None or one finite real scalar")
    return scale
