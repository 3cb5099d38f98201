"""Gradient accumulation: `k` microbatches by `lax.scan`, one update per step.

Activations live for one microbatch at a time, so temporary memory falls by
about `k` while the gradient is the full-batch gradient. The function being
differentiated must be *additive over the batch*: a sum over examples (or
tokens) divided by a constant computed from the whole batch, so that the sum
over microbatches equals the full-batch value. `jmem.train.loss` is written
that way: it returns a loss sum and the caller divides by the global token
count before differentiating.

Example:
    >>> n = batch["mask"].sum()
    >>> f = lambda p, mb: loss_sum(p, mb) / n
    >>> value, grads = accumulate_value_and_grad(f, params, batch, 4)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jmem.checks import check_int, is_int
from jmem.memory.offload import add_into, in_memory_space_of
from jmem.optim.checks import float_dtype


def check_divisible(batch_size: int, num_microbatches: int) -> None:
    """Raise a clear ValueError unless `num_microbatches` divides `batch_size`."""
    check_int("accum", num_microbatches, 1)  # the number of microbatches
    if batch_size % num_microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(
            f"accum={num_microbatches} does not divide batch={batch_size}; "
            f"accepted values: {', '.join(map(str, divisors))}"
        )


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Reshape every leaf [B, ...] -> [k, B/k, ...] (contiguous rows per microbatch).

    Raises:
        ValueError: a leaf that is not an array with a leading batch dimension
            (named by its path), leaves of different batch sizes, or k not dividing it.
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("split_microbatches: the batch has no arrays")
    for path, leaf in leaves:
        if not getattr(leaf, "shape", ()):
            where = f"batch{jax.tree_util.keystr(path)}"
            what = (f"has shape {leaf.shape}" if hasattr(leaf, "shape")
                    else f"is {leaf!r} ({type(leaf).__name__}, no shape)")
            raise ValueError(f"split_microbatches: leaf {where} {what}; "
                             "accepted: every leaf an array with a leading batch dimension")
    sizes = {leaf.shape[0] for _, leaf in leaves}
    if len(sizes) != 1:
        raise ValueError(f"split_microbatches: batch leaves disagree on the leading (batch) size: {sorted(sizes)}")
    (size,) = sizes
    check_divisible(size, num_microbatches)
    k = num_microbatches
    return jax.tree_util.tree_map(lambda x: x.reshape((k, size // k) + x.shape[1:]), batch)


def accumulate_value_and_grad(
    fn: Callable,
    params: Any,
    batch: Any,
    num_microbatches: int,
    *,
    has_aux: bool = False,
    accum_dtype=jnp.float32,
):
    """Sum of ``jax.value_and_grad(fn)(params, mb)`` over `k` microbatches.

    Args:
        fn: ``fn(params, microbatch) -> value`` (or ``(value, aux)`` with
            `has_aux`), additive over the batch (see the module docstring).
        params: the pytree differentiated.
        batch: pytree of arrays with a common leading batch dim B.
        num_microbatches: k, dividing B. k == 1 calls `fn` once, without a scan.
        has_aux: `fn` returns ``(value, aux)``; aux leaves are summed too.
        accum_dtype: dtype of the gradient accumulator (f32 so bf16 gradients
            do not lose precision when summed); the result is cast back to each
            parameter's dtype.

    Returns:
        ``(value, grads)`` or ``((value, aux), grads)`` with `has_aux`; `grads`
        has the structure and dtypes of `params`.

    Raises:
        ValueError: k is not an integer >= 1 or does not divide the batch size; `accum_dtype` is not
            a floating dtype; with k > 1, a batch leaf that is not an array with a leading batch dimension.
    """
    float_dtype("accumulate_value_and_grad", "accum_dtype", accum_dtype)
    grad_fn = jax.value_and_grad(fn, has_aux=has_aux)
    if is_int(num_microbatches) and num_microbatches == 1:
        return grad_fn(params, batch)
    micro = split_microbatches(batch, num_microbatches)

    def zeros_like_acc(x):
        dt = accum_dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jnp.zeros(x.shape, dt)

    # The first microbatch's shapes give the value/aux structure for the carry. A parameter
    # offloaded to host memory gets its gradient there (jmem.memory.offload), and so its sum.
    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    out_shape = jax.eval_shape(grad_fn, params, first)
    value0, grads0 = jax.tree_util.tree_map(lambda s: zeros_like_acc(jnp.zeros(s.shape, s.dtype)), out_shape)
    carry0 = value0, jax.tree_util.tree_map(in_memory_space_of, grads0, params)

    def body(carry, mb):
        out = jax.tree_util.tree_map(jnp.asarray, grad_fn(params, mb))  # aux may hold Python numbers
        carry = jax.tree_util.tree_map(add_into, carry, out)
        return carry, None

    total, _ = jax.lax.scan(body, carry0, micro)
    value_aux, grads = total
    grads = jax.tree_util.tree_map(lambda g, p: g.astype(jnp.asarray(p).dtype), grads, params)
    value_aux = jax.tree_util.tree_map(lambda v, s: v.astype(s.dtype), value_aux, out_shape[0])
    return value_aux, grads
