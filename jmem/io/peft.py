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
largest, and untouched layers get zero adapters, with alpha = rank (scale 1)
and B kept in float32: the same function exactly.

Keys may carry PEFT's `base_model.model.` prefix or not (transformers' own
adapter saves). The copy of the output head PEFT saves beside an `lm_head`
adapter becomes that target's base sample, so `jmem.lora.check_base` refuses
the adapter on another head as it does jmem's own files.

Refused with one ValueError each: another PEFT method than LoRA, config fields
that change the forward pass (DoRA, aLoRA, QA-LoRA, layer replication, ...:
`FORWARD_CHANGING`), initialisations that changed the base weights (PiSSA,
OLoRA, CorDA, LoftQ), ranks that disagree with `r` / `rank_pattern`, any saved
tensor that is not a LoRA A/B of a known linear (`modules_to_save`, biases,
embedding adapters) or not floating point, a PyTorch-pickle
`adapter_model.bin` only, and arrays whose shapes do not pair up.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
FLOATS = ("float32", "float16", "bfloat16")  # the tensor dtypes read
# Hugging Face Llama module -> jmem target.
MODULES = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
           "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up", "mlp.down_proj": "w_down"}
# Keys with `base_model.model.` (a PeftModel's save) or without it (transformers' own adapter saves).
_LAYER_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")
_HEAD_KEY = re.compile(r"(?:base_model\.model\.)?lm_head\.lora_([AB])\.weight")
# The copy of the output head PEFT saves beside an lm_head adapter (save_embedding_layers="auto").
_HEAD_BASE_KEY = re.compile(r"(?:base_model\.model\.)?lm_head\.base_layer\.weight")
# Config fields that make the adapter compute something other than W x + scale B A x: refused when set.
FORWARD_CHANGING = {"use_dora": "DoRA magnitude vectors", "lora_bias": "bias on lora_B",
                    "alora_invocation_tokens": "aLoRA invocation tokens (the adapter acts only after them)",
                    "use_qalora": "QA-LoRA input pooling", "layer_replication": "replicated layers",
                    "target_parameters": "adapters on raw parameters", "use_bdlora": "block-diagonal adapters",
                    "arrow_config": "Arrow routing", "monteclora_config": "MonteCLoRA sampling",
                    "kasa_config": "KaSA singular values", "trainable_token_indices": "trained token embeddings"}
# Initialisations that also change the base weights: the adapter fits only that changed base.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


def is_peft_dir(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def read_peft(path, n_layers: int | None = None) -> tuple[dict, dict]:
    """(per-target metadata, arrays) in `jmem.lora.read_adapters`' layout from the PEFT directory `path`.

    `n_layers` is the model's layer count (layers the adapter leaves out get zero adapters); None
    stacks up to the highest layer the file holds.
    """
    config = _read_config(path)
    pairs, head_base = _read_pairs(path)
    modules = {}  # target -> {layer: (A [r, in], B [out, r], module key)}
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
        meta[target], arrays[f"{target}.lora_a"], arrays[f"{target}.lora_b"] = _stack(path, config, per, n_layers)
    if head_base is not None and "head" in meta:  # checked against the model's head as jmem files are
        from jmem.lora import base_sample

        meta["head"]["base_sample"] = base_sample(head_base.T).tolist()
    return meta, arrays


def _read_config(path) -> dict:
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"PEFT adapter {path!r}: {CONFIG} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"PEFT adapter {path!r}: {CONFIG} is not a JSON object")

    def refuse(key, accepted):
        raise ValueError(f"PEFT adapter {path!r}: {CONFIG} has {key}={config.get(key)!r}; accepted: {accepted}")

    if config.get("peft_type") != "LORA":
        refuse("peft_type", "'LORA'")
    for key, what in FORWARD_CHANGING.items():
        if config.get(key) not in (None, False, [], {}):
            refuse(key, f"a plain LoRA adapter ({key} unset: jmem's LoRA holds no {what})")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        refuse("init_lora_weights", "an adapter for the unchanged base (this initialisation also changed the base "
               "weights; save it converted with PEFT's path_initial_model_for_weight_conversion)")
    if not _positive(config.get("r"), int):
        refuse("r", "a positive integer")
    if not _positive(config.get("lora_alpha"), float):
        refuse("lora_alpha", "a positive number")
    dropout = config.get("lora_dropout")
    if dropout is not None and not (dropout == 0 or (_positive(dropout, float) and dropout < 1)):
        refuse("lora_dropout", "a number in [0, 1)")
    if not isinstance(config.get("use_rslora", False), bool):
        refuse("use_rslora", "true or false")
    for key, kind in (("rank_pattern", int), ("alpha_pattern", float)):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(isinstance(k, str) and _compiles(k) and _positive(v, kind)
                                                     for k, v in patterns.items()):
            refuse(key, f"a map of module-name regexes to positive {'integers' if kind is int else 'numbers'}")
    return config


def _positive(value, kind) -> bool:
    """`value` is a positive finite number (an integer when `kind` is int), not a bool."""
    types = (int,) if kind is int else (int, float)
    return not isinstance(value, bool) and isinstance(value, types) and math.isfinite(value) and value > 0


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _read_pairs(path) -> tuple[dict, np.ndarray | None]:
    """({module key: (A, B)} as stored, the copy of the output head PEFT saves beside an lm_head adapter)."""
    from safetensors import SafetensorError, safe_open

    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        found = ", ".join(sorted(os.listdir(path)))
        raise ValueError(f"PEFT adapter {path!r} has no {WEIGHTS} (found: {found}); accepted: a directory written "
                         "by PEFT's save_pretrained with safetensors (its default; a PyTorch-pickle adapter_model.bin "
                         "is not read)")
    pairs, head_base = {}, None
    try:
        with safe_open(file, framework="numpy") as f:
            for key in f.keys():
                if _HEAD_BASE_KEY.fullmatch(key):
                    head_base = f.get_tensor(key)
                    continue
                head = _HEAD_KEY.fullmatch(key)
                match = head or _LAYER_KEY.fullmatch(key)
                if match is None:
                    raise ValueError(f"PEFT adapter {path!r} holds tensor {key!r}, which is no LoRA A/B of a "
                                     f"Llama linear ({', '.join(MODULES)}, lm_head); accepted: LoRA weights only "
                                     "(no modules_to_save, biases, DoRA or embedding adapters)")
                tensor = f.get_tensor(key)
                if tensor.dtype.name not in FLOATS:
                    raise ValueError(f"PEFT adapter {path!r}: {key} holds {tensor.dtype.name} values; accepted: "
                                     f"{', '.join(FLOATS)}")
                name = "lm_head" if head else f"layers.{match.group(1)}.{match.group(2)}"
                pair = list(pairs.get(name, (None, None)))
                pair[0 if match.group(match.lastindex) == "A" else 1] = tensor
                pairs[name] = tuple(pair)
    except SafetensorError as e:
        raise ValueError(f"PEFT adapter {path!r}: {WEIGHTS} is not a readable safetensors file ({e})") from None
    return pairs, head_base


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


def _stack(path, config: dict, per: dict, n_layers: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """One target's metadata and arrays (`lora_a [L, in, R]`, `lora_b [L, R, out]`; the head unstacked)
    from its modules `per` {layer: (A, B, module key)}."""
    rslora = config.get("use_rslora", False)
    alphas, ranks = {}, {}
    for layer, (a, _, name) in per.items():
        module = name if layer is None else f"model.{name}"  # the module's name in PEFT's patterns
        alphas[layer] = float(_pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"]))
        ranks[layer] = a.shape[0]
        want = _pattern_value(config.get("rank_pattern"), module, config["r"])
        if ranks[layer] != want:  # PEFT scales by the configured rank: the file and its config disagree
            raise ValueError(f"PEFT adapter {path!r}: {name} has rank {ranks[layer]}, its config says {want} (r or "
                             "rank_pattern); accepted: an adapter whose tensors match its adapter_config.json")
    dtypes = {a.dtype.name for a, _, _ in per.values()}
    meta = {"dropout": float(config.get("lora_dropout") or 0.0), "dtype": dtypes.pop() if len(dtypes) == 1 else
            "float32", "rslora": rslora}
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
        A[layer, :, :r], B[layer, :r, :] = a.T, b.T.astype(np.float32) * scale
    if uniform:
        return {**meta, "alpha": alphas[layer], "rank": R}, A, B
    # Scales folded into B: kept in float32, so a 16-bit adapter's B is not rounded a second time.
    return {**meta, "alpha": float(R), "rank": R, "rslora": False, "dtype_b": "float32"}, A, B


def write_peft(loras: dict, folder) -> None:
    """Write adapters `{target: jmem.lora.LoRA}` (linears over stacked layers, and "head") as the PEFT
    directory `folder` (created if missing; its adapter files replaced), as `save_pretrained` writes it.

    PEFT's config holds one rsLoRA flag: targets whose flag differs get the alpha that gives their own
    scale under it. Ranks and alphas that differ from the first target's go to `rank_pattern` /
    `alpha_pattern` by module name. Dropout (training only) is the largest of the targets'.
    """
    from safetensors.numpy import save_file

    folder = os.path.expanduser(os.fspath(folder))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"PEFT adapter folder {folder!r} is a file; accepted: a directory (created if missing)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(folder))):
        raise ValueError(f"PEFT adapter folder {folder!r}: its parent does not exist; accepted: a path in an "
                         "existing folder")
    modules = {target: module for module, target in MODULES.items()}  # jmem target -> "self_attn.q_proj"
    names = {target: module.split(".")[1] for target, module in modules.items()} | {"head": "lm_head"}
    bad = [t for t in loras if t not in names]
    if bad:
        raise ValueError(f"adapters on {', '.join(bad)} have no PEFT layout; accepted: adapters on "
                         f"{', '.join(names)} (save the others with jmem.lora.save_adapters)")
    rslora = all(lo.rslora for lo in loras.values())
    tensors, ranks, alphas = {}, {}, {}
    for target, lo in loras.items():
        a, b = np.asarray(lo.lora_a), np.asarray(lo.lora_b)
        ranks[names[target]] = lo.rank
        alphas[names[target]] = lo.alpha if lo.rslora == rslora else lo.scale * (math.sqrt(lo.rank) if rslora
                                                                                    else lo.rank)
        layers = [(None, a, b)] if target == "head" else [(i, a[i], b[i]) for i in range(a.shape[0])]
        for i, a_i, b_i in layers:
            prefix = ("base_model.model.lm_head" if i is None else
                      f"base_model.model.model.layers.{i}.{modules[target]}")
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a_i.T)  # safetensors writes memory order
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b_i.T)
    first = next(iter(ranks))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ranks[first], "lora_alpha": alphas[first],
              "target_modules": sorted(ranks), "use_rslora": rslora,
              "rank_pattern": {m: r for m, r in ranks.items() if r != ranks[first]},
              "alpha_pattern": {m: x for m, x in alphas.items() if x != alphas[first]},
              "lora_dropout": max(lo.dropout for lo in loras.values()), "bias": "none", "fan_in_fan_out": False,
              "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None, "use_dora": False,
              "inference_mode": True, "base_model_name_or_path": None}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, WEIGHTS))
    with open(os.path.join(folder, CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
