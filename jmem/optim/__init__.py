"""Memory-lean optimizers as optax GradientTransformations.

`adafactor` (factored second moments, stacked-layer factor rules),
`adam8bit` (block-wise 8-bit moments), `galore` (Adam on low-rank gradient
projections of the weight matrices), `make_optimizer(name, lr)` and
`decay_mask` (weight decay for all but normalization scales and biases).
"""

from jmem.optim.adafactor import Layout, adafactor, get_rule, last_two_rule, optax_rule, stacked_rule
from jmem.optim.adam8bit import adam8bit, dequantize, dynamic_code, quantize, scale_by_adam8bit
from jmem.optim.galore import galore, galore_plan, scale_by_galore
from jmem.optim.factory import OPTIMIZERS, UnknownOptimizerError, decay_mask, make_optimizer

__all__ = [
    "Layout", "adafactor", "get_rule", "last_two_rule", "optax_rule", "stacked_rule",
    "adam8bit", "dequantize", "dynamic_code", "quantize", "scale_by_adam8bit",
    "galore", "galore_plan", "scale_by_galore",
    "OPTIMIZERS", "UnknownOptimizerError", "make_optimizer", "decay_mask",
]
