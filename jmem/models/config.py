"""Model configuration: one frozen dataclass with presets."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jmem.checks import check_bool, is_int, is_number

# The linear kernels of a dense block (`layers.<name>.kernel`), which quantization, pruning, LoRA and
# the memory estimate name.
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# The stacked expert weights `[(layers,) experts, in, out]` of a mixture-of-experts block, and their names
# inside a model's blocks (`layers.moe.<name>`), as `jmem.quant.quantize`, `jmem.lora.apply_lora` and
# `--lora-targets` take them.
EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")
EXPERT_TARGETS = tuple(f"moe.{n}" for n in EXPERT_WEIGHTS)

DTYPES = {"f32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
          "f16": jnp.float16, "float16": jnp.float16}


def as_dtype(name_or_dtype):
    """`"bf16"` -> `jnp.bfloat16`; dtypes pass through; unknown names raise one clear error."""
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in DTYPES:
            raise ValueError(f"dtype {name_or_dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
        return DTYPES[name_or_dtype]
    try:
        dtype = jnp.dtype(name_or_dtype).type
    except TypeError:
        dtype = None
    if dtype not in DTYPES.values():  # an int8 model was all zeros
        raise ValueError(f"dtype {name_or_dtype!r} is not supported; accepted: {', '.join(DTYPES)} (or their "
                         "jnp dtypes)")
    return dtype


def normal_init(stddev: float):
    """A normal initializer that draws in f32 and then casts, so a model built with bf16 parameters holds
    the rounded weights of the same model in f32 (a draw in bf16 is a different model)."""
    import jax

    def init(key, shape, dtype=jnp.float32):
        return (jax.random.normal(key, shape, jnp.float32) * stddev).astype(dtype)

    return init


ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


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
    rope_scaling: str = "none"
    """RoPE context-extension scheme: none, linear (positions divided by `rope_factor`), llama3
    (Llama-3.1's per-frequency blend of `rope_factor`), yarn (NTK-by-parts ramp plus attention
    temperature). See `rope_frequencies`."""
    rope_factor: float = 1.0
    """Context-extension factor of `rope_scaling` (ignored for none)."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above original_context / low_freq_factor are divided by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below original_context / high_freq_factor are kept as they are."""
    rope_original_context: int = 8192
    """llama3 / yarn: the context length the model was pre-trained with."""
    rope_beta_fast: float = 32.0
    """yarn: rotations at which the ramp starts keeping the original frequency."""
    rope_beta_slow: float = 1.0
    """yarn: rotations at which the ramp fully interpolates."""
    rope_freq_factors: tuple[float, ...] | None = None
    """Explicit per-frequency divisors (`head_dim`/2 or `rope_dim`/2 values): frequency i becomes
    inv_freq_i / factor_i, as llama.cpp applies a GGUF's `rope_freqs.weight` (how its converter stores
    Llama-3.1 scaling). Applied before `rope_scaling`."""
    rope_dim: int = 0
    """Rotated width of each head (partial rotary); 0 rotates the whole head. Rotated pairs are
    (i, i + head_dim/2) for i < rope_dim/2, the layout llama.cpp's first rope_dim dims map to."""
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
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len",
                     "loss_chunk", "rope_original_context"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:  # a float failed in JAX; True built a width-1 model
                raise ValueError(f"LlamaConfig.{name}={value!r} must be a positive integer")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim}; accepted: an even number (RoPE rotates pairs)")
        for name in ("rope_base", "norm_eps"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and (value > 0 if name == "rope_base" else value >= 0)):
                raise ValueError(f"LlamaConfig.{name}={value!r}; accepted: a finite number "
                                 f"{'> 0' if name == 'rope_base' else '>= 0'}")  # NaN logits before
        check_bool("LlamaConfig.tie_embeddings", self.tie_embeddings)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        as_dtype(self.param_dtype)
        as_dtype(self.compute_dtype)
        self._check_rope()
        from jmem.kernels.dispatch import IMPLS

        if self.attention_impl not in IMPLS:
            raise ValueError(f"LlamaConfig.attention_impl={self.attention_impl!r}; accepted: {', '.join(IMPLS)}")
        from jmem.memory.remat import validate as validate_remat

        try:
            validate_remat(self.remat)
        except ValueError as e:
            raise ValueError(f"LlamaConfig.remat: {e}") from None
        if not is_int(self.moe_experts) or self.moe_experts < 0:
            raise ValueError(f"LlamaConfig.moe_experts={self.moe_experts} must be >= 0 (0: dense MLP)")
        if self.moe_experts:
            from jmem.models.moe import check_moe

            check_moe(self.moe_experts, self.moe_top_k, self.moe_capacity_factor)
            for name in ("moe_aux_weight", "moe_z_weight"):
                w = getattr(self, name)
                if not (is_number(w) and math.isfinite(w) and w >= 0):
                    raise ValueError(f"LlamaConfig.{name}={w!r}; accepted: a finite number >= 0")
            check_bool("LlamaConfig.moe_dropless", self.moe_dropless)

    def _check_rope(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"LlamaConfig.rope_scaling={self.rope_scaling!r}; accepted: {', '.join(ROPE_SCALINGS)}")
        if self.rope_scaling != "none" and not (is_number(self.rope_factor) and 1.0 <= self.rope_factor < math.inf):
            raise ValueError(f"LlamaConfig.rope_factor={self.rope_factor!r} must be a finite number >= 1 with "
                             f"rope_scaling={self.rope_scaling!r}")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(f"LlamaConfig.rope_low_freq_factor={self.rope_low_freq_factor} and rope_high_freq_factor="
                             f"{self.rope_high_freq_factor} must satisfy 0 < low < high")
        if self.rope_scaling == "yarn" and not (is_number(self.rope_beta_slow) and is_number(self.rope_beta_fast)
                                                and 0 < self.rope_beta_slow < self.rope_beta_fast < math.inf):
            raise ValueError(f"LlamaConfig.rope_beta_slow={self.rope_beta_slow!r} and rope_beta_fast="
                             f"{self.rope_beta_fast!r}; accepted: finite numbers with 0 < slow < fast")
        if not is_int(self.rope_dim) or self.rope_dim < 0 or self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"LlamaConfig.rope_dim={self.rope_dim}; accepted: 0 (whole head) or an even number "
                             f"<= head_dim={self.head_dim}")
        if self.rope_freq_factors is not None:
            factors = tuple(float(f) for f in self.rope_freq_factors)
            object.__setattr__(self, "rope_freq_factors", factors)  # a list from JSON: keep the config hashable
            want = (self.rope_dim or self.head_dim) // 2
            if len(factors) != want or not all(f > 0 for f in factors):
                raise ValueError(f"LlamaConfig.rope_freq_factors has {len(factors)} values; accepted: {want} "
                                 f"positive divisors (one per rotated frequency)")

    def rope_frequencies(self) -> tuple[np.ndarray, float]:
        """The rotary frequencies and the attention scale they imply.

        Frequency i of the rotated width d = rope_dim or head_dim is base^(-2i/d), divided by
        `rope_freq_factors[i]` when given, then rescaled by `rope_scaling`:
        linear divides every frequency by the factor; llama3 divides low frequencies
        (wavelength > original/low_freq_factor) by the factor, keeps high ones (wavelength <
        original/high_freq_factor) and blends in between; yarn blends interpolated
        (freq/factor) and original frequencies with a linear ramp over the dims whose rotation
        count in the original context lies between beta_slow and beta_fast, and scales cos/sin
        by 1 + 0.1 ln(factor).

        Returns:
            (f32[head_dim // 2] angle per position of each pair (0 past rope_dim/2: not rotated),
            the factor multiplying cos and sin)

        Example:
            >>> inv, scale = LlamaConfig.tiny(rope_scaling="linear", rope_factor=8.0).rope_frequencies()
            >>> inv.shape, scale
            ((8,), 1.0)
        """
        d = self.rope_dim or self.head_dim
        inv = self.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        if self.rope_freq_factors is not None:
            inv = inv / np.asarray(self.rope_freq_factors, np.float64)
        scale, f = 1.0, self.rope_factor
        if self.rope_scaling == "linear":
            inv = inv / f
        elif self.rope_scaling == "llama3":
            wavelen = 2 * math.pi / inv
            ctx = self.rope_original_context
            low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
            smooth = (ctx / wavelen - low) / (high - low)
            blended = (1 - smooth) * inv / f + smooth * inv
            inv = np.where(wavelen < ctx / high, inv, np.where(wavelen > ctx / low, inv / f, blended))
        elif self.rope_scaling == "yarn":
            def dim_of(rotations):  # the pair index whose wavelength fits `rotations` times in the context
                ctx = self.rope_original_context
                return d * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(self.rope_base))

            lo = max(math.floor(dim_of(self.rope_beta_fast)), 0)
            hi = min(math.ceil(dim_of(self.rope_beta_slow)), d - 1)
            ramp = np.clip((np.arange(d // 2) - lo) / max(hi - lo, 0.001), 0.0, 1.0)  # 0: keep, 1: interpolate
            inv = inv * (1 - ramp) + inv / f * ramp
            scale = 1.0 + 0.1 * math.log(f) if f > 1 else 1.0
        out = np.zeros(self.head_dim // 2, np.float32)
        out[: d // 2] = inv
        return out, float(scale)

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    def weight_names(self) -> tuple[str, ...]:
        """The layers' weights that quantization replaces and LoRA may target: the linears, with a mixture of
        experts' experts (`moe.expert_gate`, ...) in place of the MLP linears (`Blocks.weight_var` gives
        each one's variable)."""
        return LINEARS[:4] + EXPERT_TARGETS if self.moe_experts else LINEARS

    def shape_line(self) -> str:
        """The model's shape in one line, as `jmem info` prints it."""
        return (f"{self.n_layers}  width: {self.dim}  heads: {self.n_heads}/{self.n_kv_heads} (head dim "
                f"{self.head_dim})  ffn: {self.ffn_dim}  vocab: {self.vocab_size}"
                + (f"  experts: {self.moe_experts} (top {self.moe_top_k})" if self.moe_experts else ""))

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
        """About 3.2M parameters: the default model trained from scratch by `experiments/train.py`."""
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
