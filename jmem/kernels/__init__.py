"""Attention kernels: Pallas kernels beside plain-jnp references, and one dispatcher."""

from jmem.kernels.dispatch import IMPLS, attention, xla_attention

__all__ = ["IMPLS", "attention", "xla_attention"]
