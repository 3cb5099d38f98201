"""Paged attention for serving: decode, ragged prefill + decode, and page writes.

Pages are `[kv_heads, num_pages, page_size, head_dim]` (float, or int8 /
float8_e4m3fn with f32 per-page-per-head scales). Each kernel has a plain-jnp
`*_reference` beside it. The kernels have a Triton body (GPU) and a Mosaic
body (TPU) behind one wrapper; on CPU they run in the Pallas interpreter.

Lowering: the Mosaic body compiles ahead of time for TPU v4, v5e and v6e
(tests/kernels/test_paged_attention.py, through libtpu's topologies). The
Triton decode body matched the reference on an H200 (bf16); JAX 0.11 marks Pallas' Triton backend
deprecated (a DeprecationWarning on first use) in favour of Mosaic GPU, for
which there is no body yet.
"""

from jmem.kernels.paged_attention.kernel import paged_attention
from jmem.kernels.paged_attention.ragged import ragged_paged_attention
from jmem.kernels.paged_attention.reference import (
    dequantize_pages,
    paged_attention_reference,
    quantize_pages,
    ragged_paged_attention_reference,
    write_pages_reference,
)
from jmem.kernels.paged_attention.write import append_pages, slots_for, write_pages

__all__ = [
    "append_pages",
    "dequantize_pages",
    "paged_attention",
    "paged_attention_reference",
    "quantize_pages",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "slots_for",
    "write_pages",
    "write_pages_reference",
]
