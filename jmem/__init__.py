"""jmem: make large language models fit and run fast in limited accelerator memory, in JAX.

Example:
    >>> import jmem
    >>> lm = jmem.load("smollm2-135m")
    >>> lm.generate(["The capital of France is"], max_new_tokens=8)
    >>> jmem.optim.adafactor(1e-2)     # every submodule is reachable from `import jmem`
"""

import importlib
import pkgutil

from jmem.lm import LM, load

__version__ = "0.1.0"

SUBMODULES = tuple(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def __getattr__(name: str):
    """Import a submodule on first use (`jmem.optim.adafactor` after a plain `import jmem`)."""
    if name in SUBMODULES:
        return importlib.import_module(f"jmem.{name}")
    raise AttributeError(f"module 'jmem' has no attribute {name!r}")


__all__ = ["LM", "load", "__version__"]
