"""The one matmul entry point: every linear layer computes `x @ w` through `dot`.

`w` is a weight leaf: a plain array, or any object that implements
`__jmem_dot__(x) -> y` (quantized tensors, LoRA-wrapped weights, several
adapters for serving). Techniques compose by replacing leaves, not by forking
the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def float_input(x: jax.Array, dtype) -> jax.Array:
    """`x` as a float: integer (or bool) inputs take the weight's float `dtype` (float32 when it is not a float
    dtype), as `jnp.matmul` promotes them against a float weight; float inputs are returned unchanged."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    dtype = jnp.dtype(dtype)
    return x.astype(dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32)


def dot(x: jax.Array, w) -> jax.Array:
    """`x[..., in] @ w[in, out] -> [..., out]` in `x.dtype`, accumulating in f32; an integer `x` is
    first promoted to the weight's float dtype (`float_input`), for plain and quantized weights alike.

    Example:
        >>> y = dot(jnp.ones((2, 4)), jnp.ones((4, 3)))  # f32[2, 3]
    """
    x = float_input(x, getattr(w, "dtype", jnp.float32))
    if hasattr(w, "__jmem_dot__"):
        return w.__jmem_dot__(x)
    w = jnp.asarray(w)
    if w.dtype != x.dtype:
        w = w.astype(x.dtype)
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def recompute_weight_in_backward(fn):
    """`fn(x, w)`, a matmul that derives its float weight from the leaf `w` (decodes a packed leaf, all-gathers
    a ZeRO-3 shard), with a backward pass that derives it again rather than keeping it: the residuals are `x`
    and the leaf. Inside a layer scan without remat the derived weights were otherwise kept for every layer:
    a QLoRA step held more than a LoRA step on the float base, and a ZeRO-3 step every layer's gathered
    weights (docs/benchmarks.md); the decode or gather runs twice instead, as FSDP gathers again for the
    backward pass."""
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


@recompute_weight_in_backward
def decoded_dot(x: jax.Array, w) -> jax.Array:
    """`x[..., in] @ w.dequantize()[in, out]` in `x.dtype`, accumulating in f32: the `__jmem_dot__` of a packed
    weight leaf (quantized tensors, GGUF blocks), decoded inside the traced step and again in the backward
    pass (`recompute_weight_in_backward`)."""
    y = jnp.matmul(x, w.dequantize(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def partition_specs(w, lead: tuple, rows, cols, row_pieces: int = 1):
    """How to split weight leaf `w` `[..., in, out]` over a mesh: a tree shaped like `w` of `PartitionSpec`s.

    `lead` holds the mesh axes of the leading (stacked-layers) axes, `rows` and `cols` those of the
    input and output axes (None, a mesh axis name or a tuple of them), as `Rules.spec` gives them for
    the float kernel; `row_pieces` is how many shards the input axis is cut into. A plain array
    takes the spec as is; a leaf implementing `__jmem_dot__` says how its own children split
    (`__jmem_partition__`, same arguments), and raises ValueError when a cut would fall inside one
    of its packing units (a pack word, a quantization group, a GGML block).

    Example:
        >>> specs = partition_specs(int8_leaf, (None,), None, "tensor")   # column-parallel, stacked layers
        >>> specs.packed, specs.scale
        (PartitionSpec(None, None, 'tensor'), PartitionSpec(None, None, 'tensor'))
    """
    from jax.sharding import PartitionSpec as P

    if hasattr(w, "__jmem_partition__"):
        return w.__jmem_partition__(tuple(lead), rows, cols, row_pieces)
    if hasattr(w, "__jmem_dot__"):
        raise ValueError(f"a {type(w).__name__} weight does not say how to split over devices "
                         f"(no __jmem_partition__)")
    return P(*lead, rows, cols)


def check_row_split(n_in: int, row_pieces: int, unit: int, what: str) -> None:
    """Refuse cutting `n_in` input rows into `row_pieces` shards when a shard would not hold whole
    `unit`s of rows (`what` names the unit, e.g. "quantization groups of 128 rows")."""
    if row_pieces > 1 and (n_in % row_pieces or (n_in // row_pieces) % unit):
        raise ValueError(f"its {n_in} input rows cut into {row_pieces} shards of {n_in / row_pieces:g} rows would "
                         f"split {what}; accepted: shards of a multiple of {unit} rows")
