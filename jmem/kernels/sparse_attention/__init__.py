"""Block-sparse attention under `jmem.kernels.masks` masks: Pallas kernel and dense reference."""

from jmem.kernels.sparse_attention.kernel import SparseStats, sparse_attention, sparse_attention_stats, sparse_attention_visits
from jmem.kernels.sparse_attention.reference import sparse_attention_reference

__all__ = ["SparseStats", "sparse_attention", "sparse_attention_reference", "sparse_attention_stats", "sparse_attention_visits"]
