"""Quantized model directories: jmem's own quantized leaves saved losslessly.

GGUF has no block type for most of jmem's formats (group-wise int4/int3 with
f16 scales and u8 zero points, NF4 with double quantization, FP8 with f32
scales), so a GPTQ or AWQ result written to GGUF is re-encoded. A quantized
model directory keeps every leaf exactly as it is in memory:

```
DIR/
  jmem_model.json        manifest (written last: a half-written DIR has none)
  arrays/0/...           every array, through `jmem.io.checkpoint.Checkpointer` (Orbax)
```

The manifest holds the format name and version, the `LlamaConfig` fields,
the quantization spec (method, bits, group size, symmetric, act_order), each
state entry's leaf type with its static pytree metadata and the array keys
of its children, and the tokenizer (`{"kind": "byte"}` or the GGUF
`tokenizer.*` fields that rebuild `GGUFTokenizer`), so no GGUF file is needed
to load it. Leaves are rebuilt with their own `tree_unflatten`, so loading
never dequantizes: `jmem.load(DIR)` runs on the packed weights.

Float leaves that stay unquantized (the embedding, an untied output head,
the stacked norm scales) are stored no wider than needed, and still exactly:
a float matrix is kept in the smallest of the GGML types Q4_0, Q4_K, Q4_1,
Q5_0, Q5_1, Q8_0 (blocks of 32, or 256 for Q4_K, along its last axis) and
f16, bf16 that gives back every value bit for bit, and as it is when none
does. A model read from a GGUF file whose embedding was Q8_0 (SmolLM2's) so
stores it in 8.5 bits a value, not the 32 of the float32 it was decoded to,
and `jmem.load(DIR)` decodes it to the same float32 values; a Q4_K embedding
(as in the Q4_K_M presets) stays Q4_K. The other K-quants are not tried:
encoding their decoded values again seldom lands on the original scales, so
it rarely gives the same values back.
The manifest names such an array's stored form (`"stored_as"`); the format
version is 2 when one is present, else 1 (which older readers also read).

Example:
    >>> qmodel = jmem.quant.quantize(lm.model, "rtn", bits=4, group_size=64)
    >>> save_quantized("/tmp/q4", qmodel, tokenizer=lm.tokenizer, quantization={"method": "rtn", "bits": 4})
    >>> jmem.load("/tmp/q4").generate(["The capital of France is"])
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections import Counter
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem.models.config import LlamaConfig

FORMAT = "jmem-quantized-model"
FORMAT_VERSION = 2  # 2: arrays may be stored narrower ("stored_as"); a directory without such arrays is 1
SUPPORTED_VERSIONS = (1, 2)
# Narrower exact forms tried for float matrices, fewest bits a value first (GGML blocks along the last axis).
NARROW_BLOCK_TYPES = ("Q4_0", "Q4_K", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
NARROW_FLOATS = ("float16", "bfloat16")
_PROBE_ROWS = 64  # a form is tried on the whole matrix only once it reproduces these rows
MANIFEST = "jmem_model.json"
ARRAYS = "arrays"
QUANT_FIELDS = ("method", "bits", "group_size", "symmetric", "act_order")


class QuantizedDirError(ValueError):
    """A path that is not a readable jmem quantized model directory."""


def _leaf_types() -> dict[str, type]:
    """Weight leaf classes a manifest may name (an allow-list: a manifest never imports arbitrary code)."""
    from jmem.io.ggml_mixed import MixedGGMLWeight
    from jmem.quant.awq import InputScaled
    from jmem.quant.fp8 import FP8Tensor
    from jmem.quant.ggml_weight import GGMLWeight
    from jmem.quant.nf4 import NF4Tensor
    from jmem.quant.qtensor import IntTensor

    return {c.__name__: c for c in (IntTensor, NF4Tensor, FP8Tensor, GGMLWeight, MixedGGMLWeight, InputScaled)}


# --------------------------------------------------------------------------- static metadata <-> JSON


def _aux_to_json(aux: Any, where: str) -> Any:
    """Pytree aux data as JSON; tuples and GGML types are tagged so they come back as the same Python values."""
    import gguf

    if aux is None or isinstance(aux, (bool, int, float, str)):
        return aux
    if isinstance(aux, gguf.GGMLQuantizationType):
        return {"ggml_type": aux.name}
    if isinstance(aux, np.dtype):
        return {"dtype": aux.name}
    if isinstance(aux, tuple):
        return {"tuple": [_aux_to_json(a, where) for a in aux]}
    if isinstance(aux, list):
        return [_aux_to_json(a, where) for a in aux]
    raise QuantizedDirError(f"{where}: static metadata of type {type(aux).__name__} cannot be saved; "
                            "accepted: None, bool, int, float, str, tuple, list, numpy dtype, GGML type")


def _aux_from_json(obj: Any) -> Any:
    import gguf

    if isinstance(obj, list):
        return [_aux_from_json(a) for a in obj]
    if isinstance(obj, dict):
        if "tuple" in obj:
            return tuple(_aux_from_json(a) for a in obj["tuple"])
        if "ggml_type" in obj:
            return gguf.GGMLQuantizationType[obj["ggml_type"]]
        if "dtype" in obj:
            return jnp.dtype(obj["dtype"])
        raise QuantizedDirError(f"unknown static metadata entry {obj!r} in {MANIFEST}")
    return obj


# --------------------------------------------------------------------------- leaves <-> (node, arrays)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


def _decode_narrow(stored: np.ndarray, form: str, shape, dtype) -> np.ndarray:
    """The float array a narrow form holds (numpy, so the check at save and the load decode alike)."""
    import gguf
    from gguf import quants

    if form in NARROW_FLOATS:
        return np.asarray(stored).astype(dtype)
    out = quants.dequantize(np.asarray(stored), gguf.GGMLQuantizationType[form])
    return out.reshape(shape).astype(dtype)


def _narrow_form(a: np.ndarray, form: str) -> np.ndarray | None:
    """`a` in `form` when that gives back every value of `a` bit for bit, else None."""
    from jmem.quant.ggml import FORMATS, resolve_qtype
    from jmem.quant.ggml_quantize import quantize

    if form in NARROW_FLOATS:
        stored = a.astype(jnp.dtype(form))
    else:
        if a.shape[-1] % FORMATS[resolve_qtype(form)].block_size:
            return None
        try:
            stored = quantize(a.astype(np.float32), form)
        except ValueError:  # a value the block's f16 scale cannot hold (|w| > 65504): not this form
            return None
    back = _decode_narrow(stored, form, a.shape, a.dtype)
    return stored if np.array_equal(_bits(back), _bits(a)) else None


def narrowest_exact(value) -> tuple[str, np.ndarray] | None:
    """(form, stored array) of the smallest exact form of a float matrix narrower than its own dtype, or None
    to keep it as it is (see the module docstring)."""
    dtype = jnp.dtype(value.dtype)
    if np.ndim(value) < 2 or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        return None
    a = np.asarray(value)
    if not np.all(np.isfinite(a)):
        return None
    forms = [f for f in NARROW_BLOCK_TYPES if dtype.itemsize * 8 > 8.5] + \
            [f for f in NARROW_FLOATS if jnp.dtype(f).itemsize < dtype.itemsize]
    probe = a.reshape(-1, a.shape[-1])[:_PROBE_ROWS]
    for form in forms:
        if _narrow_form(probe, form) is not None:
            stored = _narrow_form(a, form)
            if stored is not None:
                return form, stored
    return None


def _encode(value, key: str, arrays: dict, narrow: bool = True) -> dict:
    """A JSON node for one state value; its arrays go into `arrays` under keys derived from `key`. A float
    leaf (`narrow`, not the child of a quantized leaf) is stored in its narrowest exact form."""
    if _is_array(value):
        form = narrowest_exact(value) if narrow else None
        if form is None:
            arrays[key] = value
            return {"array": key}
        arrays[key] = form[1]
        return {"array": key, "stored_as": form[0], "shape": [int(s) for s in value.shape],
                "dtype": jnp.dtype(value.dtype).name}
    types = _leaf_types()
    name = type(value).__name__
    if types.get(name) is not type(value):
        raise QuantizedDirError(f"{key}: a {name} leaf cannot be saved; accepted: arrays, {', '.join(types)}")
    children, aux = value.tree_flatten()
    node = {"type": name, "aux": _aux_to_json(aux, key),
            "children": [None if c is None else _encode(c, f"{key}.{i}", arrays, narrow=False)
                         for i, c in enumerate(children)]}
    shape = getattr(value, "shape", None)
    if shape is not None:
        node["shape"] = [int(s) for s in shape]
    describe = getattr(value, "_describe", None)
    if callable(describe) and describe():
        node["info"] = describe()
    return node


def _decode(node: dict, arrays: Mapping[str, Any], key: str):
    if "array" in node and "stored_as" in node:
        form = node["stored_as"]
        if form not in (*NARROW_BLOCK_TYPES, *NARROW_FLOATS):
            raise QuantizedDirError(f"{MANIFEST}: array {node['array']!r} is stored as {form!r}; accepted: "
                                    f"{', '.join((*NARROW_BLOCK_TYPES, *NARROW_FLOATS))}")
        return jnp.asarray(_decode_narrow(arrays[node["array"]], form, tuple(node["shape"]),
                                          jnp.dtype(node["dtype"])))
    if "array" in node:
        return arrays[node["array"]]
    types = _leaf_types()
    if node.get("type") not in types:
        raise QuantizedDirError(f"{MANIFEST} names leaf type {node.get('type')!r}; accepted: {', '.join(types)}")
    children = [None if c is None else _decode(c, arrays, f"{key}.{i}") for i, c in enumerate(node["children"])]
    # The leaf's own unflatten skips constructor validation (it also rebuilds tracers), as in a jax transform;
    # flattening it again shows whether its static fields and its arrays agree (an edited manifest).
    try:
        leaf = types[node["type"]].tree_unflatten(_aux_from_json(node["aux"]), children)
        agree = len(leaf.tree_flatten()[0]) == len(children)
    except (IndexError, ValueError):
        agree = False
    if not agree:
        raise QuantizedDirError(f"{MANIFEST}: leaf {key!r} ({node['type']}, static fields {node['aux']}) lists "
                                f"{len(children)} arrays, which its static fields do not describe; write the "
                                "directory again")
    return leaf


def _array_specs(node: dict, arrays: dict) -> None:
    """Collect the array keys a node refers to (for the restore template)."""
    if "array" in node:
        arrays[node["array"]] = None
    for c in node.get("children") or []:
        if c is not None:
            _array_specs(c, arrays)


# --------------------------------------------------------------------------- save


def check_new_dir(path: str | os.PathLike, flag: str = "--out") -> pathlib.Path:
    """The output directory, which must be absent or empty (nothing is overwritten); errors name `flag`."""
    p = pathlib.Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise QuantizedDirError(f"{flag} {str(path)!r} exists and is not a directory; "
                                "accepted: a new or empty directory")
    if p.is_dir() and any(p.iterdir()):
        raise QuantizedDirError(f"{flag} {str(path)!r} is a non-empty directory; accepted: a new or empty directory "
                                "(nothing is overwritten)")
    return p


def _tokenizer_entry(tokenizer, tokenizer_metadata) -> dict:
    from jmem.io.tokenizer import ByteTokenizer

    if tokenizer_metadata is None:
        tokenizer_metadata = getattr(tokenizer, "metadata", None)  # a GGUFTokenizer keeps its fields
    if tokenizer_metadata is not None:
        meta = {k: v for k, v in tokenizer_metadata.items() if k.startswith("tokenizer.")}
        if "tokenizer.ggml.tokens" not in meta:
            raise QuantizedDirError("tokenizer_metadata has no tokenizer.ggml.tokens; pass a GGUF file's "
                                    "tokenizer_metadata() or a ByteTokenizer")
        return {"kind": "gguf", "metadata": meta}
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte"}
    raise QuantizedDirError(f"cannot save a tokenizer of type {type(tokenizer).__name__} without its metadata; "
                            "accepted: a ByteTokenizer, or tokenizer_metadata= (GGUF tokenizer.* fields)")


def _quant_entry(quantization) -> dict | None:
    if quantization is None:
        return None
    if dataclasses.is_dataclass(quantization):
        quantization = dataclasses.asdict(quantization)
    unknown = set(quantization) - set(QUANT_FIELDS)
    if unknown:
        raise QuantizedDirError(f"quantization has unknown fields {sorted(unknown)}; "
                                f"accepted: {', '.join(QUANT_FIELDS)}")
    return {k: quantization.get(k) for k in QUANT_FIELDS}


def _general_entry(general_metadata: Mapping | None) -> dict:
    """The source's `general.*` fields as GGUF holds them (`typed_field`: str, bool, int, float or a list of one
    of them), without those that describe the source file itself (its architecture key, file type, ...).

    Raises:
        QuantizedDirError: a value GGUF cannot hold, naming the field (it would be refused when the
            directory is written to GGUF).
    """
    from jmem.io.gguf_writer import FILE_GENERAL_FIELDS, typed_field

    entry = {}
    for key, value in (general_metadata or {}).items():
        if isinstance(key, str) and key.startswith("general.") and key not in FILE_GENERAL_FIELDS:
            try:
                entry[key] = typed_field(key, value, 0)[0]
            except ValueError as e:
                raise QuantizedDirError(f"general_metadata: {e}") from None
    return entry


def save_quantized(path: str | os.PathLike, model, *, tokenizer=None, tokenizer_metadata: Mapping | None = None,
                   quantization: Mapping | Any | None = None, general_metadata: Mapping | None = None) -> dict:
    """Write a (quantized) jmem Llama model to a new directory; returns the manifest.

    Args:
        path: a directory that does not exist yet or is empty.
        model: a `jmem.models.Llama` whose weights are arrays or quantized leaves
            (`IntTensor`, `NF4Tensor`, `FP8Tensor`, `GGMLWeight`, `InputScaled`).
        tokenizer: the model's tokenizer; a `ByteTokenizer` is stored as such.
        tokenizer_metadata: GGUF `tokenizer.*` fields (e.g. `GGUFFile.tokenizer_metadata()`);
            by default the tokenizer's own (`GGUFTokenizer.metadata`).
        quantization: method, bits, group_size, symmetric, act_order (a mapping or
            `jmem.quant.api.QuantSpec`), recorded in the manifest; `jmem quantize` records the
            group size each linear got (a mapping from linear to size when they differ).
        general_metadata: the source's fields to keep (e.g. `GGUFFile.metadata`): its `general.*` keys
            (name, license, organization, ...), written again when the directory becomes a GGUF file.

    The calling process writes it alone: in a multi-process run, call it on one process with
    the weights on its host (e.g. gathered by `jax.experimental.multihost_utils.process_allgather`).

    Raises:
        QuantizedDirError: the directory is not new/empty, a leaf type or tokenizer
            that cannot be saved; raised before anything is written. A write that fails
            later (a full disk) removes what it wrote.

    Example:
        >>> save_quantized("/tmp/q4", qmodel, tokenizer=lm.tokenizer,
        ...                quantization={"method": "gptq", "bits": 4, "group_size": 128})
    """
    from jmem.io.checkpoint import Checkpointer

    from jmem.io.paths import undo_on_failure

    check_new_dir(path, "path")
    tok = _tokenizer_entry(tokenizer, tokenizer_metadata)
    quant = _quant_entry(quantization)
    general = _general_entry(general_metadata)
    arrays: dict[str, Any] = {}
    leaves = {}
    for var_path, var in nnx.to_flat_state(nnx.state(model)):
        key = ".".join(map(str, var_path))
        leaves[key] = {"variable": type(var).__name__, **_encode(var.get_value(), key, arrays)}
    n_bytes = int(sum(a.size * jnp.dtype(a.dtype).itemsize for a in arrays.values()))
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if any("stored_as" in n for n in leaves.values()) else 1,
        "config": dataclasses.asdict(model.config),
        "quantization": quant,
        "leaves": leaves,
        "arrays": {k: {"shape": [int(s) for s in a.shape], "dtype": jnp.dtype(a.dtype).name}
                   for k, a in arrays.items()},
        "bytes": n_bytes,
        "tokenizer": tok,
        **({"general": general} if general else {}),
    }
    with undo_on_failure(path, "path", directory=True) as out:  # a failed write leaves no partial directory
        ckpt = Checkpointer(out / ARRAYS, max_to_keep=1, this_process_only=True)
        try:
            ckpt.save(0, arrays, {"format": FORMAT, "format_version": manifest["format_version"]})
        finally:
            ckpt.close()
        tmp = out / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest))
        tmp.replace(out / MANIFEST)  # the manifest appears only once the arrays are on disk
    return manifest


# --------------------------------------------------------------------------- load


def is_quantized_dir(path: str | os.PathLike) -> bool:
    """True when `path` is a directory holding a quantized-model manifest."""
    return (pathlib.Path(path) / MANIFEST).is_file()


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a quantized model directory, after checking its format and version.

    Raises:
        QuantizedDirError: no manifest, unreadable JSON, another format, an unknown version, a
            missing entry or one of the wrong kind.
    """
    p = pathlib.Path(path)
    if not p.is_dir():
        raise QuantizedDirError(f"{str(path)!r} is not a directory")
    mf = p / MANIFEST
    if not mf.is_file():
        raise QuantizedDirError(f"{str(path)!r} is not a jmem quantized model directory (no {MANIFEST}); accepted: "
                                "a directory written by `jmem quantize --out DIR`, a .gguf file, or a preset name")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantizedDirError(f"{mf}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise QuantizedDirError(f"{mf}: format {fmt!r} is not {FORMAT!r}")
    version = manifest.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise QuantizedDirError(f"{mf}: format_version {version!r} is not supported; accepted: "
                                f"{', '.join(map(str, SUPPORTED_VERSIONS))} (written by a newer jmem?)")
    for key in ("config", "leaves", "arrays", "tokenizer"):
        if not isinstance(manifest.get(key), dict):
            raise QuantizedDirError(f"{mf}: {key!r} is {_kind(manifest.get(key))}; accepted: a JSON object "
                                    "(a damaged or hand-edited manifest: write the directory again)")
    if not isinstance(manifest.get("bytes"), int):
        raise QuantizedDirError(f"{mf}: 'bytes' is {_kind(manifest.get('bytes'))}; accepted: an integer")
    return manifest


def _kind(value) -> str:
    return "missing" if value is None else f"a JSON {type(value).__name__} ({str(value)[:40]!r})"


def config_from_manifest(manifest: Mapping, **overrides) -> LlamaConfig:
    """`LlamaConfig` from the manifest's fields; `overrides` (dtypes, attention) replace stored values."""
    fields = dict(manifest["config"])
    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise QuantizedDirError(f"{MANIFEST}: config fields {unknown} are unknown to this jmem "
                                "(written by a newer one?)")
    try:
        return LlamaConfig(**{**fields, **overrides})
    except (TypeError, ValueError) as e:  # a hand-edited value of the wrong kind
        raise QuantizedDirError(f"{MANIFEST}: its config does not build a model ({e})") from None


def tokenizer_from_manifest(manifest: Mapping):
    from jmem.io.tokenizer import ByteTokenizer, GGUFTokenizer

    tok = manifest.get("tokenizer") or {}
    if tok.get("kind") == "byte":
        return ByteTokenizer()
    if tok.get("kind") == "gguf":
        if not isinstance(tok.get("metadata"), dict):
            raise QuantizedDirError(f"{MANIFEST}: a 'gguf' tokenizer without its 'metadata' object")
        return GGUFTokenizer(tok["metadata"])
    raise QuantizedDirError(f"{MANIFEST}: tokenizer kind {tok.get('kind')!r}; accepted: 'byte', 'gguf'")


def load_weights(path: str | os.PathLike, manifest: Mapping) -> dict[str, Any]:
    """`{state path: array or quantized leaf}` restored from the directory's arrays (bit-exact)."""
    from jmem.io.checkpoint import Checkpointer, CheckpointMismatchError

    specs = manifest["arrays"]
    wanted: dict[str, Any] = {}
    try:
        for node in manifest["leaves"].values():
            _array_specs(node, wanted)
        missing = sorted(set(wanted) - set(specs))
        if missing:
            raise QuantizedDirError(f"{MANIFEST}: leaves refer to arrays it does not list: {missing[:3]}")
        template = {k: jax.ShapeDtypeStruct(tuple(specs[k]["shape"]), jnp.dtype(specs[k]["dtype"]))
                    for k in wanted}
    except (KeyError, TypeError, AttributeError) as e:  # an entry missing or of the wrong kind
        raise QuantizedDirError(f"{MANIFEST}: a leaf or array entry is malformed ({type(e).__name__}: {e}); "
                                "write the directory again") from None
    ckpt = Checkpointer(pathlib.Path(path) / ARRAYS, read_only=True)  # loading leaves the directory as it is
    try:
        if ckpt.latest_step() is None:
            raise QuantizedDirError(f"{path}: {ARRAYS}/ holds no saved arrays (an interrupted write?)")
        arrays = ckpt.restore(template, step=0)
    except CheckpointMismatchError as e:  # its advice is a training run's
        msg = str(e)
        if " does not match the template: " in msg:
            raise QuantizedDirError(f"{path}: {ARRAYS}/ does not hold the arrays {MANIFEST} lists: "
                                    f"{msg.split(' does not match the template: ', 1)[1]}") from None
        why = msg.split(" is damaged or unreadable ", 1)[-1].split("; accepted:")[0]
        raise QuantizedDirError(f"{path}: {ARRAYS}/ is damaged or unreadable {why}; accepted: a complete "
                                "directory (write it again, e.g. `jmem quantize --out DIR`)") from None
    finally:
        ckpt.close()
    # Orbax returns arrays committed to one device; hand back uncommitted ones, as a GGUF
    # load does, so jit places them freely (a mesh's shardings, a shared compile cache).
    for k in list(arrays):
        arrays[k] = jnp.asarray(np.asarray(arrays.pop(k)))
    try:
        return {k: _decode(node, arrays, k) for k, node in manifest["leaves"].items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise QuantizedDirError(f"{MANIFEST}: a leaf entry is malformed ({type(e).__name__}: {e}); "
                                "write the directory again") from None


@dataclasses.dataclass(frozen=True)
class QuantizedModelDir:
    """A loaded directory's path and manifest; `LM.source` of models loaded from one."""

    path: str
    manifest: dict

    def tokenizer_metadata(self) -> dict[str, Any]:
        """GGUF `tokenizer.*` fields (as `GGUFFile.tokenizer_metadata()`), e.g. to write the model to GGUF."""
        from jmem.io.gguf_writer import byte_tokenizer_metadata

        tok = self.manifest["tokenizer"]
        return dict(tok["metadata"]) if tok["kind"] == "gguf" else byte_tokenizer_metadata()

    @property
    def metadata(self) -> dict[str, Any]:
        """The source model's `general.*` fields (as `GGUFFile.metadata` holds them), {} when none were kept."""
        general = self.manifest.get("general")
        return dict(general) if isinstance(general, dict) else {}


def load_quantized(path: str | os.PathLike, **config_overrides):
    """Rebuild `(model, tokenizer, source)` from a quantized model directory, leaves kept quantized.

    Args:
        path: a directory written by `save_quantized` / `jmem quantize --out DIR`.
        **config_overrides: `LlamaConfig` fields to replace (param_dtype, compute_dtype,
            attention_impl); float (unquantized) weights are cast to `param_dtype`.

    Returns:
        A `jmem.models.Llama`, its tokenizer, and a `QuantizedModelDir`.

    Example:
        >>> model, tok, src = load_quantized("/tmp/q4", compute_dtype="bf16")
    """
    from jmem.lm import set_weights
    from jmem.models.llama import Llama

    manifest = read_manifest(path)
    config = config_from_manifest(manifest, **config_overrides)
    tokenizer = tokenizer_from_manifest(manifest)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    expected = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))}
    stored = set(manifest["leaves"])
    if expected != stored:
        raise QuantizedDirError(f"{path}: the manifest's weights do not match the model its config builds "
                                f"(missing {sorted(expected - stored)[:3]}, extra {sorted(stored - expected)[:3]})")
    set_weights(model, load_weights(path, manifest))
    return model, tokenizer, QuantizedModelDir(str(path), manifest)


def _spec_value(value) -> str:
    """A recorded quantization field; a per-linear mapping (substituted group sizes) as `96 (128 for w_down)`."""
    if not isinstance(value, dict):
        return str(value)
    common = Counter(value.values()).most_common(1)[0][0]
    others = ", ".join(f"{v} for {k}" for k, v in value.items() if v != common)
    return f"{common} ({others})"


def describe(path: str | os.PathLike) -> str:
    """A few lines for `jmem info DIR`: config, quantization, leaf types, stored bytes."""
    m = read_manifest(path)
    c = config_from_manifest(m)
    q = m.get("quantization") or {}
    try:
        types = Counter(node.get("type") or (f"{node['dtype']} (stored {node['stored_as']})" if "stored_as" in node
                                             else m["arrays"][node["array"]]["dtype"]) for node in m["leaves"].values())
    except (KeyError, TypeError, AttributeError) as e:
        raise QuantizedDirError(f"{MANIFEST}: a leaf entry is malformed ({type(e).__name__}: {e}); "
                                "write the directory again") from None
    n_params = c.num_params
    general = QuantizedModelDir(str(path), m).metadata
    spec = ", ".join(f"{k}={_spec_value(q[k])}" for k in QUANT_FIELDS if q.get(k) is not None)
    if not spec:  # a trained model's --save, or a directory written without its quantization spec
        spec = "none (float weights)" if all("type" not in n for n in m["leaves"].values()) else "not recorded"
    return "\n".join([
        f"directory:     {path} ({FORMAT} v{m['format_version']})",
        f"layers:        {c.shape_line()}",
        f"quantization:  {spec}",
        f"leaf types:    {', '.join(f'{k} x{v}' for k, v in types.most_common())}",
        f"tokenizer:     {m['tokenizer']['kind']}",
        f"parameters:    {n_params:,} ({n_params / 1e6:.1f}M)",
        f"stored bytes:  {m['bytes']:,} ({8 * m['bytes'] / n_params:.2f} bits/parameter)",
        *([f"source:        {general.get('general.name', '?')} (license: {general.get('general.license', '?')})"]
          if general else []),
    ])
