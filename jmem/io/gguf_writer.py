"""Write a jmem Llama to a llama-architecture GGUF file (float or any GGML block type).

The file follows llama.cpp's conventions, so `llama.cpp`, the `gguf` package and
`jmem.load` read it: `llama.*` hyper-parameters, the `tokenizer.*` fields copied
from the source model, matrices stored [out, in] under llama.cpp's tensor names,
the rotary row permutation of `attn_q`/`attn_k` re-applied (the loader undoes
it), 1-D norm weights in F32. The source's `general.*` fields (name, license, ...)
are kept, as llama.cpp's quantize keeps them.

Weights already packed as `GGMLWeight` are written byte for byte when their
target type is their own type; other leaves are decoded to float and encoded
with `jmem.quant.ggml_quantize.quantize`.
"""

from __future__ import annotations

import collections
import fnmatch
import math
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jmem.io.ggml_mixed import MixedGGMLWeight
from jmem.io.gguf import block_tensors, block_weight_path, permute_rotary, tensor_shape
from jmem.io.paths import undo_on_failure
from jmem.models.config import LlamaConfig
from jmem.quant import ggml
from jmem.quant.ggml_quantize import check_f16_range, quantize
from jmem.quant.ggml_weight import GGMLWeight
from jmem.quant.qtensor import check_finite

# `general.file_type` (llama.cpp's LlamaFileType) of the requested type, else of the type holding most weights.
# Q3_K..Q5_K have no plain file type: the _S presets keep (nearly) every matrix in the one type, as written
# here, while the _M presets move attn_v and ffn_down to wider types in some layers.
_FILE_TYPES = {
    "F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0",
    "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_S", "Q4_K": "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S",
    "Q6_K": "MOSTLY_Q6_K", "IQ4_NL": "MOSTLY_IQ4_NL",
}
_FLOAT_BY_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
# `general.*` fields that describe the written file itself: set here, never copied from the source.
FILE_GENERAL_FIELDS = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")
# Integer value types, narrowest first, with their ranges [lo, hi).
_INT_TYPES = (("UINT32", 0, 2**32), ("INT32", -2**31, 2**31), ("UINT64", 0, 2**64), ("INT64", -2**63, 2**63))
# Fields whose type llama.cpp fixes: (kind of value, GGUF type of the value or of its items).
_KNOWN_TYPES = {"tokenizer.ggml.token_type": ("int", "INT32"), "tokenizer.ggml.scores": ("float", "FLOAT32")}
_F32_MAX = float(np.finfo(np.float32).max)

QTypeSpec = str | Mapping[str, str] | Callable[[str, tuple[int, ...]], "str | None"] | None


def byte_tokenizer_metadata() -> dict[str, Any]:
    """`tokenizer.*` fields of a byte-level BPE with no merges that matches `ByteTokenizer`.

    Token i < 256 is byte i (in GPT-2's printable byte alphabet), then 256 BOS, 257 EOS,
    258 PAD: the ids of `jmem.io.tokenizer.ByteTokenizer`, for writing the random-init
    presets (vocab 259). Those three are of GGUF's unused type (5), not control (3): like
    ByteTokenizer's, no text encodes to them ("<|eos|>" in text stays bytes) and decode drops them.
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:  # GPT-2 maps the remaining bytes to code points from 256 up, in order
            alphabet[b] = chr(256 + extra)
            extra += 1
    tokens = [alphabet[b] for b in range(256)] + ["<|bos|>", "<|eos|>", "<|pad|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [],  # none, but present: llama.cpp refuses a gpt2 vocabulary without the key
        "tokenizer.ggml.token_type": [1] * 256 + [5, 5, 5],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 257,
        "tokenizer.ggml.padding_token_id": 258,
        "tokenizer.ggml.add_bos_token": False,
    }


def _kind(value) -> str | None:
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    return "str" if isinstance(value, str) else None


_EMPTY_ARRAYS = {"tokenizer.ggml.merges": "STRING"}
"""Array keys written even when empty (item type): llama.cpp stops on a gpt2 vocabulary without merges."""


def _writer(path: str, arch: str):
    """gguf's writer, which also writes empty arrays of a known item type (its own refuses them)."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer(path, arch)


def typed_field(key: str, value, n_tokens: int):
    """(value, GGUF value type, array item type or None) of a metadata field, as llama.cpp reads it.

    Integers get the narrowest of u32, i32, u64, i64 that holds them, token ids (`*_token_id`) u32,
    floats f32 (f64 beyond its range). Raises one ValueError naming the field for anything else.
    """
    import gguf

    V = gguf.GGUFValueType
    is_list = isinstance(value, (list, tuple))
    if is_list and not value and key in _EMPTY_ARRAYS:
        return [], V.ARRAY, V[_EMPTY_ARRAYS[key]]
    items = list(value) if is_list else [value]
    kinds = {_kind(v) for v in items}
    shown = f"{key}={value!r}" if len(repr(value)) <= 60 else f"{key}={repr(value)[:57]}..."
    kind, known = (kinds.pop() if len(kinds) == 1 else None), _KNOWN_TYPES.get(key)
    if kind is None or (known and kind != known[0]):
        what = f"a list of {known[0]}" if known else "str, bool, int, float, or a list of one of them"
        raise ValueError(f"metadata {shown} is not a GGUF value; accepted: {what}")
    if key.endswith("_token_id") and (is_list or kind != "int" or not 0 <= int(value) < n_tokens):
        raise ValueError(f"metadata {shown} is not a token id; accepted: an integer from 0 to {n_tokens - 1}")
    if kind == "int":
        items = [int(v) for v in items]
        names = [known[1]] if known else ["UINT32"] if key.endswith("_token_id") else [n for n, _, _ in _INT_TYPES]
        fits = [n for n, lo, hi in _INT_TYPES if n in names and lo <= min(items) and max(items) < hi]
        if not fits:
            ranges = ", ".join(f"{n} [{lo}, {hi})" for n, lo, hi in _INT_TYPES if n in names)
            raise ValueError(f"metadata {shown} is out of range; accepted: integers in {ranges}")
        vtype = V[fits[0]]
    elif kind == "float":
        items = [float(v) for v in items]
        vtype = V.FLOAT32 if known or all(abs(v) <= _F32_MAX or not math.isfinite(v) for v in items) else V.FLOAT64
    else:
        items = [bool(v) for v in items] if kind == "bool" else items
        vtype = V.BOOL if kind == "bool" else V.STRING
        if kind == "str" and not all(_is_utf8(v) for v in items):
            raise ValueError(f"metadata {shown} is not UTF-8 text (it holds a lone surrogate); accepted: str that "
                             "encodes as UTF-8")
    return (items, V.ARRAY, vtype) if is_list else (items[0], vtype, None)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lookup(params, path: str):
    """A leaf by state path from a Llama module, an nnx.State, a nested or a flat dict."""
    from flax import nnx

    if isinstance(params, Mapping) and path in params:
        node = params[path]
    else:
        node = params
        for part in path.split("."):
            if isinstance(node, Mapping):
                if part not in node:
                    raise ValueError(f"params have no entry {path!r} (missing {part!r})")
                node = node[part]
            elif hasattr(node, part):
                node = getattr(node, part)
            else:
                raise ValueError(f"params have no entry {path!r} (missing {part!r})")
    if isinstance(node, nnx.Variable):
        node = node.get_value()
    return node


def _resolve_target(spec: QTypeSpec, name: str, shape_OI: tuple[int, ...]):
    """The requested GGML type name for a matrix, or None to keep its own form."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return ggml.resolve_qtype(spec).name
    if isinstance(spec, Mapping):
        for pattern, qt in spec.items():
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                return None if qt is None else ggml.resolve_qtype(qt).name
        return None
    if callable(spec):
        qt = spec(name, shape_OI)
        return None if qt is None else ggml.resolve_qtype(qt).name
    raise ValueError(f"qtype_by_tensor must be a type name, a mapping of tensor-name patterns, a callable or "
                     f"None; got {type(spec).__name__}")


class _Matrix:
    """One weight matrix to write, stored [out, in] in the file (a mixture-of-experts tensor: one
    matrix per expert, [experts, out, in]).

    `leaf` is the model's leaf (float array, `GGMLWeight`, or another leaf with a
    `dequantize()` method), `layer` its index on the stacked axis (None when not
    stacked); `kernel` says jmem stores it [in, out] (every linear kernel; the
    embedding is [vocab, dim] in both); `fixed` a type it is always stored in (the
    MoE router's F32, as llama.cpp keeps it).
    """

    def __init__(self, leaf, layer, rotary_heads, *, kernel=True, cache=None, fixed=None):
        self.leaf, self.layer, self.rotary_heads, self.kernel = leaf, layer, rotary_heads, kernel
        self.fixed = fixed
        self.packed = leaf if isinstance(leaf, GGMLWeight) else None
        self._packed_layer = layer
        if isinstance(leaf, MixedGGMLWeight) and layer is not None:  # this layer's own block type
            self.packed, self._packed_layer = leaf.layer(layer), None
        self._cache = {} if cache is None else cache

    def _packed_raw(self):
        return self.packed.raw if self._packed_layer is None else self.packed.raw[self._packed_layer]

    def tensor_shape(self) -> tuple[int, ...]:
        """The tensor's numpy shape in the file: [out, in], or [experts, out, in]."""
        if self.packed is not None:
            return (*self._packed_raw().shape[:-2], self.packed.out_features, self.packed.in_features)
        shape = tuple(np.shape(self.leaf) if hasattr(self.leaf, "shape") else self.leaf.dequantize().shape)
        shape = shape[1:] if self.layer is not None else shape
        return (*shape[:-2], shape[-1], shape[-2]) if self.kernel else shape

    def shape_OI(self) -> tuple[int, ...]:
        """[out, in] of one matrix (one expert's, in an experts tensor)."""
        return self.tensor_shape()[-2:]

    def _float(self) -> np.ndarray:
        """The float weight in jmem's layout, this layer only."""
        if self.packed is not None:
            w_OI = np.asarray(ggml.dequantize(self._packed_raw(), self.packed.qtype))
            return np.swapaxes(w_OI, -1, -2) if self.kernel else w_OI
        leaf = self.leaf
        if hasattr(leaf, "dequantize") and not isinstance(leaf, np.ndarray):
            # Another quantized leaf: decode the whole stack once, shared across layers.
            key = id(leaf)
            if key not in self._cache:
                self._cache[key] = np.asarray(leaf.dequantize(), dtype=np.float32)
            leaf = self._cache[key]
        w = leaf if self.layer is None else leaf[self.layer]
        return np.asarray(w, dtype=np.float32)

    def native_type(self) -> str:
        if self.packed is not None:
            return self.packed.qtype.name
        dtype = np.dtype(getattr(self.leaf, "dtype", np.float32))
        return "BF16" if dtype.name == "bfloat16" else _FLOAT_BY_DTYPE.get(dtype, "F32")

    def encode(self, target: str, name: str) -> tuple[np.ndarray, str]:
        """(array for GGUFWriter, GGML type name): raw u8[out, row_bytes] or typed F32/F16."""
        if self.packed is not None and target == self.packed.qtype.name:
            raw = np.asarray(self._packed_raw())
            if self.rotary_heads is not None:  # blocks never straddle rows, so rows permute as bytes
                raw = permute_rotary(raw, self.rotary_heads)
            return np.ascontiguousarray(raw), target
        w = self._float()
        w_OI = np.ascontiguousarray(np.swapaxes(w, -1, -2) if self.kernel else w)
        if self.rotary_heads is not None:
            w_OI = permute_rotary(w_OI, self.rotary_heads)
        if target in ("F32", "F16", "BF16"):
            check_finite(w_OI, name)  # stored as they are: quantize checks only the block types' values
        if target not in ("F32", "F16"):
            return quantize(w_OI, target, name=name), target  # a block type's finiteness and f16 range
        if target == "F32":
            return w_OI, target
        check_f16_range(w_OI, name, target)
        return w_OI.astype(np.float16), target


def _tensors(config: LlamaConfig, params) -> list[tuple[str, Any]]:
    """(llama.cpp name, `_Matrix` or 1-D norm array) in llama.cpp's usual order."""
    cache: dict = {}
    out: list[tuple[str, Any]] = [
        ("token_embd.weight", _Matrix(_lookup(params, "embed.embedding"), None, None, kernel=False, cache=cache))]
    blocks = block_tensors(config)
    leaves = {ours: _lookup(params, block_weight_path(ours)) for ours in blocks}
    heads = {"wq": config.n_heads, "wk": config.n_kv_heads}
    for i in range(config.n_layers):
        for ours, theirs in blocks.items():
            name = f"blk.{i}.{theirs}.weight"
            if ours.endswith("norm"):
                out.append((name, np.asarray(leaves[ours][i], dtype=np.float32)))
            else:
                fixed = "F32" if theirs == "ffn_gate_inp" else None
                out.append((name, _Matrix(leaves[ours], i, heads.get(ours), cache=cache, fixed=fixed)))
    out.append(("output_norm.weight", np.asarray(_lookup(params, "norm.scale"), dtype=np.float32)))
    if not config.tie_embeddings:
        out.append(("output.weight", _Matrix(_lookup(params, "head.kernel"), None, None, cache=cache)))
    return out


def _write_rope_scaling(w, config: LlamaConfig) -> np.ndarray | None:
    """Write `llama.rope.scaling.*` as llama.cpp reads them; returns the `rope_freqs.weight` values to
    store, if any. llama3 scaling is stored the way llama.cpp's converter does: as per-frequency
    divisors (no scaling type), which reproduce the same frequencies."""
    import gguf

    if config.rope_scaling in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(config.rope_scaling))
        w.add_rope_scaling_factor(float(config.rope_factor))
        if config.rope_scaling == "yarn":
            w.add_rope_scaling_orig_ctx_len(int(config.rope_original_context))
            w.add_rope_scaling_yarn_beta_fast(float(config.rope_beta_fast))
            w.add_rope_scaling_yarn_beta_slow(float(config.rope_beta_slow))
    n = (config.rope_dim or config.head_dim) // 2
    if config.rope_scaling == "llama3":
        plain, _ = config.replace(rope_scaling="none", rope_freq_factors=None).rope_frequencies()
        scaled, _ = config.rope_frequencies()
        return (plain[:n].astype(np.float64) / scaled[:n]).astype(np.float32)
    if config.rope_freq_factors is not None:
        return np.asarray(config.rope_freq_factors, np.float32)
    return None


def write_gguf(path: str | os.PathLike, config: LlamaConfig, params, *, tokenizer_metadata: Mapping[str, Any],
               qtype_by_tensor: QTypeSpec = None, general_metadata: Mapping[str, Any] | None = None,
               file_type: str | None = None) -> dict[str, str]:
    """Write a llama-architecture GGUF file.

    Args:
        path: output file; its missing parent directories are created (and removed again if
            the write fails).
        config: the model's `LlamaConfig` (hyper-parameters written as `llama.*`).
        params: the weights: a `Llama` module, its `nnx.State`, or a dict by state path
            (`embed.embedding` [vocab, dim], `layers.wq.kernel` [L, in, out], ...). Kernels
            may be float arrays or `GGMLWeight`s. A mixture-of-experts config writes Mixtral's
            layout (`expert_count`, `expert_used_count`, `ffn_gate_inp` in F32 as llama.cpp keeps
            it, `ffn_{gate,up,down}_exps` with one matrix per expert).
        tokenizer_metadata: fields to copy (for example `GGUFFile.tokenizer_metadata()` of
            the source file, or `byte_tokenizer_metadata()`); only `tokenizer.*` keys are written.
        qtype_by_tensor: GGML type per matrix: one type name for every matrix; a mapping from
            llama.cpp tensor names or fnmatch patterns (`"blk.*.ffn_down.weight"`) to type
            names, first match wins; or `f(name, shape_out_in) -> type | None`. Matrices
            without a type keep their form (packed weights as they are, float arrays as
            F32/F16/BF16 by dtype); a callable gets one expert's [out, in] for an experts tensor.
            Norm weights and the MoE router are always F32.
        general_metadata: the source's fields to keep, e.g. `GGUFFile.metadata`: its `general.*`
            keys (name, license, organization, ...) are written as llama.cpp's quantize keeps them,
            except those that describe the written file (`general.architecture`, `file_type`,
            `quantization_version`, `alignment`). `general.name` is "jmem-llama" when not given.
        file_type: the requested GGML type, which `general.file_type` names (as llama.cpp's quantize
            labels a file by the type asked for, also where some matrices fall back to another);
            default: `qtype_by_tensor` when it is one type name, else the type that holds the most weights.

    Returns:
        The GGML type name written for each tensor, by tensor name.

    Raises:
        ValueError: an unsupported type, a row length that is not a whole number of
            blocks, a weight whose shape does not match `config` or that holds NaN or inf,
            a vocabulary size that differs from the tokenizer's, a metadata value GGUF cannot
            hold (or a token id outside the vocabulary), or a path that is a directory or
            cannot be written; raised before the file is opened, and nothing is left behind.

    Example:
        >>> lm = jmem.load("smollm2-135m")
        >>> write_gguf("out.gguf", lm.config, lm.model, qtype_by_tensor="Q8_0",
        ...            tokenizer_metadata=lm.source.tokenizer_metadata(), general_metadata=lm.source.metadata)

        SmolLM2's rows (576 wide) are not whole 256-weight k-quant super-blocks; for a k-quant
        pass a callable that falls back per tensor, e.g.
        `lambda name, shape: ggml.fitting_qtype("Q4_K", shape[1])`.
    """
    import gguf

    if config.moe_experts and config.moe_top_k == 1:
        raise ValueError("write_gguf: moe_top_k=1: llama.cpp weighs the one chosen expert by 1, jmem's top-1 gate by "
                         "its router probability, so the file would compute another model; accepted: moe_top_k >= 2")
    tok = {k: v for k, v in tokenizer_metadata.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in tok:
        raise ValueError("tokenizer_metadata has no tokenizer.ggml.tokens; pass the source file's "
                         "tokenizer metadata or byte_tokenizer_metadata()")
    if len(tok["tokenizer.ggml.tokens"]) != config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tok['tokenizer.ggml.tokens'])} tokens but "
                         f"config.vocab_size={config.vocab_size}")
    bad_keys = [k for k in [*(general_metadata or {}), *tok] if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"metadata key {bad_keys[0]!r} is not a str; accepted: str keys such as 'general.name'")
    general = {"general.name": "jmem-llama", **{k: v for k, v in (general_metadata or {}).items()
                                                if k.startswith("general.") and k not in FILE_GENERAL_FIELDS}}
    # An empty array is dropped (an absent field reads the same), but for the keys llama.cpp requires.
    typed = {k: typed_field(k, v, config.vocab_size) for k, v in {**general, **tok}.items()
             if not (isinstance(v, (list, tuple)) and not v and k not in _EMPTY_ARRAYS)}

    # Plan every tensor (types and shapes) before any heavy work.
    plan = []
    for tname, t in _tensors(config, params):
        if not isinstance(t, _Matrix):
            if t.shape != (config.dim,):
                raise ValueError(f"{tname}: norm weight has shape {list(t.shape)}, config expects [{config.dim}]")
            check_finite(t, tname)
            plan.append((tname, t, "F32"))
            continue
        shape, expected = t.tensor_shape(), tensor_shape(config, tname.split(".")[-2])
        if shape != expected:
            where = "[experts, out, in]" if len(shape) == 3 else "[out, in]"
            raise ValueError(f"{tname}: weight has shape {where}={list(shape)}, config expects {list(expected)}")
        shape = t.shape_OI()
        target = t.fixed or _resolve_target(qtype_by_tensor, tname, shape) or t.native_type()
        fmt = ggml.block_format(target)
        if shape[1] % fmt.block_size:
            raise ValueError(f"{tname}: row length {shape[1]} is not a multiple of the {target} block size "
                             f"{fmt.block_size}; choose another type for this tensor")
        plan.append((tname, t, target))
    if isinstance(qtype_by_tensor, Mapping):  # a typo in a pattern would leave its matrices in their own type
        names = [tname for tname, t, _ in plan if isinstance(t, _Matrix) and not t.fixed]
        fixed = [tname for tname, t, _ in plan if isinstance(t, _Matrix) and t.fixed]
        hits = lambda p, among: any(n == p or fnmatch.fnmatchcase(n, p) for n in among)  # noqa: E731
        unmatched = [p for p in qtype_by_tensor if not hits(p, names)]
        if unmatched:
            router = [p for p in unmatched if hits(p, fixed)]
            why = (f"; {', '.join(router)} {'name' if len(router) > 1 else 'names'} only the MoE router "
                   "(ffn_gate_inp), which is always F32, as llama.cpp keeps it") if router else ""
            raise ValueError(f"qtype_by_tensor patterns {unmatched} match no matrix{why}; accepted: patterns of the "
                             f"matrices' names ({', '.join(names[:3])}, ..., e.g. 'blk.*.ffn_down.weight')")
    # The file's label: the type holding most weights among the matrices a type was chosen for (not the router).
    counts = collections.Counter()
    for _, t, q in plan:
        if isinstance(t, _Matrix) and not t.fixed:
            counts[q] += math.prod(t.tensor_shape())
    if file_type is None and isinstance(qtype_by_tensor, str):
        file_type = qtype_by_tensor
    label = counts.most_common(1)[0][0] if file_type is None else ggml.resolve_qtype(file_type).name

    with undo_on_failure(path, "path") as out:  # a directory or unwritable path is refused before encoding
        # Written beside the file (a symlink's target), then renamed over it: a file being replaced stays
        # whole until the new one is, and keeps its permissions.
        out = out.resolve()
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            w = _writer(os.fspath(tmp), "llama")
            for key, (value, vtype, sub) in typed.items():
                if key.startswith("general."):
                    w.add_key_value(key, value, vtype, sub_type=sub)
            w.add_context_length(config.max_seq_len)
            w.add_embedding_length(config.dim)
            w.add_block_count(config.n_layers)
            w.add_feed_forward_length(config.ffn_dim)
            if config.moe_experts:
                w.add_expert_count(config.moe_experts)
                w.add_expert_used_count(config.moe_top_k)
            w.add_head_count(config.n_heads)
            w.add_head_count_kv(config.n_kv_heads)
            w.add_key_length(config.head_dim)
            w.add_value_length(config.head_dim)
            w.add_rope_dimension_count(config.rope_dim or config.head_dim)
            w.add_rope_freq_base(float(config.rope_base))
            freq_factors = _write_rope_scaling(w, config)
            w.add_layer_norm_rms_eps(float(config.norm_eps))
            w.add_vocab_size(config.vocab_size)
            w.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[label]]))
            if any(t not in ("F32", "F16", "BF16") for t in counts):
                w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for key, (value, vtype, sub) in typed.items():
                if not key.startswith("general."):
                    w.add_key_value(key, value, vtype, sub_type=sub)

            written: dict[str, str] = {}
            if freq_factors is not None:
                w.add_tensor("rope_freqs.weight", freq_factors)
                written["rope_freqs.weight"] = "F32"
            for tname, t, target in plan:  # every tensor is encoded (and checked) before the file is opened
                array, qtype = t.encode(target, tname) if isinstance(t, _Matrix) else (np.ascontiguousarray(t), "F32")
                raw_dtype = None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype]
                w.add_tensor(tname, array, raw_dtype=raw_dtype)
                written[tname] = qtype

            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            if out.exists():
                shutil.copymode(out, tmp)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return written
