"""Analytic training memory: params, grads, optimizer state and activations.

In the spirit of Korthikanti et al. (2022, "Reducing Activation Recomputation
in Large Transformer Models"), which counts, tensor by tensor, what a GPT
block keeps for its backward pass (`34 s b h + 5 a s^2 b` bytes in 16 bit),
this counts what *our* Llama block (`jmem.models.llama.block`: RMSNorm, RoPE,
grouped-query attention, SwiGLU) keeps. Per layer and per token, with `c` the
compute dtype's bytes, H/K query/key-value heads of width D, model width d,
MLP width F, sequence length T:

    ===========================  ===============================================
    RMSNorm (x2)                 input x (c, the residual stream), output (c),
                                 one f32 row scale (its custom backward pass)
    projections                  q (H D), k (K D), v (K D), attention out (H D), c
    plain attention (xla)        scores, exp(scores), probabilities: 3 x H T f32,
                                 plus a c copy of the probabilities when c != f32
    flash attention (pallas)     log-sum-exp: H f32 (no T^2 term)
    SwiGLU                       gate, up, sigmoid(gate), 1 - sigmoid(gate),
                                 silu(gate), silu(gate) * up: 6 F, c
    ===========================  ===============================================

Remat policies keep only their saved names (`jmem.memory.names`) per layer,
plus the layer input; the backward pass then recomputes one layer at a time,
so one layer's full set is added as workspace. Without remat the backward
pass still holds about one layer's worth of cotangents, counted the same way.
Logits: `f32[batch, seq or loss_chunk, vocab]`, twice (logits and their
softmax/gradient). Optimizer state is exact: the optimizer's `init` is traced
with `jax.eval_shape` on the parameter shapes.

LoRA / QLoRA (`lora_rank`, `quantize_base`): the frozen base is counted in
its stored format (the quantized leaf's exact arrays, found by tracing the
quantizer with `jax.eval_shape`: NF4 about 4.13 bits per weight, int8 and fp8
8 bits plus one scale per column, rtn 4 bits plus one scale per column as
`--quantize-base rtn` makes it), the adapters `A[L, in, r]`, `B[L, r, out]` in
their own dtype; gradients and optimizer state exist for the adapters alone.
Each layer's dequantized weights (compute dtype) are added to the workspace,
each adapter keeps its rank-r intermediate per token, and a matmul input that
only frozen weights read (a norm's output, the attention output, the MLP
hidden state) is not saved across layers: the backward pass needs it for a
weight gradient alone.

The numbers are what XLA's buffer assignment reports for a jitted train step
with donated params and optimizer state, within ~15% for the no-remat case
(checked by `tests/memory/test_estimate.py` against `measure`; for QLoRA the
argument bytes: params, optimizer state and batch). Activations count in the
compute dtype: on the CPU backend, which computes bf16 in f32, a bf16 step
measures more than its estimate (`python3 experiments/train.py --remat none
--steps 1`: 392.2 MiB measured, 298.8 estimated; with `--precision f32`
389.0 and 406.8).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from jmem.checks import check_bool, check_int, is_int
from jmem.memory.measure import format_bytes, tree_bytes
from jmem.models.config import EXPERT_TARGETS, LINEARS

_ATTENTION_IMPLS = ("xla", "reference", "pallas", "auto")
BASE_FORMATS = ("nf4", "int8", "fp8", "rtn")
PARAM_PARTS = ("trainable", "frozen")  # an estimate's split of its params (adapters, layer-wise training)


def _dtype(dtype) -> np.dtype:
    """A floating dtype from a name ("f32", "bf16", "f16" or the long names) or a dtype object."""
    import jax.numpy as jnp

    names = {"f32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
             "f16": jnp.float16, "float16": jnp.float16}
    try:
        dt = np.dtype(names[dtype] if isinstance(dtype, str) else dtype)
    except (KeyError, TypeError):
        dt = None
    if dt not in {np.dtype(d) for d in names.values()}:
        raise ValueError(f"dtype {dtype!r}; accepted: {', '.join(names)} or one of those dtypes")
    return dt


def param_shapes(config, param_dtype=None) -> dict:
    """Parameter `ShapeDtypeStruct`s with the model's state paths (stacked `layers` axis).

    Example:
        >>> param_shapes(LlamaConfig.tiny())["layers"]["wq"]["kernel"].shape  # (2, 64, 64)
    """
    dt = _dtype(param_dtype or config.param_dtype)
    L, d, F, V = config.n_layers, config.dim, config.ffn_dim, config.vocab_size
    HD, KD = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    shapes = {
        "embed": {"embedding": s(V, d)},
        "layers": {
            "attn_norm": {"scale": s(L, d)}, "wq": {"kernel": s(L, d, HD)}, "wk": {"kernel": s(L, d, KD)},
            "wv": {"kernel": s(L, d, KD)}, "wo": {"kernel": s(L, HD, d)}, "mlp_norm": {"scale": s(L, d)},
            "w_gate": {"kernel": s(L, d, F)}, "w_up": {"kernel": s(L, d, F)}, "w_down": {"kernel": s(L, F, d)},
        },
        "norm": {"scale": s(d)},
    }
    if config.moe_experts:  # the experts replace the dense MLP (`jmem.models.moe.MoEMLP`)
        E, layers = config.moe_experts, shapes["layers"]
        del layers["w_gate"], layers["w_up"], layers["w_down"]
        layers["moe"] = {"router": {"kernel": s(L, d, E)}, "expert_gate": s(L, E, d, F),
                         "expert_up": s(L, E, d, F), "expert_down": s(L, E, F, d)}
    if not config.tie_embeddings:
        shapes["head"] = {"kernel": s(d, V)}
    return shapes


def _quantized_shapes(sds: jax.ShapeDtypeStruct, fmt: str, group_size: int | None):
    """The quantized leaf of a float kernel, with `ShapeDtypeStruct` children (nothing is computed)."""
    from jmem.quant import FP8Tensor, IntTensor, NF4Tensor

    from jmem.quant.api import resolve_group_size

    if fmt == "rtn":  # the group size `jmem.quant.quantize` would use for this matrix (or its error)
        try:
            group_size = resolve_group_size(sds.shape[-2], group_size, 4)
        except ValueError as e:
            raise ValueError(f"base_group_size: {e}") from None
    make = {"nf4": NF4Tensor.quantize, "fp8": FP8Tensor.quantize,
            "int8": lambda w: IntTensor.quantize(w, 8, None),
            "rtn": lambda w: IntTensor.quantize(w, 4, group_size)}[fmt]
    return jax.eval_shape(make, sds)


def resolve_lora_targets(config, lora_targets) -> tuple[str, ...]:
    """`lora_targets` (one name or several) checked against `config`'s weights, a name given twice taken once;
    the linears' full list (in any order), the default, means every weight of the model (an MoE model's
    experts in place of its MLP linears). A ValueError names unknown or absent names."""
    names = config.weight_names()
    try:
        targets = (lora_targets,) if isinstance(lora_targets, str) else tuple(lora_targets)
    except TypeError:
        targets = None
    if targets is None or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"lora_targets={lora_targets!r}; accepted: one or more of {', '.join(names)}")
    if set(targets) == set(LINEARS):
        return names
    bad = [t for t in targets if t not in names]
    if bad:
        raise ValueError(f"lora_targets {bad}; accepted: {', '.join(names)}")
    return tuple(dict.fromkeys(targets))


def _holder(layers: dict, name: str) -> tuple[dict, str]:
    """(the dict holding weight `name` in a layers' shape tree, its key)."""
    if name in EXPERT_TARGETS:
        return layers["moe"], name.removeprefix("moe.")
    return layers[name], "kernel"


def _lora_shapes(shapes: dict, rank: int, targets, dtype) -> dict:
    """Adapter `A[L, (experts,) in, r]`, `B[L, (experts,) r, out]` shapes of each target weight."""
    out = {}
    for name in targets:
        holder, key = _holder(shapes["layers"], name)
        *lead, n_in, n_out = holder[key].shape
        out[name] = {"lora_a": jax.ShapeDtypeStruct((*lead, n_in, rank), dtype),
                     "lora_b": jax.ShapeDtypeStruct((*lead, rank, n_out), dtype)}
    return out


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Per-token bytes of each named activation and of the attention internals."""

    named: dict[str, int]
    norms_extra: int  # each norm's f32 row scale, not named
    attention_internal: int  # scores/probabilities (T-dependent) or log-sum-exp
    mlp_internal: int  # sigmoid(gate), its complement, silu(gate)
    lora_internal: int = 0  # x @ A of every adapter (rank r each)

    @property
    def full_layer(self) -> int:
        n = self.named
        kept = ("layer_input", "attn_norm", "query", "key", "value", "attention", "mlp_norm", "mlp_gate",
                "mlp_up", "mlp_hidden")
        # The residual entering the MLP norm is saved too; attn_out/mlp_out are
        # only added to the residual stream, which needs no saved value.
        return sum(n[k] for k in kept) + n["layer_input"] + self.norms_extra + self.attention_internal \
            + self.mlp_internal + self.lora_internal


def _expert_rows(config) -> float:
    """Expert rows a token fills: top_k, times the capacity factor unless dropless (a capacity holds at most
    every token once per expert: `jmem.models.moe.capacity`)."""
    k = config.moe_top_k
    return k * 1.0 if config.moe_dropless else min(config.moe_experts, k * config.moe_capacity_factor)


def _sizes(config, seq: int, c: int, attention: str) -> _Sizes:
    d, F = config.dim, config.ffn_dim
    HD, KD, H = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.n_heads
    # MoE: each token fills top_k (times the capacity factor) expert rows; the token's copies on the
    # way in and out of the experts, and the router's f32 logits and probabilities, come on top.
    rows, moe = 1.0, 0
    if config.moe_experts:
        rows = _expert_rows(config)
        moe = int(2 * rows * d * c) + 2 * config.moe_experts * 4
    Fr = int(F * rows)
    named = {"layer_input": d * c, "attn_norm": d * c, "query": HD * c, "key": KD * c, "value": KD * c,
             "attention": HD * c, "attn_out": d * c, "mlp_norm": d * c, "mlp_gate": Fr * c, "mlp_up": Fr * c,
             "mlp_hidden": Fr * c, "mlp_out": d * c}
    norms_extra = 2 * 4
    if attention == "pallas":
        attn = H * 4
    else:
        attn = H * seq * (3 * 4 + (c if c != 4 else 0))
    return _Sizes(named, norms_extra, attn, 3 * Fr * c + moe)


# A matmul input the backward pass keeps only for its weight's gradient, by the weights reading it:
# with LoRA the frozen ones need none, so an input no adapted weight reads is not saved.
_WEIGHT_ONLY_INPUTS = {"attn_norm": ("wq", "wk", "wv"), "attention": ("wo",),
                       "mlp_norm": ("w_gate", "w_up", "moe.expert_gate", "moe.expert_up"),
                       "mlp_hidden": ("w_down", "moe.expert_down")}


def _lora_saved_sizes(sizes: _Sizes, targets) -> _Sizes:
    """`sizes` without the matmul inputs that only frozen weights read (a LoRA step saves none of them)."""
    named = {k: 0 if k in _WEIGHT_ONLY_INPUTS and not set(_WEIGHT_ONLY_INPUTS[k]) & set(targets) else v
             for k, v in sizes.named.items()}
    return dataclasses.replace(sizes, named=named)


def _saved_per_layer(policy: str, sizes: _Sizes, config, seq: int) -> tuple[int, int]:
    """(device bytes, host bytes) per token kept across the whole forward, per layer."""
    from jmem.memory.remat import ATTENTION_DOT_NAMES, MINIMAL_NAMES, parse_spec, validate

    validate(policy)
    n = sizes.named
    if policy in ("none", None):
        return sizes.full_layer, 0

    def kept(names) -> int:
        # The checkpointed function's input is kept anyway (`base`); nothing in the backward pass reads
        # mlp_out (it is only added to the residual stream, the next layer's input): XLA keeps neither twice.
        return sum(n[k] for k in names if k not in ("layer_input", "mlp_out"))

    base = n["layer_input"]
    if policy == "full":
        return base, 0
    if policy == "minimal" or policy == "dots_no_batch":
        return base + kept(MINIMAL_NAMES), 0
    if policy == "save_dot_except_mlp":
        return base + kept(ATTENTION_DOT_NAMES), 0
    if policy == "dots":
        # Every matmul output, including the f32 attention scores (one T^2 copy).
        scores = config.n_heads * seq * 4 if sizes.attention_internal > config.n_heads * 4 else 0
        return base + kept(MINIMAL_NAMES) + n["attention"] + scores, 0
    if policy == "offload":
        return base, kept(MINIMAL_NAMES)
    spec = parse_spec(policy)
    return base + kept(k for k, v in spec.items() if v == "device"), kept(k for k, v in spec.items() if v == "offload")


def estimate(config, batch: int, seq: int, *, remat: str | None = None, param_dtype=None, compute_dtype=None,
             optimizer: str = "adamw", optimizer_kw: dict | None = None, accum: int = 1, attention: str | None = None, loss_chunk: int | None = None,
             master_weights: bool = False, lora_rank: int = 0, lora_targets=LINEARS,
             quantize_base: str | None = None, base_group_size: int | None = None, lora_dtype="f32",
             trained_layers: int | None = None) -> dict:
    """Analytic per-device bytes of one training step (no sharding).

    Args:
        config: a `jmem.models.llama.LlamaConfig`.
        batch, seq: global batch size and sequence length.
        remat: policy name or spec (`jmem.memory.remat`); default `config.remat`.
        param_dtype, compute_dtype: "f32"/"bf16"/"f16" or dtypes; default the config's.
        optimizer: a `jmem.optim.make_optimizer` name (adamw, adafactor, adam8bit, galore, sgd).
        optimizer_kw: its keywords that shape the state (e.g. `{"rank": 64}` for galore).
        accum: microbatches per step (activations for batch/accum rows, plus
            an f32 gradient accumulator).
        attention: "xla"/"reference" (T^2 scores kept) or "pallas" (flash);
            default `config.attention_impl` ("auto" counts as flash when compiling for a GPU or
            TPU, where `jmem.kernels.attention` picks the kernel, else as "xla").
        loss_chunk: sequence positions per cross-entropy chunk; None means
            full `f32[batch, seq, vocab]` logits, not `config.loss_chunk` (pass that to
            estimate the train step, which chunks by it).
        master_weights: an f32 master copy in the optimizer state
            (`jmem.memory.precision.with_master_weights`).
        lora_rank: > 0: LoRA adapters on `lora_targets` (names among `config.weight_names()`: wq,
            wk, wv, wo, w_gate, w_up, w_down, or an MoE model's moe.expert_gate/up/down; the
            default means all of them) are the only trainable parameters.
        quantize_base: the frozen base's format: nf4, int8, fp8 or rtn (4
            bits, `base_group_size` rows per scale; None: per channel); needs
            lora_rank > 0.
        lora_dtype: the adapters' dtype.
        trained_layers: layer-wise training (`jmem.train.layerwise`): this many layers (and every
            group outside the layers) have gradients and optimizer state each step; the other
            layers are frozen. None: every layer.

    Returns:
        dict of bytes: params, grads, optimizer, update (adam8bit's moments
        dequantized during its update), activations (kept across
        layers on device), activations_host (offloaded), workspace (one
        layer's recompute/cotangents), logits, batch, total (device). With
        adapters also trainable (adapter bytes, a part of params) and
        frozen (the base's bytes, the rest).

    Example:
        >>> est = estimate(LlamaConfig.tiny(), 8, 128, remat="full", optimizer="adafactor")
        >>> est["total"]
        >>> estimate(LlamaConfig.tiny(), 8, 64, lora_rank=4, lora_targets=("wq", "wv"), quantize_base="nf4")
    """
    from jmem.models.config import LlamaConfig
    from jmem.optim.factory import make_optimizer

    if not isinstance(config, LlamaConfig):
        raise ValueError(f"estimate: config={config!r:.60}; accepted: a jmem.models.LlamaConfig (e.g. "
                         "LlamaConfig.tiny(), or jmem.load(...).model.config)")
    remat = config.remat if remat is None else remat
    attention = attention or config.attention_impl
    if attention not in _ATTENTION_IMPLS:
        raise ValueError(f"attention={attention!r}; accepted: {', '.join(_ATTENTION_IMPLS)}")
    _check_ints(("batch", batch, 1, ""), ("seq", seq, 1, ""),
                ("loss_chunk", loss_chunk, 1, ", or None (whole sequence)"),
                ("trained_layers", trained_layers, 1, ", or None (every layer)"))
    lora_targets = _check_param_args(config, accum, lora_rank, lora_targets, quantize_base, base_group_size)
    if batch % accum:
        raise ValueError(f"accum={accum!r} does not divide batch={batch}; accepted: a divisor of batch")
    if optimizer_kw is not None and not isinstance(optimizer_kw, Mapping):
        raise ValueError(f"optimizer_kw={optimizer_kw!r}; accepted: a dict of the optimizer's keywords, or None")
    check_bool("master_weights", master_weights)
    tx = make_optimizer(optimizer, 1e-3, **(optimizer_kw or {}))
    optimizer = optimizer.strip().lower()  # as make_optimizer reads it
    c = _dtype(compute_dtype or config.compute_dtype).itemsize

    shapes, base, adapters = _param_trees(config, param_dtype, lora_rank, lora_targets, quantize_base,
                                          base_group_size, lora_dtype)
    frozen = None
    if lora_rank:
        trainable = adapters
        frozen = tree_bytes(base)
    else:
        trainable = shapes
    if trained_layers is not None:
        if not 1 <= trained_layers <= config.n_layers:
            raise ValueError(f"trained_layers={trained_layers!r}; accepted: 1..{config.n_layers} (the model's layers)")
        part = lambda x, n: jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype)  # noqa: E731 - n of the stacked layers
        stacked = trainable["layers"] if not lora_rank else trainable  # every adapter is stacked over the layers
        active = jax.tree.map(lambda x: part(x, trained_layers), stacked)
        still = jax.tree.map(lambda x: part(x, config.n_layers - trained_layers), stacked)
        frozen = (frozen or 0) + tree_bytes(still)
        trainable = active if lora_rank else {**trainable, "layers": active}
    train_bytes = tree_bytes(trainable)
    params = train_bytes + (frozen or 0)
    n_train = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))
    opt_shapes = trainable
    if master_weights:
        opt_shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), trainable)
    optimizer_bytes = tree_bytes(jax.eval_shape(tx.init, opt_shapes)) + (4 * n_train if master_weights else 0)
    grads = train_bytes + (4 * n_train if accum > 1 else 0)

    micro = batch // accum
    tokens = micro * seq
    from jmem.kernels.dispatch import resolve_impl

    sizes = _sizes(config, seq, c, resolve_impl(attention, _dtype(compute_dtype or config.compute_dtype)))
    if lora_rank:
        # x @ A per adapter and token; an expert adapter's for each expert row a token fills (`_sizes`)
        rows = sum(_expert_rows(config) if t in EXPERT_TARGETS else 1 for t in lora_targets)
        sizes = dataclasses.replace(sizes, lora_internal=int(rows * int(lora_rank) * c))
    # The workspace (one layer's cotangents, or its recomputation) counts every value; what is
    # saved across layers leaves out the inputs only frozen weights read.
    saved = _lora_saved_sizes(sizes, lora_targets) if lora_rank else sizes
    dev, host = _saved_per_layer(remat, saved, config, seq)
    activations = config.n_layers * dev * tokens
    workspace = sizes.full_layer * tokens
    if quantize_base is not None:
        # One layer's kernels dequantized to the compute dtype inside the scan.
        workspace += sum(int(np.prod(h[k].shape[1:])) for h, k in (_holder(shapes["layers"], n)
                                                                    for n in config.weight_names())) * c
    # Embedding output and final norm (input, f32 normalised, output) outside the scan.
    activations += tokens * config.dim * (3 * c + 4)
    logits = 2 * micro * min(seq, loss_chunk or seq) * config.vocab_size * 4
    batch_bytes = 3 * batch * seq * 4  # token ids, targets and the f32 loss mask
    # adam8bit's update holds its moments dequantized to f32 (two per parameter) beside the gradients;
    # the other optimizers' elementwise updates fuse into the parameters' own buffers.
    update = 2 * 4 * n_train if optimizer == "adam8bit" else 0
    total = params + grads + optimizer_bytes + activations + workspace + logits + batch_bytes + update
    out = {
        "params": params, "grads": grads, "optimizer": optimizer_bytes, "update": update, "activations": activations,
        "activations_host": config.n_layers * host * tokens, "workspace": workspace, "logits": logits,
        "batch": batch_bytes, "total": total,
    }
    if frozen is not None:
        out = {**dict(zip(PARAM_PARTS, (train_bytes, frozen))), **out}
    return out


def _check_ints(*checks) -> None:
    """ValueError unless each (name, value, least, or_none) holds an integer >= least (None where `or_none`)."""
    for name, value, least, or_none in checks:
        if not (value is None and or_none) and (not is_int(value) or value < least):
            raise ValueError(f"{name}={value!r}; accepted: an integer >= {least}{or_none}")


def _check_param_args(config, accum, lora_rank, lora_targets, quantize_base, base_group_size) -> tuple[str, ...]:
    """ValueError naming a bad accum, LoRA or base-format argument (as `estimate` takes them); the LoRA targets."""
    check_int("accum", accum, 1)
    check_int("lora_rank", lora_rank, 0)
    lora_targets = resolve_lora_targets(config, lora_targets)
    if lora_rank and not lora_targets:
        raise ValueError(f"lora_rank={lora_rank} with no lora_targets; accepted: one or more of "
                         f"{', '.join(config.weight_names())}")
    if quantize_base is not None:
        if quantize_base not in BASE_FORMATS:
            raise ValueError(f"quantize_base={quantize_base!r}; accepted: {', '.join(BASE_FORMATS)}")
        if not lora_rank:
            raise ValueError("quantize_base needs lora_rank > 0 (a quantized base is frozen)")
    if base_group_size is not None and quantize_base != "rtn":
        raise ValueError(f"base_group_size={base_group_size!r} with quantize_base={quantize_base!r}, which has no "
                         "group size; accepted: None, or quantize_base='rtn'")
    return lora_targets


def _param_trees(config, param_dtype, lora_rank, lora_targets, quantize_base, base_group_size, lora_dtype):
    """(float parameter shapes, the base as stored (quantized layer kernels with `quantize_base`), the
    LoRA adapters' shapes or None)."""
    shapes = param_shapes(config, param_dtype)
    if not lora_rank:
        return shapes, shapes, None
    base = shapes
    if quantize_base is not None:
        layers = {k: dict(v) for k, v in shapes["layers"].items()}
        for name in config.weight_names():
            holder, key = _holder(layers, name)
            holder[key] = _quantized_shapes(holder[key], quantize_base, base_group_size)
        base = {**shapes, "layers": layers}
    return shapes, base, _lora_shapes(shapes, int(lora_rank), lora_targets, _dtype(lora_dtype))


def layer_param_bytes(config, param_dtype=None, *, lora_rank: int = 0, lora_targets=LINEARS,
                      quantize_base: str | None = None, base_group_size: int | None = None, lora_dtype="f32") -> int:
    """Bytes of the stacked layers' parameters as a training run holds them (what `--offload-params host`
    moves off the device): the base's layer weights, quantized with `quantize_base`, and the LoRA
    adapters (every one sits in a layer). Arguments (and their ValueErrors) as `estimate`'s."""
    targets = _check_param_args(config, 1, lora_rank, lora_targets, quantize_base, base_group_size)
    _, base, adapters = _param_trees(config, param_dtype, lora_rank, targets, quantize_base, base_group_size,
                                     lora_dtype)
    return tree_bytes(base["layers"]) + (tree_bytes(adapters) if adapters is not None else 0)


def layer_grad_bytes(config, param_dtype=None, *, accum: int = 1, lora_rank: int = 0, lora_targets=LINEARS,
                     quantize_base: str | None = None, base_group_size: int | None = None, lora_dtype="f32") -> int:
    """Bytes of the stacked layers' gradients, with their f32 accumulator when `accum` > 1, as `estimate`
    counts them (what `--offload-params host` keeps in host memory): the base's layer weights', or the
    LoRA adapters' when `lora_rank` > 0. Arguments (and their ValueErrors) as `estimate`'s."""
    targets = _check_param_args(config, accum, lora_rank, lora_targets, quantize_base, base_group_size)
    shapes, _, adapters = _param_trees(config, param_dtype, lora_rank, targets, quantize_base, base_group_size,
                                       lora_dtype)
    layers = adapters if lora_rank else shapes["layers"]
    return tree_bytes(layers) + (4 * sum(x.size for x in jax.tree.leaves(layers)) if accum > 1 else 0)


def format_estimate(est: dict, title: str = "estimate") -> str:
    """A two-column table of an `estimate` result."""
    lines = [title]
    lines += [f"  {k:18s}{format_bytes(v):>14s}" for k, v in est.items()]
    return "\n".join(lines)
