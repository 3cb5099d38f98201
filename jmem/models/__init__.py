"""Llama-family decoder (Flax NNX), its configuration and KV caches."""

from jmem.models.cache import ContiguousKVCache
from jmem.models.config import LlamaConfig, get_config
from jmem.models.llama import LOGICAL_AXES, Llama, forward, unstack_layers

__all__ = ["ContiguousKVCache", "LOGICAL_AXES", "Llama", "LlamaConfig", "forward", "get_config", "unstack_layers"]
