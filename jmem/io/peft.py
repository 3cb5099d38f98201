"""Read LoRA adapters saved by Hugging Face PEFT (`save_pretrained`: a directory holding
`adapter_config.json` and `adapter_model.safetensors`) into jmem's adapter layout.

PEFT stores one `lora_A.weight [r, in]` / `lora_B.weight [out, r]` pair per adapted
`nn.Linear` of each layer (`base_model.model.model.layers.N.self_attn.q_proj...`).
jmem stacks layers, so a target becomes `lora_a [L, in, r]` / `lora_b [L, r, out]`
(the transposes). jmem's weights are in Hugging Face's layout (the GGUF loader
undoes llama.cpp's rotary permutation), so no rows are permuted.

One alpha and rank per target is what jmem's `LoRA` holds. When PEFT's
`rank_pattern` / `alpha_pattern` or a partial layer set (`layers_to_transform`,
a regex `target_modules`) gives the layers of one target different scales or
ranks, each layer's scale is folded into its B, ranks are zero-padded to the
largest, and untouched layers get zero adapters: the same function exactly,
with alpha = rank (scale 1).

Refused with one ValueError each: another PEFT method than LoRA, DoRA, any saved
tensor that is not a LoRA A/B of a known linear (`modules_to_save`, biases,
embedding adapters), a PyTorch-pickle `adapter_model.bin` only, and arrays
whose shapes do not pair up.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# Hugging Face Llama module -> jmem target.
MODULES = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
           "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up", "mlp.down_proj": "w_down"}
_LAYER_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")
_HEAD_KEY = re.compile(r"base_model\.model\.lm_head\.lora_([AB])\.weight")


def is_peft_dir(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def read_peft(path, n_layers: int | None = None) -> tuple[dict, dict]:
    """(per-target metadata, arrays) in `jmem.lora.read_adapters`' layout from the PEFT directory `path`.

    `n_layers` is the model's layer count (layers the adapter leaves out get zero adapters); None
    stacks up to the highest layer the file holds.
    """
    config = _read_config(path)
    pairs = _read_pairs(path)
    modules = {}  # target -> {layer: (A [r, in], B [out, r], module name)}
    for name, (a, b) in pairs.items():
        target, layer = _target_of(path, name)
        if a is None or b is None:
            raise ValueError(f"PEFT adapter {path!r}: {name} has only lora_{'B' if a is None else 'A'}; accepted: a "
                             "lora_A and a lora_B weight for each adapted module")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"PEFT adapter {path!r}: {name} has lora_A {a.shape} and lora_B {b.shape}; accepted: "
                             "lora_A [r, in] and lora_B [out, r] of one rank r")
        modules.setdefault(target, {})[layer] = (a, b, name)
    if not modules:
        raise ValueError(f"PEFT adapter {path!r} holds no LoRA weights")
    top = max((layer for per in modules.values() for layer in per if layer is not None), default=-1) + 1
    if n_layers is not None and top > n_layers:
        raise ValueError(f"PEFT adapter {path!r} adapts layer {top - 1}, but the model has {n_layers} layers; "
                         "accepted: an adapter trained on this model")
    n_layers = top if n_layers is None else n_layers
    meta, arrays = {}, {}
    for target, per in modules.items():
        meta[target], arrays[f"{target}.lora_a"], arrays[f"{target}.lora_b"] = _stack(path, config, target, per,
                                                                                     n_layers)
    return meta, arrays


def _read_config(path) -> dict:
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"PEFT adapter {path!r}: {CONFIG} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"PEFT adapter {path!r}: {CONFIG} is not a JSON object")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ValueError(f"PEFT adapter {path!r} has peft_type={kind!r}; accepted: 'LORA'")
    if config.get("use_dora"):
        raise ValueError(f"PEFT adapter {path!r} is a DoRA adapter (use_dora=true; its magnitude vectors have no "
                         "place in jmem's LoRA); accepted: a plain LoRA adapter")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"PEFT adapter {path!r}: {CONFIG} has {key}={value!r}; accepted: a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"PEFT adapter {path!r}: {key}={config[key]!r}; accepted: a map of module patterns")
    return config


def _read_pairs(path) -> dict:
    """{module key: (A, B)} as float32 NumPy arrays with each one's stored dtype name attached."""
    from safetensors import SafetensorError, safe_open

    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        found = ", ".join(sorted(os.listdir(path)))
        raise ValueError(f"PEFT adapter {path!r} has no {WEIGHTS} (found: {found}); accepted: a directory written "
                         "by PEFT's save_pretrained with safetensors (its default; a PyTorch-pickle adapter_model.bin "
                         "is not read)")
    pairs = {}
    try:
        with safe_open(file, framework="numpy") as f:
            for key in f.keys():
                head = _HEAD_KEY.fullmatch(key)
                match = head or _LAYER_KEY.fullmatch(key)
                if match is None:
                    raise ValueError(f"PEFT adapter {path!r} holds tensor {key!r}, which is no LoRA A/B of a "
                                     f"Llama linear ({', '.join(MODULES)}, lm_head); accepted: LoRA weights only "
                                     "(no modules_to_save, biases, DoRA or embedding adapters)")
                name = "lm_head" if head else f"layers.{match.group(1)}.{match.group(2)}"
                part = 0 if match.group(match.lastindex) == "A" else 1
                pair = list(pairs.get(name, (None, None)))
                pair[part] = f.get_tensor(key)
                pairs[name] = tuple(pair)
    except SafetensorError as e:
        raise ValueError(f"PEFT adapter {path!r}: {WEIGHTS} is not a readable safetensors file ({e})") from None
    return pairs


def _target_of(path, name: str) -> tuple[str, int | None]:
    if name == "lm_head":
        return "head", None
    _, layer, module = name.split(".", 2)
    if module not in MODULES:
        raise ValueError(f"PEFT adapter {path!r} adapts {name}; accepted: the Llama linears "
                         f"{', '.join(MODULES)} and lm_head")
    return MODULES[module], int(layer)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the first pattern that matches the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


def _stack(path, config: dict, target: str, per: dict, n_layers: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """One target's metadata and arrays (`lora_a [L, in, R]`, `lora_b [L, R, out]`; the head unstacked)
    from its modules `per` {layer: (A, B, module key)}."""
    rslora = bool(config.get("use_rslora", False))
    alphas = {layer: float(_pattern_value(config.get("alpha_pattern"), name if layer is None else f"model.{name}",
                                          config["lora_alpha"]))
              for layer, (_, _, name) in per.items()}
    ranks = {layer: a.shape[0] for layer, (a, _, _) in per.items()}
    dtypes = {a.dtype.name for a, _, _ in per.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 and dtypes <= {"float32", "float16", "bfloat16"} else "float32"
    meta = {"dropout": float(config.get("lora_dropout") or 0.0), "dtype": dtype, "rslora": rslora}
    if None in per:  # the untied output head: one matrix
        a, b, _ = per[None]
        return {**meta, "alpha": alphas[None], "rank": ranks[None]}, a.T.astype(np.float32), b.T.astype(np.float32)
    first_a, first_b, _ = next(iter(per.values()))
    n_in, n_out, R = first_a.shape[1], first_b.shape[0], max(ranks.values())
    uniform = len(per) == n_layers and len(set(alphas.values())) == 1 and len(set(ranks.values())) == 1
    A, B = np.zeros((n_layers, n_in, R), np.float32), np.zeros((n_layers, R, n_out), np.float32)
    for layer, (a, b, name) in per.items():
        if a.shape[1] != n_in or b.shape[0] != n_out:
            raise ValueError(f"PEFT adapter {path!r}: {name} has lora_A {a.shape} and lora_B {b.shape}, unlike the "
                             f"other layers' [r, {n_in}] / [{n_out}, r]; accepted: one shape per module")
        r = ranks[layer]
        scale = 1.0 if uniform else alphas[layer] / (math.sqrt(r) if rslora else r)
        A[layer, :, :r], B[layer, :r, :] = a.T, b.T * scale
    if uniform:
        return {**meta, "alpha": alphas[layer], "rank": R}, A, B
    return {**meta, "alpha": float(R), "rank": R, "rslora": False}, A, B
