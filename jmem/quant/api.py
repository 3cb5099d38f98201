"""`quantize(model, method, ...)`: replace a Llama model's linear kernels by quantized leaves.

Calibrated methods (gptq, awq) run block by block on the model's own
activations: the calibration tokens are embedded once, then for each layer the
inputs of its linears are captured with the already-quantized earlier layers,
the layer is quantized, and its quantized output becomes the next layer's
input. Embeddings, norms and the output head stay in float.

In a mixture-of-experts block each expert is calibrated on the tokens the
router sends to it (routed dropless, as at inference): GPTQ takes each
expert's Hessian from its own rows; AWQ searches one gate/up scale over the
block's input for all experts (folded into the norm and the router, which stays
float) and each expert's down scale and clips on its own rows. An expert that
no calibration token reaches is rounded to nearest, with one logged line (under
AWQ its gate/up take the shared scale, its down none, and nothing is clipped).

Group-size substitution: a matrix of fewer input rows than the requested
group size is one group (per channel); a requested group size that does not
divide a matrix's input dimension is replaced, for that matrix only, by the
largest multiple of 32 below it that does (SmolLM2's width 576 takes 96 when 128 is
asked; its MLP width 1536 keeps 128), with one logged line per input
dimension; `group_sizes(qmodel)` reports what each matrix got. The
single-matrix functions (`IntTensor.quantize`, `gptq_quantize`, ...) stay
strict.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem.calibrate import (LINEARS, calibrate_layers, calibration_tokens, check_calibration_ids, expert_rows,
                            layer_weight, run_layer, stack_records, stages, with_weights)
from jmem.checks import check_bool, check_llama, is_int
from jmem.models.config import EXPERT_TARGETS
from jmem.models.llama import Blocks
from jmem.quant.awq import awq_clip, awq_scale
from jmem.quant.fp8 import FP8Tensor
from jmem.quant.gptq import gptq_quantize, hessian
from jmem.quant.nf4 import NF4_BLOCK, NF4Tensor
from jmem.quant.qtensor import PACK_ROWS, IntTensor, check_finite, check_group_size, check_int_bits, group_choices

METHOD_BITS = {"rtn": (2, 3, 4, 8), "int8": (8,), "nf4": (4,), "fp8": (8,), "gptq": (2, 3, 4, 8), "awq": (2, 3, 4, 8)}
CALIBRATED = ("gptq", "awq")
# Per-method bit widths when the caller leaves `bits` at its default.
DEFAULT_BITS = {"int8": 8, "nf4": 4, "fp8": 8}
# AWQ clip search skips q/k: their error is amplified through the attention scores.
AWQ_NO_CLIP = ("wq", "wk")
# Substituted group sizes are multiples of this (the Pallas kernel's unit).
SUBSTITUTE_MULTIPLE = 32

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """A validated request: method, bits, group size (None = per channel), symmetry, act-order.

    `group_sizes` holds the effective group size of each linear (after
    substitution); `substitutions` one line per substituted input dimension.
    """

    method: str
    bits: int
    group_size: int | None
    symmetric: bool
    act_order: bool
    group_sizes: tuple[tuple[str, int | None], ...] = ()
    substitutions: tuple[str, ...] = ()

    def group(self, name: str) -> int | None:
        """The group size to use for linear `name`."""
        return dict(self.group_sizes).get(name, self.group_size)


def resolve_group_size(n_in: int, group_size: int | None, bits: int = 4) -> int:
    """The group size a model-level `quantize` uses for a matrix with `n_in` input rows.

    `group_size` itself when it divides `n_in`; `n_in` (one group: per channel) when the matrix
    has fewer rows than one group, as GPTQ's `g_idx = row // group_size` groups them; otherwise
    the largest multiple of 32 below it that divides `n_in` (llama.cpp likewise swaps the block
    type of rows its super-block does not divide). None means per channel (`n_in`).

    Raises:
      ValueError: bad bits, a group size that is not a positive integer (a multiple of 8 below
        8 bits), or no multiple of 32 below it divides `n_in`.

    Example:
        >>> resolve_group_size(576, 128)   # 96
        >>> resolve_group_size(1536, 128)  # 128
    """
    check_int_bits(bits)
    try:
        return check_group_size(n_in, group_size, bits)
    except ValueError:
        # Bits 8 store a byte per weight: any group size (and input dimension) packs.
        if not is_int(group_size) or group_size <= 0 or (bits != 8 and (group_size % PACK_ROWS or n_in % PACK_ROWS)):
            raise
    if n_in < group_size:  # 48 rows at 128 were refused, while 64 took one group of 64
        return n_in
    for g in range((group_size - 1) // SUBSTITUTE_MULTIPLE * SUBSTITUTE_MULTIPLE, 0, -SUBSTITUTE_MULTIPLE):
        if n_in % g == 0:
            return g
    raise ValueError(f"group_size={group_size} does not divide the input dimension {n_in}, nor does any multiple "
                     f"of {SUBSTITUTE_MULTIPLE} below it; accepted: {group_choices(n_in, bits, group_size)}")


def quant_targets(model) -> dict:
    """The weight variables `quantize` replaces, by name: each linear's kernel (`wq` ... `w_down`), and on
    a mixture-of-experts model its experts (`EXPERT_TARGETS`) in place of the MLP linears. The router stays
    float (llama.cpp keeps `ffn_gate_inp` in F32 too): it is small, and its logits decide which experts
    every token gets."""
    return {n: model.layers.weight_var(n) for n in model.config.weight_names()}


def _group_plan(weights: dict, group_size, bits: int):
    """(effective group size by weight, one line per substituted input dimension)."""
    groups, by_dim = {}, {}
    for name in weights:
        n_in = weights[name].shape[-2]
        try:
            groups[name] = resolve_group_size(n_in, group_size, bits)
        except ValueError as e:
            raise ValueError(f"{name} (input dimension {n_in}): {e}") from None
        if group_size is not None and group_size != -1 and groups[name] != group_size:
            by_dim.setdefault((n_in, groups[name]), []).append(name)
    lines = tuple(f"group_size={group_size} does not divide input dimension {n_in} ({', '.join(names)}): "
                  f"using group size {g}" for (n_in, g), names in by_dim.items())
    return tuple(groups.items()), lines


def describe_quantized(leaf) -> str | None:
    """A short name of a quantized weight leaf's format ("int4, group size 32", "nf4", "Q4_K"); None for a
    plain float array."""
    if isinstance(leaf, IntTensor):
        return f"int{leaf.bits}, group size {leaf.group_size}"
    if isinstance(leaf, NF4Tensor):
        return "nf4"
    if isinstance(leaf, FP8Tensor):
        return "fp8"
    if hasattr(leaf, "qtype"):  # GGMLWeight
        return leaf.qtype.name
    if hasattr(leaf, "__jmem_dot__"):
        base = describe_quantized(getattr(leaf, "base", None))
        return f"{type(leaf).__name__} over {base}" if base else type(leaf).__name__
    return None


def first_quantized(model) -> tuple[str, str] | None:
    """(name, format) of the first quantized weight among `quant_targets` (`describe_quantized`), None for a
    float model."""
    for name, var in quant_targets(model).items():
        kind = describe_quantized(var.get_value())
        if kind is not None:
            return name, kind
    return None


def check_float_model(model) -> dict:
    """The weights `quantize` replaces (`quant_targets`), by name; a ValueError when one is already
    quantized or holds a non-finite value.

    Quantizing quantized leaves would round their packed codes again, so the
    float model is the only accepted input. A NaN or inf would destroy its
    group's scale (GPTQ would spread it over the column), so it is refused
    naming the weight and its layers.
    """
    weights = {n: v.get_value() for n, v in quant_targets(model).items()}
    for name, w in weights.items():
        if hasattr(w, "lora_a"):
            raise ValueError(f"{name} carries a LoRA adapter; accepted: a model without adapters (quantize "
                             "before apply_lora, or merge or remove_adapters first)")
    found = first_quantized(model)
    if found is not None:
        raise ValueError(f"the model is already quantized ({found[0]}: {found[1]}); accepted: the float model "
                         "(quantize the model as loaded, before any quantization)")
    for name, w in weights.items():
        check_finite(w, f"layers.{name}", lead="layer")
    return weights


# Arguments that only some methods read: (methods, why the others do not, the default and the values
# that also mean "not set"); `jmem quantize`'s METHOD_FLAGS is the same table for its flags.
METHOD_ARGS = {
    "group_size": (("rtn", "gptq", "awq"), "its block or channel layout is fixed", (128, None, -1)),
    "symmetric": (("rtn", "int8", "gptq", "awq"), "its format fixes its scaling", (None, True)),
    "act_order": (("gptq",), "only gptq orders columns", (False,)),
    "calibration": (CALIBRATED, "it does not calibrate", (None,)),
    "tokenizer": (CALIBRATED, "it does not calibrate", (None,)),
    "seq_len": (CALIBRATED, "it does not calibrate", (512,)),
    "max_seqs": (CALIBRATED, "it does not calibrate", (32,)),
}


def method_kwargs(method: str, **kwargs) -> dict:
    """The `quantize` keyword arguments among `kwargs` that `method` reads (a caller holding every
    option, such as a command line, passes the rest only where they apply)."""
    return {k: v for k, v in kwargs.items() if k not in METHOD_ARGS or method in METHOD_ARGS[k][0]}


def _check_applies(method: str, **values) -> None:
    """Refuse an argument, set away from its default, that `method` does not read."""
    for name, value in values.items():
        methods, why, unset = METHOD_ARGS[name]
        if method not in methods and not any(_is(value, u) for u in unset):
            shown = f"{name}={value!r}" if isinstance(value, (bool, int, float, np.generic)) else f"{name}="
            raise ValueError(f"{shown} does not apply to method {method!r} ({why}); accepted: {name} only with "
                             f"method {' / '.join(methods)}, else {unset[0]!r}")


def _is(value, default) -> bool:
    """`value` is `default` (None, a bool or an int), NumPy scalars included."""
    if default is None:
        return value is None
    if isinstance(default, bool):
        return isinstance(value, (bool, np.bool_)) and bool(value) == default
    return is_int(value) and value == default


def _check(model, method: str, bits, group_size, symmetric, act_order) -> QuantSpec:
    check_llama("model", model)
    if method not in METHOD_BITS:
        raise ValueError(f"unknown quantization method {method!r}; accepted: {', '.join(METHOD_BITS)}")
    if symmetric is not None and not isinstance(symmetric, (bool, np.bool_)):
        raise ValueError(f"symmetric={symmetric!r}; accepted: True (scale only), False (scale and zero point) or "
                         "None (True)")
    check_bool("act_order", act_order)
    if bits is None:
        bits = DEFAULT_BITS.get(method, 4)
    if not is_int(bits) or bits not in METHOD_BITS[method]:
        raise ValueError(f"bits={bits!r} is not supported by method {method!r}; accepted: an int in "
                         f"{METHOD_BITS[method]}")
    if method in ("int8", "fp8"):
        group_size = None
    weights = check_float_model(model)
    groups, lines = (), ()
    if method == "nf4":
        for name in weights:
            n_in = weights[name].shape[-2]
            if n_in % NF4_BLOCK:
                raise ValueError(f"NF4 needs input dimensions divisible by {NF4_BLOCK}; {name} has {n_in}")
    elif method != "fp8":
        groups, lines = _group_plan(weights, group_size, bits)
    if symmetric is None:
        symmetric = True
    return QuantSpec(method, int(bits), group_size, bool(symmetric), bool(act_order), groups, lines)


def _quantize_plain(w, spec: QuantSpec, name: str):
    if spec.method == "nf4":
        return NF4Tensor.quantize(w)
    if spec.method == "fp8":
        return FP8Tensor.quantize(w)
    return IntTensor.quantize(w, spec.bits, spec.group(name), spec.symmetric)


def _gptq_layer(cfg, w: dict, x, positions, spec: QuantSpec, note) -> dict:
    for stage in stages(cfg):
        _, inputs = run_layer(cfg, w, x, positions)
        if stage[0] in EXPERT_TARGETS:  # each expert's Hessian from the rows routed to it
            hs = [hessian(r) if len(r) else None for r in expert_rows(inputs[stage[0]], cfg.moe_experts)]
            new = {n: _gptq_experts(layer_weight(w, n), hs, spec, n, note) for n in stage}
        else:
            h = hessian(inputs[stage[0]])  # the linears of a stage share their input
            new = {n: gptq_quantize(np.asarray(w[n]), h, spec.bits, spec.group(n), spec.symmetric, spec.act_order)
                   for n in stage}
        w = with_weights(w, new)
    return w


def _gptq_experts(w_XIO, hessians: list, spec: QuantSpec, name: str, note) -> IntTensor:
    """GPTQ of each expert's matrix on its own Hessian (None: no calibration row was routed to it, so it
    is rounded to nearest, with a note); one stacked leaf [experts, in, out]."""
    out = []
    for e, h in enumerate(hessians):
        w_e = np.asarray(w_XIO[e])
        if h is None:
            note(f"{name} expert {e}: no calibration token was routed to it; rounded to nearest")
            out.append(IntTensor.quantize(w_e, spec.bits, spec.group(name), spec.symmetric))
        else:
            out.append(gptq_quantize(w_e, h, spec.bits, spec.group(name), spec.symmetric, spec.act_order))
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *out)


def fold_awq_scales(cfg, w: dict, s_qkv, s_o, s_gate_up, s_down) -> dict:
    """Fold AWQ's per-input-channel scales into one layer's float weights; the layer's function is unchanged.

    Each linear's rows are multiplied by its scale and `1/s` goes into the op
    that produces its input: attn_norm (q/k/v), v's output columns (o:
    attention is linear in v), mlp_norm (gate/up), up's output columns (down:
    silu(gate) * up is linear in up). Under grouped-query attention one v
    column serves n_heads / n_kv_heads query heads, so `s_o` (f32[n_heads *
    head_dim]) must be equal across the query heads of a kv head. In a
    mixture-of-experts block `s_gate_up` scales every expert's gate and up rows
    and the router's rows (the router reads the same normed input and stays
    float), and `s_down` holds one scale per expert (f32[experts, ffn]).
    """
    w = dict(w)
    rep, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    s_v = s_o.reshape(cfg.n_kv_heads, rep, hd)[:, 0, :].reshape(-1)
    w["attn_norm"] = w["attn_norm"] / s_qkv
    for n in ("wq", "wk", "wv"):
        w[n] = w[n] * s_qkv[:, None]
    w["wv"], w["wo"] = w["wv"] / s_v[None, :], w["wo"] * s_o[:, None]
    w["mlp_norm"] = w["mlp_norm"] / s_gate_up
    if "moe" in w:
        m = w["moe"]
        return with_weights(w, {"moe.router": m["router"] * s_gate_up[:, None],
                                "moe.expert_gate": m["gate"] * s_gate_up[None, :, None],
                                "moe.expert_up": m["up"] * s_gate_up[None, :, None] / s_down[:, None, :],
                                "moe.expert_down": m["down"] * s_down[:, :, None]})
    for n in ("w_gate", "w_up"):
        w[n] = w[n] * s_gate_up[:, None]
    w["w_up"], w["w_down"] = w["w_up"] / s_down[None, :], w["w_down"] * s_down[:, None]
    return w


def _awq_layer(cfg, w: dict, x, positions, spec: QuantSpec, note) -> dict:
    w = jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float32), w)
    _, inputs = run_layer(cfg, w, x, positions)
    moe = "moe" in w
    xs = {n: inputs[n].reshape(-1, inputs[n].shape[-1]).astype(jnp.float32) for n in inputs if n in LINEARS}
    def args(name):  # the linears searched together share their input, so their group size
        return spec.bits, spec.group(name), spec.symmetric

    # Every search reads the float layer's own weights: the folds touch
    # disjoint rows and columns, so their order does not matter.
    s_qkv = awq_scale(xs["wq"], [w["wq"], w["wk"], w["wv"]], *args("wq"))
    # o's activation magnitude is averaged over the query heads sharing a kv head (see fold_awq_scales).
    rep, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    mean_o = jnp.abs(xs["wo"]).mean(axis=0).reshape(cfg.n_kv_heads, rep, hd).mean(axis=1)
    s_o = awq_scale(xs["wo"], [w["wo"]], *args("wo"),
                    x_mean=jnp.repeat(mean_o[:, None, :], rep, axis=1).reshape(-1))
    if moe:  # every expert's gate and up read the router's input; each expert's down its own rows
        m, rows = w["moe"], {n: expert_rows(inputs[n], cfg.moe_experts) for n in EXPERT_TARGETS}
        s_gu = awq_scale(inputs["moe.router"], [*m["gate"], *m["up"]], *args("moe.expert_gate"))
        s_down = jnp.stack([awq_scale(r, [d], *args("moe.expert_down")) if len(r) else jnp.ones(d.shape[0])
                            for r, d in zip(rows["moe.expert_down"], m["down"])])
    else:
        s_gu = awq_scale(xs["w_gate"], [w["w_gate"], w["w_up"]], *args("w_gate"))
        s_down = awq_scale(xs["w_down"], [w["w_down"]], *args("w_down"))
    w = fold_awq_scales(cfg, w, s_qkv, s_o, s_gu, s_down)
    # The clip search and the rounding see the folded weights and their inputs divided by the scales.
    for names, s in ((("wq", "wk", "wv"), s_qkv), (("wo",), s_o), (("w_gate", "w_up"), s_gu), (("w_down",), s_down)):
        for n in names:
            if n in xs:
                xs[n] = xs[n] / s
    new = {n: IntTensor.quantize(w[n], *args(n), clip=None if n in AWQ_NO_CLIP else awq_clip(xs[n], w[n], *args(n)))
           for n in xs}
    if moe:
        for n in EXPERT_TARGETS:
            s = s_down if n == "moe.expert_down" else jnp.broadcast_to(s_gu, (cfg.moe_experts, cfg.dim))
            new[n] = _awq_experts(layer_weight(w, n), [r / s_e for r, s_e in zip(rows[n], s)], args(n), n, note)
    return with_weights(w, new)


def _awq_experts(w_XIO, rows: list, args: tuple, name: str, note) -> IntTensor:
    """Round each expert's folded matrix with the clip searched on its own routed rows (an expert no
    calibration row was routed to is not clipped, with a note); one stacked leaf [experts, in, out]."""
    bits, group_size, _ = args
    no_clip = jnp.ones((w_XIO.shape[1] // group_size, w_XIO.shape[2]), jnp.float32)
    clips = []
    for e, r in enumerate(rows):
        if not len(r):
            note(f"{name} expert {e}: no calibration token was routed to it; not clipped")
        clips.append(awq_clip(r, w_XIO[e], *args) if len(r) else no_clip)
    return IntTensor.quantize(w_XIO, *args, clip=jnp.stack(clips))



def quantize(model, method: str, bits: int | None = None, group_size: int | None = 128, calibration=None, *,
             tokenizer=None, symmetric: bool | None = None, act_order: bool = False, seq_len: int = 512,
             max_seqs: int = 32, inplace: bool = False, log=None):
    """Quantize the linear layers of a jmem Llama model.

    An argument that the method does not read, set away from its default, is
    refused (as `jmem quantize` refuses the flag), never silently dropped.

    Args:
      model: a `jmem.models.Llama` (layers stacked on a leading axis).
      method: rtn, int8 (per channel), nf4 (double quantization), fp8 (e4m3,
        per channel), gptq or awq.
      bits: rtn/gptq/awq: 2, 3, 4 or 8 (default 4); nf4: 4; int8, fp8: 8.
      group_size: input rows per scale for rtn/gptq/awq; None or -1 for per
        channel (-1 is how GPTQ checkpoints write per channel).
        A matrix of fewer input rows is one group; one whose input dimension
        it does not divide gets the largest multiple of 32 below it that does (one logged line per input
        dimension; `group_sizes(result)` lists what each matrix got); an
        error only when there is none.
      calibration: gptq/awq only (refused for the other methods): text(s)
        (with `tokenizer`) or token ids (int [B, T] or a list of 1-D arrays).
      tokenizer: anything with `.encode(text)` returning ids or an object with `.ids`.
      symmetric: scale only (default) or scale + zero point per group
        (rtn, int8, gptq, awq).
      act_order: GPTQ: quantize columns by decreasing Hessian diagonal.
      seq_len, max_seqs: calibration windows (tokens per window, windows used).
      inplace: modify `model` instead of a copy.
      log: optional callable taking one progress line per calibrated layer,
        per group-size substitution and per expert no calibration token
        reaches (e.g. `print`); default: this module's logger (substitutions
        and unreached experts as warnings).

    Returns:
      The quantized model: every `layers.<linear>.kernel` holds a stacked
      quantized leaf; AWQ also rewrites the norm scales it folded into. On a
      mixture-of-experts model the attention linears and the experts
      `layers.moe.expert_*` ([layers, experts, in, out], decoded one layer at a
      time inside the layer scan) are quantized; the router stays float (AWQ
      rescales its rows).

    Example:
        >>> qmodel = quantize(model, "gptq", bits=4, group_size=64, calibration=ids_BT)
        >>> logits, _ = qmodel(ids_BT)
    """
    spec = _check(model, method, bits, group_size, symmetric, act_order)
    _check_applies(method, group_size=group_size, symmetric=symmetric, act_order=act_order, calibration=calibration,
                   tokenizer=tokenizer, seq_len=seq_len, max_seqs=max_seqs)
    ids = None
    if method in CALIBRATED:
        if calibration is None:
            raise ValueError(f"method {method!r} needs calibration= (texts with tokenizer=, or token ids [B, T])")
        ids = calibration_tokens(calibration, tokenizer, seq_len, max_seqs)
        windowed = getattr(calibration, "ndim", None) == 2  # [B, T] ids: the caller chose the windows
        if len(ids) < max_seqs and not windowed:  # e.g. --calibration-windows 1000 on a short text
            (log or logger.warning)(f"{method}: the calibration holds {len(ids)} window(s) of {ids.shape[1]} tokens, "
                                    f"fewer than max_seqs={max_seqs}: calibrating on {len(ids)}")
        check_calibration_ids(ids, model.config.vocab_size)
        if ids.shape[1] > model.config.max_seq_len:
            raise ValueError(f"calibration windows of {ids.shape[1]} tokens exceed the model's context of "
                             f"{model.config.max_seq_len}; accepted: seq_len (or the T of [B, T] ids) <= "
                             f"{model.config.max_seq_len}")
    for line in spec.substitutions:  # once the call is known to go ahead
        (log or logger.warning)(f"{method}: {line}")
    if not inplace:
        model = nnx.clone(model)
    layers: Blocks = model.layers
    targets = quant_targets(model)
    if method not in CALIBRATED:
        new = {n: _quantize_plain(var.get_value(), spec, n) for n, var in targets.items()}
    else:
        new = _calibrated(model, layers.weights(), jnp.asarray(ids), spec, log)
    for n, v in new.items():  # AWQ also rewrites the norms (and a mixture of experts' router) it folded into
        var = targets.get(n) or (layers.moe.router.kernel if n == "moe.router" else getattr(layers, n).scale)
        var.set_value(v)
    return model


def _calibrated(model, weights: dict, ids_BT, spec: QuantSpec, log=None) -> dict:
    layer_fn = _gptq_layer if spec.method == "gptq" else _awq_layer
    quantized = model.config.weight_names()
    folded = ("attn_norm", "mlp_norm") + (("moe.router",) if model.config.moe_experts else ())
    names = quantized + (folded if spec.method == "awq" else ())
    dtype = {n: layer_weight(weights, n).dtype for n in names}
    layers = iter(range(1, model.config.n_layers + 1))  # calibrate_layers rewrites the layers in order

    def rewrite(cfg, w, x, positions):  # the layer runs in f32; its leaves keep the model's dtypes
        layer = next(layers)

        def note(line):
            (log or logger.warning)(f"{spec.method}: layer {layer}: {line}")
        wq = layer_fn(cfg, w, x, positions, spec, note)
        return wq, {n: (layer_weight(wq, n).with_dtype(dtype[n]) if n in quantized
                        else layer_weight(wq, n).astype(dtype[n])) for n in names}

    return stack_records(calibrate_layers(model, ids_BT, rewrite, log=log, label=spec.method))


def _weights(model, names) -> dict:
    """The quantizable weights of `model` (`quant_targets`) among `names` (one string is one name; None:
    all of them); a ValueError naming unknown ones, or a `model` that is not a Llama."""
    check_llama("model", model)
    weights = {n: v.get_value() for n, v in quant_targets(model).items()}
    if names is None:
        return weights
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in weights]
    if unknown:
        raise ValueError(f"unknown weight name(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(weights)} "
                         "(one name or a sequence of them)")
    return {n: weights[n] for n in names}


def weight_bytes(model, names=None) -> int:
    """Stored bytes of the layers' quantizable weights (`quant_targets`; quantized leaves count their
    packed bytes).

    `names`: one weight name ("wq") or a sequence of them (default: all).
    """
    return int(sum(w.nbytes for w in _weights(model, names).values()))


def group_sizes(model, names=None) -> dict[str, int | None]:
    """The group size each quantizable weight of a quantized model holds (per channel shows as the input
    dimension).

    NF4 reports its 64-row block; float and FP8 (per-channel scales, no
    groups) kernels report None. A LoRA-wrapped kernel reports its base.
    `names`: one weight name ("wq") or a sequence of them (default: all).

    Example:
        >>> group_sizes(quantize(smollm2, "rtn", bits=4, group_size=128))
        {'wq': 96, 'wk': 96, 'wv': 96, 'wo': 96, 'w_gate': 96, 'w_up': 96, 'w_down': 128}
    """
    out: dict[str, int | None] = {}
    for n, w in _weights(model, names).items():
        w = getattr(w, "base", w)
        out[n] = w.group_size if isinstance(w, IntTensor) else NF4_BLOCK if isinstance(w, NF4Tensor) else None
    return out
