"""Float8 e4m3 weights with per-output-channel scales: the `FP8Tensor` leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jmem.quant.qtensor import QTensor, check_finite, check_weight_shape

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@jax.tree_util.register_pytree_node_class
class FP8Tensor(QTensor):
    """Float8 e4m3 weight with one f32 scale per output column.

    Children: q: f8e4m3fn[..., in, out]; scale: f32[..., 1, out].

    Example:
        >>> q = FP8Tensor.quantize(w)   # 1 byte per weight + 4 bytes per column
    """

    def __init__(self, q, scale, dtype=jnp.float32):
        self.q, self.scale = q, scale
        self.dtype = jnp.dtype(dtype)

    def tree_flatten(self):
        return (self.q, self.scale), (self.dtype.name,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, dtype=aux[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def __jmem_partition__(self, lead, rows, cols, row_pieces):
        """Values split like the float kernel, the per-column scales with their columns."""
        return FP8Tensor.tree_unflatten(self.tree_flatten()[1], (P(*lead, rows, cols), P(*lead, None, cols)))

    def dequantize(self, dtype=None) -> jax.Array:
        dtype = self.dtype if dtype is None else dtype
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)

    @classmethod
    def quantize(cls, w) -> "FP8Tensor":
        """FP8-quantize a float `[..., in, out]` weight (at least 2 axes, none empty)."""
        check_weight_shape(w, "FP8 quantization")
        check_finite(w, "the weight w")
        w = jnp.asarray(w)
        return cls(*_fp8_arrays(w), dtype=w.dtype)


@jax.jit
def _fp8_arrays(w):
    wf = w.astype(jnp.float32)
    scale = jnp.maximum(jnp.abs(wf).max(axis=-2, keepdims=True) / FP8_MAX, 1e-12)
    q = jnp.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def fp8_quantize(w) -> FP8Tensor:
    """Float8 e4m3 with one f32 scale per output column of a float `[..., in, out]` weight."""
    return FP8Tensor.quantize(w)
