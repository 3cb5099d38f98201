"""Compiler-measured and analytic memory: `measure(fn, *args, target=None)` and `estimate(...)`.

Example:
    >>> from jmem.memory import measure
    >>> report = measure(jax.value_and_grad(loss), params, batch)
    >>> report.temp_bytes, report.matmul_flops
"""

from jmem.memory.estimate import estimate
from jmem.memory.measure import MemoryReport, bytes_per_device, measure, measure_and_compile

__all__ = ["MemoryReport", "bytes_per_device", "estimate", "measure", "measure_and_compile"]
