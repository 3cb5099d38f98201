"""Quantized weights and the algorithms that make them.

Weight leaves (each implements `__jmem_dot__`, `dequantize`, `nbytes`):
`IntTensor` (int8 per channel; int2/3/4 group-wise, packed), `NF4Tensor`
(double-quantized NF4), `FP8Tensor` (e4m3, per-channel scales), and
`GGMLWeight` (GGUF blocks, in `jmem.quant.ggml_weight`). 4-bit int and NF4
leaves multiply through a Pallas kernel on GPU (`matmul_impl` chooses).

Example:
    >>> from jmem.quant import quantize
    >>> qmodel = quantize(model, "gptq", bits=4, group_size=64, calibration=ids_BT)
"""

from jmem.quant.api import calibration_tokens, group_sizes, quantize, weight_bytes
from jmem.quant.awq import InputScaled, awq_clip, awq_quantize, awq_scale
from jmem.quant.fp8 import FP8Tensor, fp8_quantize
from jmem.quant.gptq import gptq_quantize, hessian
from jmem.quant.kernel import current_matmul_impl, matmul_impl, quantized_dot
from jmem.quant.nf4 import NF4_CODE, NF4Tensor, nf4_quantize
from jmem.quant.qtensor import IntTensor, QTensor, pack_bits, unpack_bits
from jmem.quant.rtn import int8_quantize, rtn_quantize

__all__ = [
    "FP8Tensor", "IntTensor", "InputScaled", "NF4Tensor", "NF4_CODE", "QTensor", "awq_clip", "awq_quantize",
    "awq_scale", "calibration_tokens", "current_matmul_impl", "fp8_quantize", "gptq_quantize", "group_sizes", "hessian",
    "int8_quantize", "matmul_impl", "nf4_quantize", "pack_bits", "quantize", "quantized_dot", "rtn_quantize",
    "unpack_bits", "weight_bytes",
]
