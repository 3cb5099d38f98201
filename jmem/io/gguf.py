"""Read GGUF model files (v2/v3) into a jmem Llama: config, weights, tokenizer metadata.

Parsing goes through the `gguf` package's reader; block formats are dequantized by
`jmem.quant.ggml` (vectorised jnp). llama.cpp's converter permutes the rows of
`attn_q`/`attn_k` for its rotary layout; `unpermute_rotary` undoes it so the model's
half-split RoPE applies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import numpy as np

from jmem.checks import is_int
from jmem.models.config import LlamaConfig

log = logging.getLogger("jmem.io")

SUPPORTED_ARCHITECTURES = ("llama", "mistral")
MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)


class GGUFError(ValueError):
    """A GGUF file that jmem cannot read, with the reason in one line."""


@dataclasses.dataclass
class GGUFTensor:
    name: str
    qtype: str  # GGML type name: F32, Q4_1, ...
    shape: tuple[int, ...]  # numpy order: (rows, cols) = (out, in) for matrices
    data: np.ndarray  # raw: uint8 [rows, row_bytes] for block types, typed array for F32/F16/BF16


@dataclasses.dataclass
class GGUFFile:
    """A parsed GGUF file: metadata fields (python values) and tensors (raw, not dequantized)."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "?")

    def tokenizer_metadata(self) -> dict[str, Any]:
        return {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}


def _field_value(field):
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        # An array of arrays is read flat, as the gguf package's `contents()` reads it.
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file (memory-mapped; tensors stay raw).

    Raises:
        GGUFError: a missing file or a directory, not a GGUF file, a version other than 2 or 3, a
            big-endian file, a truncated file, or a file the `gguf` parser rejects.
    """
    import gguf

    path = os.fspath(path)
    if os.path.isdir(path):
        raise GGUFError(f"{path} is a directory; accepted: a .gguf file")
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic, version_bytes = f.read(4), f.read(4)
    if magic != MAGIC:
        hint = " (a .npz of LoRA adapters is served with `jmem serve --lora-modules NAME=PATH`)" \
            if magic == b"PK\x03\x04" else ""
        raise GGUFError(f"{path} is not a GGUF file (magic {magic!r}, expected {MAGIC!r}){hint}; accepted: a "
                        "GGUF model file (llama.cpp's format)")
    if len(version_bytes) == 4 and int.from_bytes(version_bytes, "little") not in SUPPORTED_VERSIONS:
        if int.from_bytes(version_bytes, "big") in SUPPORTED_VERSIONS:  # jmem decodes blocks as little-endian
            raise GGUFError(f"{path} is a big-endian GGUF file, which jmem does not read; accepted: little-endian "
                            "GGUF files (gguf's gguf_convert_endian converts it)")
        raise GGUFError(f"{path}: GGUF version {int.from_bytes(version_bytes, 'little')} is not supported; "
                        f"accepted: versions {' and '.join(map(str, SUPPORTED_VERSIONS))}")
    try:
        reader = _checked_reader(gguf, path)
    except GGUFError:
        raise
    except Exception as e:  # the parser raises assorted errors on damaged files
        raise GGUFError(f"{path}: cannot parse GGUF ({type(e).__name__}: {e}); the file is truncated or damaged") from None
    tensors = {t.name: GGUFTensor(t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)), t.data)
               for t in reader.tensors}
    metadata = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    version = int(reader.fields["GGUF.version"].parts[-1][0])
    return GGUFFile(path, version, metadata, tensors)


def _checked_reader(gguf, path: str):
    """`gguf.GGUFReader(path)` that first checks each tensor's type, alignment and extent, so a
    damaged file or one from a newer llama.cpp gets an error naming the tensor (the parser's own
    errors name neither, and a misaligned offset it reads silently)."""
    size = os.path.getsize(path)

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                name, type_id, offset = bytes(name).decode("utf-8", errors="replace"), int(raw_type[0]), int(offset[0])
                try:
                    qtype = gguf.GGMLQuantizationType(type_id)
                except ValueError:
                    raise GGUFError(f"{path}: tensor {name} has type id {type_id}, which the installed gguf package "
                                    f"({_gguf_version()}) does not know; accepted: the types of "
                                    f"gguf.GGMLQuantizationType (a newer gguf package may know it)") from None
                if offset % self.alignment:
                    raise GGUFError(f"{path}: tensor {name} starts at offset {offset}, not a multiple of the file's "
                                    f"alignment {self.alignment}; the file is damaged")
                block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
                end = start_offs + offset + int(np.prod(dims)) * block_bytes // block
                if end > size:
                    raise GGUFError(f"{path} is truncated: tensor {name} ends at byte {end} but the file has "
                                    f"{size} bytes")
            super()._build_tensors(start_offs, fields)

    return Reader(path, "r")


def _gguf_version() -> str:
    from importlib.metadata import version

    return f"gguf {version('gguf')}"


def config_from_gguf(gf: GGUFFile, **overrides) -> LlamaConfig:
    """LlamaConfig from the file's `<arch>.*` hyper-parameters, RoPE scaling included.

    Reads `<arch>.rope.scaling.{type,factor,original_context_length,yarn_beta_fast,
    yarn_beta_slow}`, `<arch>.rope.dimension_count` (partial rotary) and the
    `rope_freqs.weight` tensor (per-frequency divisors; how llama.cpp stores Llama-3.1
    scaling). RoPE fields jmem does not implement raise one `GGUFError` naming them.

    Raises:
        GGUFError: unsupported architecture, a required key missing, or unsupported RoPE metadata.
    """
    arch = gf.architecture
    if "general.architecture" not in gf.metadata:
        raise GGUFError(f"{gf.path}: required key general.architecture is missing; accepted: a GGUF model file "
                        f"of architecture {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{gf.path}: architecture {arch!r} is not supported; accepted: {', '.join(SUPPORTED_ARCHITECTURES)}")
    m = gf.metadata

    def require(key):
        if m.get(key) is None:
            raise GGUFError(f"{gf.path}: required key {key} is missing")
        return m[key]

    def count(key, default=None):  # a size: a positive integer
        value = require(key) if default is None else m.get(key, default)
        if not is_int(value) or value < 1:
            raise GGUFError(f"{gf.path}: {key}={value!r}; accepted: an integer >= 1")
        return int(value)

    dim = count(f"{arch}.embedding_length")
    n_heads = count(f"{arch}.attention.head_count")
    moe = _moe_fields(gf, arch, count)
    head_dim = count(f"{arch}.attention.key_length", dim // n_heads or dim)
    vocab = m.get(f"{arch}.vocab_size") or len(require("tokenizer.ggml.tokens"))
    return LlamaConfig(
        vocab_size=int(vocab), dim=dim, n_layers=count(f"{arch}.block_count"), n_heads=n_heads,
        n_kv_heads=count(f"{arch}.attention.head_count_kv", n_heads), head_dim=head_dim,
        ffn_dim=moe.pop("ffn_dim", None) or count(f"{arch}.feed_forward_length"),
        rope_base=float(m.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(m.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in gf.tensors,
        max_seq_len=int(m.get(f"{arch}.context_length", 2048)),
        **{**moe, **_rope_fields(gf, arch, head_dim), **overrides})


# MoE metadata keys of other architectures' routing (shared experts, sigmoid gates, weight scales,
# expert groups): a file holding one is refused rather than routed as Mixtral routes.
_MOE_UNSUPPORTED = ("expert_shared_count", "expert_weights_scale", "expert_weights_norm", "expert_group_count",
                    "expert_shared_feed_forward_length")


def _moe_fields(gf: GGUFFile, arch: str, count) -> dict[str, Any]:
    """`LlamaConfig` moe_* fields of a Mixtral-style file (`<arch>.expert_count` experts, of which
    `expert_used_count` per token, softmax router, top-k weights renormalized, as llama.cpp's llama
    architecture routes them); {} for a dense file. Dropless routing: every token reaches its experts,
    as in llama.cpp (a capacity would drop tokens the file's model never drops)."""
    m = gf.metadata
    if f"{arch}.expert_count" not in m or m[f"{arch}.expert_count"] == 0:
        return {}
    other = [f"{arch}.{k}" for k in _MOE_UNSUPPORTED if f"{arch}.{k}" in m]
    gating = m.get(f"{arch}.expert_gating_func", 1)  # llama.cpp: 1 softmax, 2 sigmoid
    if gating != 1:
        other.append(f"{arch}.expert_gating_func={gating}")
    if other:
        raise GGUFError(f"{gf.path}: mixture-of-experts metadata {', '.join(other)} is not supported; accepted: "
                        "Mixtral-style experts (expert_count, expert_used_count, softmax router)")
    experts = count(f"{arch}.expert_count")
    top_k = count(f"{arch}.expert_used_count")
    if top_k > experts:
        raise GGUFError(f"{gf.path}: {arch}.expert_used_count={top_k} exceeds {arch}.expert_count={experts}")
    if top_k == 1:  # llama.cpp gives the one chosen expert weight 1; jmem's top-1 gate is its probability
        raise GGUFError(f"{gf.path}: {arch}.expert_used_count=1 is not supported (llama.cpp weighs the one chosen "
                        "expert by 1, jmem's top-1 routing by its router probability); accepted: 2 or more")
    out = dict(moe_experts=experts, moe_top_k=top_k, moe_dropless=True)
    if f"{arch}.expert_feed_forward_length" in m:  # the experts' width (the blocks have no dense MLP)
        out["ffn_dim"] = count(f"{arch}.expert_feed_forward_length")
    return out


# RoPE metadata keys (after `<arch>.rope.`) jmem reads; any other `rope.*` key is refused, except
# these that do not change the computation.
_ROPE_READ = ("freq_base", "dimension_count", "scaling.type", "scaling.factor", "scaling.original_context_length",
              "scaling.yarn_beta_fast", "scaling.yarn_beta_slow")
_ROPE_INERT = ("scaling.finetuned",)


def _rope_fields(gf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    """`LlamaConfig` rope_* fields from the file, or one GGUFError naming what is not supported."""
    m, prefix, out = gf.metadata, f"{arch}.rope.", {}
    for key, value in m.items():
        if key.startswith(prefix) and key[len(prefix):] not in _ROPE_READ + _ROPE_INERT:
            # attn_factor 1.0 is the neutral value some converters write
            if key[len(prefix):] == "scaling.attn_factor" and float(value) == 1.0:
                continue
            raise GGUFError(f"{gf.path}: {key}={value!r} is not supported; jmem reads "
                            f"{prefix}{{{', '.join(_ROPE_READ)}}}")
    rope_dim = int(m.get(prefix + "dimension_count", head_dim))
    if rope_dim != head_dim:
        if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
            raise GGUFError(f"{gf.path}: {prefix}dimension_count={rope_dim} is not supported; accepted: an even "
                            f"number <= head_dim={head_dim}")
        out["rope_dim"] = rope_dim
    kind = str(m.get(prefix + "scaling.type", "none")).lower()
    factor = m.get(prefix + "scaling.factor")
    if kind not in ("none", "linear", "yarn"):
        raise GGUFError(f"{gf.path}: {prefix}scaling.type={kind!r} is not supported; accepted: none, linear, yarn")
    if kind != "none" and factor is not None and float(factor) not in (0.0, 1.0):  # llama.cpp: factor 0 means none
        if float(factor) < 1.0:
            raise GGUFError(f"{gf.path}: {prefix}scaling.factor={factor} is not supported; accepted: >= 1")
        out.update(rope_scaling=kind, rope_factor=float(factor))
        if kind == "yarn":
            ctx = m.get(prefix + "scaling.original_context_length") or m.get(f"{arch}.context_length")
            if ctx is None:
                raise GGUFError(f"{gf.path}: yarn scaling needs {prefix}scaling.original_context_length, missing")
            out["rope_original_context"] = int(ctx)
            for ours, theirs in (("rope_beta_fast", "yarn_beta_fast"), ("rope_beta_slow", "yarn_beta_slow")):
                if m.get(prefix + "scaling." + theirs) is not None:
                    out[ours] = float(m[prefix + "scaling." + theirs])
    if "rope_freqs.weight" in gf.tensors:
        t = gf.tensors["rope_freqs.weight"]
        factors = dequantize_tensor(t).reshape(-1)
        want = rope_dim // 2
        if factors.size != want or not np.all(factors > 0):
            raise GGUFError(f"{gf.path}: rope_freqs.weight has shape {list(t.shape)}; accepted: {want} positive "
                            f"per-frequency divisors (rotated width {rope_dim} / 2)")
        out["rope_freq_factors"] = tuple(float(f) for f in factors)
    return out


def unpermute_rotary(w_OI: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of attn_q/attn_k (`[out, in]` rows)."""
    out = w_OI.shape[0]
    return w_OI.reshape(n_heads, out // n_heads // 2, 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


def permute_rotary(w_OI: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's rotary row permutation (inverse of `unpermute_rotary`)."""
    out = w_OI.shape[0]
    return w_OI.reshape(n_heads, 2, out // n_heads // 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


def dequantize_tensor(t: GGUFTensor) -> np.ndarray:
    """float32 array of a tensor in numpy order (`[out, in]` for matrices)."""
    from jmem.quant import ggml

    if t.qtype not in ggml.SUPPORTED_TYPES:
        raise GGUFError(f"tensor {t.name} has type {t.qtype}, which jmem does not read; "
                        f"accepted: {', '.join(ggml.SUPPORTED_TYPES)}")
    return np.asarray(ggml.dequantize(t.data, t.qtype)).reshape(t.shape)


def tensor_shape(config: LlamaConfig, kind: str) -> tuple[int, ...]:
    """The numpy shape (`[out, in]` for matrices) of llama.cpp tensor `kind` (`attn_q`, `ffn_norm`, ...)."""
    c, qd, kd = config, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"token_embd": (c.vocab_size, c.dim), "output": (c.vocab_size, c.dim), "attn_q": (qd, c.dim),
            "attn_k": (kd, c.dim), "attn_v": (kd, c.dim), "attn_output": (c.dim, qd), "ffn_gate": (c.ffn_dim, c.dim),
            "ffn_up": (c.ffn_dim, c.dim), "ffn_down": (c.dim, c.ffn_dim), "attn_norm": (c.dim,),
            "ffn_norm": (c.dim,), "output_norm": (c.dim,), "ffn_gate_inp": (c.moe_experts, c.dim),
            "ffn_gate_exps": (c.moe_experts, c.ffn_dim, c.dim), "ffn_up_exps": (c.moe_experts, c.ffn_dim, c.dim),
            "ffn_down_exps": (c.moe_experts, c.dim, c.ffn_dim)}[kind]


# jmem block weight name -> llama.cpp tensor name (per block `blk.{i}.`)
BLOCK_TENSORS = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                 "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
# A mixture-of-experts block's MLP instead (the experts stacked on the tensor's first numpy axis)
MOE_TENSORS = {"moe.router.kernel": "ffn_gate_inp", "moe.expert_gate": "ffn_gate_exps",
               "moe.expert_up": "ffn_up_exps", "moe.expert_down": "ffn_down_exps"}


def block_tensors(config: LlamaConfig) -> dict[str, str]:
    """jmem block weight name -> llama.cpp tensor name for `config` (dense or mixture of experts)."""
    if not config.moe_experts:
        return BLOCK_TENSORS
    return {**{k: v for k, v in BLOCK_TENSORS.items() if not k.startswith("w_")}, **MOE_TENSORS}


def _stacked_experts(gf: GGUFFile, config: LlamaConfig) -> dict[str, GGUFTensor]:
    """The file's tensors by name, with experts stored one tensor each (`blk.N.ffn_gate.E.weight`, the
    layout of files converted before llama.cpp stacked them; llama.cpp still reads it) stacked into
    `ffn_*_exps` tensors (their blocks as stored when a layer's experts share one type, float32
    otherwise); the file's own tensors otherwise."""
    tensors = dict(gf.tensors)
    if not config.moe_experts or "blk.0.ffn_gate.0.weight" not in tensors:
        return tensors
    for i in range(config.n_layers):
        for kind in ("ffn_gate", "ffn_up", "ffn_down"):
            names = [f"blk.{i}.{kind}.{e}.weight" for e in range(config.moe_experts)]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise GGUFError(f"{gf.path}: tensor {missing[0]} is missing (the file stores one tensor per expert; "
                                f"{config.moe_experts} experts per block)")
            parts, name = [tensors.pop(n) for n in names], f"blk.{i}.{kind}_exps.weight"
            odd = next((p for p in parts if p.shape != parts[0].shape), None)
            if odd is not None:
                raise GGUFError(f"{gf.path}: tensor {odd.name} has shape {list(odd.shape)}, expert 0's "
                                f"{list(parts[0].shape)}; accepted: experts of one shape")
            if len({p.qtype for p in parts}) == 1:
                tensors[name] = GGUFTensor(name, parts[0].qtype, (len(parts), *parts[0].shape),
                                           np.stack([p.data for p in parts]))
            else:
                experts = np.stack([dequantize_tensor(p) for p in parts]).astype(np.float32)
                tensors[name] = GGUFTensor(name, "F32", experts.shape, experts)
    return tensors


def llama_weights(gf: GGUFFile, config: LlamaConfig, packed: bool = False) -> dict[str, Any]:
    """The model's weights by state path (`layers.wq.kernel` ...), stacked over layers.

    Matrices are dequantized to float32 `[in, out]`, or with `packed=True` block-quantized
    matrices stay in their GGUF blocks as `GGMLWeight` leaves (decoded inside the jitted
    step), a mixture-of-experts block's router and experts included (`[layers, experts, in,
    out]`; `moe_mlp` decodes one layer's experts at a time) and an untied output head. The
    embedding is always dequantized (it is gathered, not multiplied). A matrix whose block
    type differs across layers becomes one `MixedGGMLWeight` (still packed; each layer
    decodes its own type); one that mixes float and block layers is held as float32 with one
    warning (logger `jmem.io`) naming the extra bytes.
    """
    from jmem.io.ggml_mixed import MixedGGMLWeight
    from jmem.quant.ggml import FLOAT_TYPES, SUPPORTED_TYPES, resolve_qtype
    from jmem.quant.ggml_weight import GGMLWeight

    arch = gf.architecture
    stored = _stacked_experts(gf, config)

    def get(name):
        """The tensor, checked for a type jmem reads and the shape the metadata gives."""
        if name not in stored:
            raise GGUFError(f"{gf.path}: tensor {name} is missing")
        t = stored[name]
        if t.qtype not in SUPPORTED_TYPES:
            raise GGUFError(f"{gf.path}: tensor {name} has type {t.qtype}, which jmem does not read; "
                            f"accepted: {', '.join(SUPPORTED_TYPES)}")
        want = tensor_shape(config, name.split(".")[-2])
        if tuple(t.shape) != want:
            c = config
            raise GGUFError(f"{gf.path}: tensor {name} has shape {list(t.shape)}, but the metadata "
                            f"({arch}.embedding_length={c.dim}, head_count={c.n_heads}, head_count_kv={c.n_kv_heads}, "
                            f"head dim {c.head_dim}, feed_forward_length={c.ffn_dim}, vocab {c.vocab_size}) gives "
                            f"{list(want)}; accepted: a file whose tensors match its metadata")
        return t

    weights: dict[str, Any] = {
        "embed.embedding": dequantize_tensor(get("token_embd.weight")),
        "norm.scale": dequantize_tensor(get("output_norm.weight")),
    }
    if not config.tie_embeddings:
        head = get("output.weight")
        keep = packed and resolve_qtype(head.qtype) not in FLOAT_TYPES
        weights["head.kernel"] = GGMLWeight(head.data, head.qtype) if keep else dequantize_tensor(head).T
    blocks = block_tensors(config)
    used = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"} | {
        f"blk.{i}.{theirs}.weight" for i in range(config.n_layers) for theirs in blocks.values()}
    unused = sorted(set(stored) - used)
    if unused:  # e.g. block_count below the blocks stored: a shallower model would load without a word
        names = ", ".join(unused[:4]) + (f" (and {len(unused) - 4} more)" if len(unused) > 4 else "")
        raise GGUFError(f"{gf.path}: tensors {names} are not part of a {config.n_layers}-block "
                        f"{gf.architecture} model; accepted: a file whose tensors match its metadata")
    for ours, theirs in blocks.items():
        tensors = [get(f"blk.{i}.{theirs}.weight") for i in range(config.n_layers)]  # one shape: the metadata's
        heads = {"wq": config.n_heads, "wk": config.n_kv_heads}.get(ours)
        qtypes = {t.qtype for t in tensors}
        packed_here = packed and not ours.endswith("norm")
        if packed_here and len(qtypes) == 1 and resolve_qtype(tensors[0].qtype) not in FLOAT_TYPES:
            raw = [unpermute_rotary(t.data, heads) if heads else t.data for t in tensors]  # rows are whole blocks
            weights[block_weight_path(ours)] = GGMLWeight(np.stack(raw), tensors[0].qtype)
            continue
        if packed_here and len(qtypes) > 1 and all(resolve_qtype(q) not in FLOAT_TYPES for q in qtypes):
            # llama.cpp's *_K_M files mix block types across layers (Q6_K / Q4_K in attn_v, ffn_down)
            raw = [unpermute_rotary(t.data, heads) if heads else t.data for t in tensors]
            weights[block_weight_path(ours)] = MixedGGMLWeight.from_layers(raw, [t.qtype for t in tensors],
                                                                      in_features=tensors[0].shape[-1])
            continue
        if packed_here and len(qtypes) > 1 and any(resolve_qtype(q) not in FLOAT_TYPES for q in qtypes):
            # Float layers (F16/F32) mixed with block layers: held as float32, said once per matrix.
            packed_bytes = sum(int(t.data.nbytes) for t in tensors)
            f32_bytes = 4 * sum(int(np.prod(t.shape)) for t in tensors)
            per_layer = ",".join(t.qtype for t in tensors)
            log.warning("packed=True: %s (%s) mixes float and block types across layers (%s); held as float32: "
                        "%s bytes instead of %s packed (+%s)", block_weight_path(ours), theirs, per_layer,
                        f"{f32_bytes:,}", f"{packed_bytes:,}", f"{f32_bytes - packed_bytes:,}")
        if len({(t.qtype, t.shape) for t in tensors}) == 1:  # one dequantize call for the whole stack
            stacked = dequantize_tensor(GGUFTensor(f"blk.*.{theirs}.weight", tensors[0].qtype,
                                                   (len(tensors), *tensors[0].shape),
                                                   np.stack([t.data for t in tensors])))
        else:
            stacked = np.stack([dequantize_tensor(t) for t in tensors])
        if heads:
            stacked = np.stack([unpermute_rotary(w, heads) for w in stacked])
        if stacked.ndim >= 3:
            stacked = np.swapaxes(stacked, -1, -2)  # [L, (experts,) out, in] -> [L, (experts,) in, out]
        weights[block_weight_path(ours)] = np.ascontiguousarray(stacked)
    return weights


def block_weight_path(ours: str) -> str:
    """The state path of block weight `ours` (a name of `block_tensors`)."""
    if ours.startswith("moe."):
        return f"layers.{ours}"
    return f"layers.{ours}.{'scale' if ours.endswith('norm') else 'kernel'}"
