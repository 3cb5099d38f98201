"""Flash attention: Pallas kernel (forward + backward) and its plain-jnp reference."""

from jmem.kernels.flash_attention.kernel import flash_attention
from jmem.kernels.flash_attention.reference import attention_reference

__all__ = ["attention_reference", "flash_attention"]
