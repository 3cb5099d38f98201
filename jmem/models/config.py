"""Model configuration: one frozen dataclass with presets."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DTYPES = {"f32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
          "f16": jnp.float16, "float16": jnp.float16}


def as_dtype(name_or_dtype):
    """`"bf16"` -> `jnp.bfloat16`; dtypes pass through; unknown names raise one clear error."""
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in DTYPES:
            raise ValueError(f"dtype {name_or_dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
        return DTYPES[name_or_dtype]
    return jnp.dtype(name_or_dtype).type


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: int = 49152
    """Number of token ids."""
    dim: int = 576
    """Width of the residual stream."""
    n_layers: int = 30
    """Number of decoder blocks (stacked on a leading `layers` axis)."""
    n_heads: int = 9
    """Query heads."""
    n_kv_heads: int = 3
    """Key/value heads (grouped-query attention: n_heads is a multiple)."""
    head_dim: int = 64
    """Width of one attention head."""
    ffn_dim: int = 1536
    """Hidden width of the SwiGLU MLP."""
    rope_base: float = 100000.0
    """RoPE frequency base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Reuse the token embedding as the output projection."""
    max_seq_len: int = 8192
    """Longest context the model is used with."""
    param_dtype: str = "f32"
    """Storage dtype of parameters (f32, bf16, f16)."""
    compute_dtype: str = "f32"
    """Dtype of activations and matmul inputs (f32, bf16, f16)."""
    attention_impl: str = "xla"
    """Attention implementation: auto, pallas, xla, reference (see `jmem.kernels.attention`)."""
    remat: str = "none"
    """Rematerialisation policy per layer (see `jmem.memory.remat`)."""
    loss_chunk: int = 1024
    """Sequence positions per chunk in the chunked cross-entropy (bounds f32 logits memory)."""
    moe_experts: int = 0
    """Experts of a mixture-of-experts MLP in every block (0: the dense SwiGLU MLP)."""
    moe_top_k: int = 2
    """Experts each token is routed to (MoE only)."""
    moe_capacity_factor: float = 1.25
    """Places per expert relative to an even split of the routed tokens; the rest are dropped (MoE only).
    Forwards with a KV cache (generation, serving) always route without dropping."""
    moe_dropless: bool = False
    """Route every forward without capacity (grouped matmuls; training too), as Mixtral does (MoE only)."""
    moe_aux_weight: float = 0.01
    """Weight of the load-balancing loss added to the training loss (MoE only)."""
    moe_z_weight: float = 1e-3
    """Weight of the router z-loss added to the training loss (MoE only)."""

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name}={getattr(self, name)} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        as_dtype(self.param_dtype)
        as_dtype(self.compute_dtype)
        from jmem.kernels.dispatch import IMPLS

        if self.attention_impl not in IMPLS:
            raise ValueError(f"LlamaConfig.attention_impl={self.attention_impl!r}; accepted: {', '.join(IMPLS)}")
        if self.moe_experts < 0:
            raise ValueError(f"LlamaConfig.moe_experts={self.moe_experts} must be >= 0 (0: dense MLP)")
        if self.moe_experts:
            from jmem.models.moe import check_moe

            check_moe(self.moe_experts, self.moe_top_k, self.moe_capacity_factor)
            if self.moe_aux_weight < 0 or self.moe_z_weight < 0:
                raise ValueError(f"LlamaConfig.moe_aux_weight={self.moe_aux_weight} and moe_z_weight="
                                 f"{self.moe_z_weight} must be >= 0")

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        if self.moe_experts:  # router + one SwiGLU MLP per expert
            mlp = self.dim * self.moe_experts + self.moe_experts * mlp
        per_layer = attn + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.dim * self.vocab_size
        return self.vocab_size * self.dim + self.n_layers * per_layer + self.dim + head

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A random-init model small enough for unit tests (byte-level vocabulary)."""
        base = dict(vocab_size=259, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                    rope_base=10000.0, max_seq_len=512, tie_embeddings=False, loss_chunk=64)
        return cls(**{**base, **overrides})

    @classmethod
    def small(cls, **overrides) -> "LlamaConfig":
        """About 3.6M parameters: the default model trained from scratch by `experiments/train.py`."""
        base = dict(vocab_size=259, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768,
                    rope_base=10000.0, max_seq_len=1024, tie_embeddings=True, loss_chunk=256)
        return cls(**{**base, **overrides})

    @classmethod
    def smollm2_135m(cls, **overrides) -> "LlamaConfig":
        """SmolLM2-135M: 30 blocks, width 576, 9 query / 3 key-value heads, tied embeddings."""
        return cls(**overrides)

    @classmethod
    def bench_8l(cls, **overrides) -> "LlamaConfig":
        """The memory-benchmark model: 8 layers, width 512, 8 heads, MLP 1408, vocab 8192."""
        base = dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=1408,
                    rope_base=10000.0, max_seq_len=1024, tie_embeddings=False, loss_chunk=256)
        return cls(**{**base, **overrides})

    @classmethod
    def tiny_moe(cls, **overrides) -> "LlamaConfig":
        """`tiny` with a 4-expert top-2 MoE MLP in every block (for tests and the MoE examples)."""
        return cls.tiny(**{**dict(moe_experts=4, moe_top_k=2), **overrides})


PRESETS = {"tiny": LlamaConfig.tiny, "small": LlamaConfig.small, "smollm2-135m": LlamaConfig.smollm2_135m,
           "bench-8l": LlamaConfig.bench_8l, "tiny-moe": LlamaConfig.tiny_moe}


def get_config(name: str, **overrides) -> LlamaConfig:
    """A preset by name: tiny, small, smollm2-135m, bench-8l, tiny-moe."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; accepted: {', '.join(PRESETS)}")
    return PRESETS[name](**overrides)
