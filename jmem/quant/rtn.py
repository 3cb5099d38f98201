"""Round-to-nearest quantization: the baseline every calibrated method is measured against."""

from __future__ import annotations

import jax

from jmem.quant.qtensor import IntTensor


def rtn_quantize(w: jax.Array, bits: int = 4, group_size: int | None = 128, symmetric: bool = True,
                 clip: jax.Array | None = None) -> IntTensor:
    """Quantize a float `[..., in, out]` weight by rounding each value to its group's grid.

    Args:
      w: float[..., in, out] (leading axes, e.g. stacked layers, are kept).
      bits: 2, 3, 4 or 8.
      group_size: input rows sharing one scale; None for one scale per output column.
      symmetric: scale only, or scale plus an integer zero point per group.
      clip: optional f32[..., in/group_size, out] range-shrink factors in (0, 1].

    Returns:
      An `IntTensor` of the same logical shape.

    Example:
        >>> q = rtn_quantize(w, bits=4, group_size=128)     # ~4.125 bits per weight
        >>> q8 = rtn_quantize(w, bits=8, group_size=None)   # int8 per channel
    """
    return IntTensor.quantize(w, bits=bits, group_size=group_size, symmetric=symmetric, clip=clip)


def int8_quantize(w: jax.Array) -> IntTensor:
    """Symmetric int8 with one scale per output column (LLM.int8's weight format without outliers)."""
    return rtn_quantize(w, bits=8, group_size=None, symmetric=True)
