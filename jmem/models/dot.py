"""The one matmul entry point: every linear layer computes `x @ w` through `dot`.

`w` is a weight leaf: a plain array, or any object that implements
`__jmem_dot__(x) -> y` (quantized tensors, LoRA-wrapped weights, several
adapters for serving). Techniques compose by replacing leaves, not by forking
the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot(x: jax.Array, w) -> jax.Array:
    """`x[..., in] @ w[in, out] -> [..., out]` in `x.dtype`, accumulating in f32.

    Example:
        >>> y = dot(jnp.ones((2, 4)), jnp.ones((4, 3)))  # f32[2, 3]
    """
    if hasattr(w, "__jmem_dot__"):
        return w.__jmem_dot__(x)
    w = jnp.asarray(w)
    if w.dtype != x.dtype:
        w = w.astype(x.dtype)
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
