"""NF4 with double quantization (QLoRA, Dettmers et al. 2023): the `NF4Tensor` leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from jmem.models.dot import check_row_split
from jmem.quant.qtensor import QTensor, check_finite, check_weight_shape, pack_bits, unpack_bits

NF4_BLOCK = 64
NF4_ABSMAX_BLOCK = 256

# bitsandbytes' NF4 code book: quantiles of N(0, 1), normalized to [-1, 1],
# with an exact zero (QLoRA, appendix E).
NF4_CODE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
     0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=np.float32,
)


@jax.tree_util.register_pytree_node_class
class NF4Tensor(QTensor):
    """NF4 weight with double quantization (QLoRA).

    `W[i, o] = NF4_CODE[c[i, o]] * absmax[i // 64, o]`, where the absmax table
    (f32[..., in/64, out], flattened per matrix and padded to a multiple of
    256) is stored as int8 codes times one f32 scale per 256-block plus one
    f32 mean per matrix.

    Children:
      codes: u8[..., in/2, out], two 4-bit codes per byte (row 2r low nibble).
      absmax_q: i8[..., n_blocks2 * 256].
      absmax_scale: f32[..., n_blocks2].
      absmax_mean: f32[...].

    Example:
        >>> q = NF4Tensor.quantize(w)   # w: f32[576, 1536]
        >>> q.nbytes * 8 / q.size       # ~4.127 bits per weight
    """

    def __init__(self, codes, absmax_q, absmax_scale, absmax_mean, dtype=jnp.float32):
        self.codes, self.absmax_q, self.absmax_scale, self.absmax_mean = codes, absmax_q, absmax_scale, absmax_mean
        self.dtype = jnp.dtype(dtype)

    def tree_flatten(self):
        return (self.codes, self.absmax_q, self.absmax_scale, self.absmax_mean), (self.dtype.name,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, dtype=aux[0])

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, rows, n_out = self.codes.shape
        return (*lead, rows * 2, n_out)

    def absmax(self) -> jax.Array:
        """The dequantized first-level absmax, f32[..., in/64, out]."""
        *lead, n_in, n_out = self.shape
        n_abs = n_in // NF4_BLOCK * n_out
        q = self.absmax_q.astype(jnp.float32).reshape(*lead, -1, NF4_ABSMAX_BLOCK)
        a = (q * self.absmax_scale[..., None]).reshape(*lead, -1)[..., :n_abs]
        a = a + self.absmax_mean[..., None]
        return a.reshape(*lead, n_in // NF4_BLOCK, n_out)

    def __jmem_partition__(self, lead, rows, cols, row_pieces):
        """Codes split like the float kernel; the double-quantized absmax table (flattened per matrix,
        1/64 of the codes' bytes) stays whole, and each device slices its own blocks of it."""
        check_row_split(self.shape[-2], row_pieces, NF4_BLOCK, f"absmax blocks of {NF4_BLOCK} rows")
        whole = P(*lead)
        return NF4Tensor.tree_unflatten(self.tree_flatten()[1], (P(*lead, rows, cols), whole, whole, whole))

    def __jmem_dot__(self, x: jax.Array) -> jax.Array:
        """`x[..., in] @ W`: the Pallas kernel where `jmem.quant.matmul_impl` picks it, else dequantize + dot."""
        from jmem.quant.kernel import quantized_dot  # the kernel module imports this one

        return quantized_dot(x, self)

    def dequantize(self, dtype=None) -> jax.Array:
        dtype = self.dtype if dtype is None else dtype
        *lead, n_in, n_out = self.shape
        c = unpack_bits(self.codes, 4)
        v = jnp.asarray(NF4_CODE)[c].reshape(*lead, n_in // NF4_BLOCK, NF4_BLOCK, n_out)
        w = v * self.absmax()[..., None, :]
        return w.reshape(*lead, n_in, n_out).astype(dtype)

    @classmethod
    def quantize(cls, w) -> "NF4Tensor":
        """NF4-quantize a float `[..., in, out]` weight; `in` must be a multiple of 64."""
        check_weight_shape(w, "NF4 quantization")
        check_finite(w, "the weight w")
        w = jnp.asarray(w)
        if w.shape[-2] % NF4_BLOCK:
            raise ValueError(f"NF4 needs the input dimension to be a multiple of {NF4_BLOCK}; got {w.shape[-2]}")
        return cls(*_nf4_arrays(w), dtype=w.dtype)


@jax.jit
def _nf4_arrays(w):
    *lead, n_in, n_out = w.shape
    wb = w.astype(jnp.float32).reshape(*lead, n_in // NF4_BLOCK, NF4_BLOCK, n_out)
    absmax = jnp.maximum(jnp.abs(wb).max(axis=-2), 1e-12)
    # Second level: int8 of (absmax - mean) in blocks of 256.
    flat = absmax.reshape(*lead, -1)
    mean = flat.mean(axis=-1)
    centred = flat - mean[..., None]
    pad = (-flat.shape[-1]) % NF4_ABSMAX_BLOCK
    centred = jnp.pad(centred, [(0, 0)] * len(lead) + [(0, pad)])
    blocks = centred.reshape(*lead, -1, NF4_ABSMAX_BLOCK)
    scale2 = jnp.maximum(jnp.abs(blocks).max(axis=-1) / 127.0, 1e-12)
    q2 = jnp.clip(jnp.round(blocks / scale2[..., None]), -127, 127).astype(jnp.int8).reshape(*lead, -1)
    # Encode against the absmax the reader will reconstruct, so the codes
    # absorb the second-level error instead of compounding it.
    absmax_hat = NF4Tensor(jnp.zeros((*lead, n_in // 2, n_out), jnp.uint8), q2, scale2, mean).absmax()
    normed = wb / absmax_hat[..., None, :]
    c = jnp.argmin(jnp.abs(normed[..., None] - jnp.asarray(NF4_CODE)), axis=-1).reshape(*lead, n_in, n_out)
    return pack_bits(c, 4), q2, scale2, mean


def nf4_quantize(w) -> NF4Tensor:
    """NF4 with double quantization of a float `[..., in, out]` weight (`in` a multiple of 64)."""
    return NF4Tensor.quantize(w)
