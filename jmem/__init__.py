"""jmem: make large language models fit and run fast in limited accelerator memory, in JAX.

Example:
    >>> import jmem
    >>> lm = jmem.load("smollm2-135m")
    >>> lm.generate(["The capital of France is"], max_new_tokens=8)
"""

from jmem.lm import LM, load

__version__ = "0.1.0"
__all__ = ["LM", "load", "__version__"]
