"""`jmem quantize`: quantize a model and write it as a GGUF file or a quantized model directory.

`--out PATH.gguf`: GGUF block methods (q4_0, q4_k, q8_0, ...) are written packed in
that format. A k-quant (q2_k..q6_k) whose 256-weight super-block does not divide a
tensor's rows falls back for that tensor as llama.cpp does (q4_k -> Q5_0, q6_k ->
Q8_0, ...; `jmem.quant.ggml.fitting_qtype`), one printed line per substitution:
SmolLM2's width 576 needs it. The output head (the token embedding, when tied to it)
is stored as llama.cpp's quantize stores it: Q6_K, or Q8_0 where asked or where 256
does not divide its rows, or F16 where Q8_0's 32 does not divide them either
(`jmem.quant.ggml.output_qtype`). The other methods (rtn,
int8, nf4, fp8, gptq, awq) have no GGUF block type of their own: their quantized
weights are dequantized and stored as `--store-type` (F16 by default, with the same
k-quant fallback), which keeps the method's accuracy in any llama.cpp-compatible
reader. A .gguf source's `general.*` fields (name, license, ...) are kept, as
llama.cpp's quantize keeps them.

`--out DIR`: a jmem quantized model directory (`jmem.quant.saved`) that keeps every
quantized leaf exactly (packed codes, scales, zero points), for `jmem.load(DIR)`.
GGUF block methods become packed `GGMLWeight` leaves there.

`--method f32|f16|bf16` quantizes nothing: it converts a float model (a GGUF file, a preset or a directory
written by `experiments/train.py --save`) into a .gguf of that float type, as llama.cpp's converter does.
"""

from __future__ import annotations

import dataclasses
import os
import sys


GGUF_METHODS = ("q2_k", "q3_k", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0", "iq4_nl")
FLOAT_TYPES = ("f32", "f16", "bf16")  # no quantization: every matrix converted to this GGUF float type
FLOAT_METHODS = ("rtn", "int8", "nf4", "fp8", "gptq", "awq")
# Flags only some methods read: flag -> (field, the methods that read it, why another method does not).
METHOD_FLAGS = {
    "--bits": ("bits", FLOAT_METHODS, "a GGUF block type fixes its bits"),
    "--group-size": ("group_size", ("rtn", "gptq", "awq"), "its block or channel layout is fixed"),
    "--no-symmetric": ("symmetric", ("rtn", "int8", "gptq", "awq"), "its format fixes its scaling"),
    "--act-order": ("act_order", ("gptq",), "only gptq orders columns"),
    "--calibration": ("calibration", ("gptq", "awq"), "it does not calibrate"),
    "--calibration-windows": ("calibration_windows", ("gptq", "awq"), "it does not calibrate"),
    "--calibration-seq-len": ("calibration_seq_len", ("gptq", "awq"), "it does not calibrate"),
}


@dataclasses.dataclass(frozen=True)
class QuantizeArgs:
    """Quantize a model and write it as a GGUF file or a quantized model directory."""

    out: str
    """Output: a path ending in .gguf, or a directory (new or empty; a path without a file extension)."""
    model: str = "smollm2-135m"
    """The float source: the packaged smollm2-135m, a random-init preset (tiny, ...), a .gguf path or a float
    model directory (`experiments/train.py --save DIR`)."""
    method: str = "gptq"
    """rtn, int8, nf4, fp8, gptq, awq, a GGUF block type (q4_0, q4_k, q6_k, q8_0, ...), or f32 / f16 / bf16 (a
    .gguf of float matrices, nothing quantized)."""
    bits: int | None = None
    """Bits for rtn/gptq/awq (2, 3, 4, 8); the method's own width when unset."""
    group_size: int | None = 128
    """Input rows per scale for rtn/gptq/awq (a multiple of 8; -1 for per channel). A matrix of fewer input rows
    is one group; one whose input dimension it does not divide gets the largest multiple of 32 below it that does
    (printed, and recorded in the output)."""
    symmetric: bool = True
    """rtn/int8/gptq/awq: scale only (zero point 2**(bits-1)); --no-symmetric adds a u8 zero point per group."""
    act_order: bool = False
    """gptq: quantize columns by decreasing Hessian diagonal."""
    calibration: str | None = None
    """Text file for gptq/awq calibration; the standard library's help text when unset."""
    calibration_windows: int = 16
    """Calibration windows used by gptq/awq."""
    calibration_seq_len: int | None = None
    """Tokens per gptq/awq calibration window (at most the model's context); 512, or the context when shorter,
    when unset."""
    store_type: str = "F16"
    """GGUF type that stores the dequantized weights of non-GGUF methods in a .gguf --out (F32, F16, Q8_0, ...);
    a k-quant falls back per tensor as the GGUF methods do."""
    force: bool = False
    """Overwrite an existing --out .gguf file (never the --model file itself)."""


def out_kind(out: str) -> str:
    """`"gguf"` for a .gguf path, `"dir"` for a directory (existing, trailing slash, or no extension)."""
    if out.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(out) or out.endswith(("/", os.sep)) or not os.path.splitext(os.path.basename(out))[1]:
        return "dir"
    raise ValueError(f"--out {out!r}: accepted: a .gguf path or a directory (a path without a file extension)")


def check_gguf_out(out: str, model: str, force: bool) -> None:
    """Refuse a .gguf --out that is the source model's file (a packaged model's name included), or an
    existing file without --force."""
    from jmem.lm import model_source

    if not os.path.isfile(os.path.expanduser(out)):
        return
    kind, source = model_source(model, "--model")
    if kind == "gguf" and os.path.samefile(os.path.expanduser(out), source):
        raise ValueError(f"--out {out!r} is the --model file itself; accepted: another path (the source is read "
                         "while the output is written)")
    if not force:
        raise ValueError(f"--out {out!r} already exists; pass --force to overwrite it or choose another path")


def quantization_spec(args: QuantizeArgs, method: str, used: dict[str, int | None] | None = None) -> dict:
    """The quantization as the manifest records it, with the widths the method resolves to.

    `used`: the group size each linear got (`jmem.quant.api.group_sizes`). A substituted group size is
    recorded as used: one number when every linear got the same, else a mapping from linear to size.
    """
    from jmem.quant.nf4 import NF4_BLOCK

    if method in GGUF_METHODS:
        return {"method": method, "bits": None, "group_size": None, "symmetric": None, "act_order": None}
    group_size = {"int8": None, "fp8": None, "nf4": NF4_BLOCK}.get(method, args.group_size)
    if used and method in ("rtn", "gptq", "awq") and group_size not in (None, -1):
        sizes = set(used.values())
        group_size = sizes.pop() if len(sizes) == 1 else dict(used)
    bits = _bits(args, method)
    symmetric = args.symmetric if method in ("rtn", "int8", "gptq", "awq") else None
    return {"method": method, "bits": bits, "group_size": group_size, "symmetric": symmetric,
            "act_order": args.act_order if method == "gptq" else False}


def check_flags_apply(args: QuantizeArgs, method: str, kind: str) -> None:
    """Refuse a flag, set away from its default, that the method (or the kind of --out) does not read."""
    defaults = {f.name: f.default for f in dataclasses.fields(QuantizeArgs)}
    for flag, (field, methods, why) in METHOD_FLAGS.items():
        value = getattr(args, field)
        if method not in methods and value != defaults[field]:
            shown = flag if isinstance(value, bool) else f"{flag}={value}"
            raise ValueError(f"{shown} does not apply to --method {method} ({why}); accepted: {flag} only with "
                             f"--method {' / '.join(methods)}")
    if args.store_type.upper() != defaults["store_type"] and (kind == "dir" or method in (*GGUF_METHODS, *FLOAT_TYPES)):
        target = f"--method {method} (written in its own block type)" if kind == "gguf" else \
            "--out DIR (a directory keeps the quantized weights as they are)"
        raise ValueError(f"--store-type={args.store_type} does not apply to {target}; accepted: --store-type only "
                         f"with a .gguf --out and --method {' / '.join(FLOAT_METHODS)}")


def _bits(args: QuantizeArgs, method: str) -> int:
    from jmem.quant.api import DEFAULT_BITS

    return args.bits if args.bits is not None else DEFAULT_BITS.get(method, 4)


def _group_rule(bits: int) -> str:
    from jmem.quant.qtensor import PACK_ROWS

    if bits == 8:
        return "8-bit codes take any group size"
    return f"{bits}-bit codes are packed {PACK_ROWS} rows at a time, so groups are multiples of {PACK_ROWS}"


def _check_numbers(args: QuantizeArgs, method: str) -> None:
    """The numeric flags the method reads, before the model loads."""
    from jmem.quant.qtensor import PACK_ROWS

    if method in (*GGUF_METHODS, *FLOAT_TYPES):
        return
    g, bits = args.group_size, _bits(args, method)
    if method in ("rtn", "gptq", "awq") and g is not None and g != -1:
        if g <= 0:
            raise ValueError(f"--group-size {g}; accepted: a positive number of input rows per scale "
                             f"(a multiple of {PACK_ROWS} below 8 bits), or -1 for per channel")
        if bits != 8 and g % PACK_ROWS:
            raise ValueError(f"--group-size {g} is not a multiple of {PACK_ROWS} ({_group_rule(bits)}); accepted: "
                             f"a multiple of {PACK_ROWS} (e.g. 32, 64, 128), --group-size -1 for per channel, or "
                             "--bits 8 (any size)")
    if method in ("gptq", "awq") and args.calibration_windows < 1:
        raise ValueError(f"--calibration-windows {args.calibration_windows}; accepted: a positive integer")
    if method in ("gptq", "awq") and args.calibration_seq_len is not None and args.calibration_seq_len < 1:
        raise ValueError(f"--calibration-seq-len {args.calibration_seq_len}; accepted: a positive integer")


def check_group_fits(weights: dict, group_size: int | None, bits: int) -> None:
    """Refuse a --group-size that `jmem.quant.quantize` cannot use for some linear (its rule, said in flags)."""
    from jmem.quant.api import SUBSTITUTE_MULTIPLE, resolve_group_size
    from jmem.quant.qtensor import PACK_ROWS, group_size_choices

    shown = "-1 (per channel)" if group_size in (None, -1) else str(group_size)
    for name, w in weights.items():
        n_in = int(w.shape[-2])
        try:
            resolve_group_size(n_in, group_size, bits)
        except ValueError:
            if bits != 8 and n_in % PACK_ROWS:
                raise ValueError(f"--group-size {shown}: {name}'s input dimension {n_in} is not a multiple of "
                                 f"{PACK_ROWS}, so no group fits {bits}-bit codes ({_group_rule(bits)}); "
                                 "accepted: --bits 8") from None
            examples = ", ".join(map(str, group_size_choices(n_in, bits, group_size)))
            raise ValueError(f"--group-size {shown} does not fit {name}: it does not divide the input dimension "
                             f"{n_in}, nor does any multiple of {SUBSTITUTE_MULTIPLE} below it; accepted: a size "
                             f"that divides {n_in} or has a multiple of {SUBSTITUTE_MULTIPLE} below it that does "
                             f"(e.g. {examples}), or --group-size -1 for per channel") from None


def _leaf_kinds(model) -> dict[str, str]:
    from flax import nnx

    kinds = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        v = var.get_value()
        kinds[".".join(map(str, path))] = type(v).__name__ if hasattr(v, "__jmem_dot__") else str(v.dtype)
    return kinds


def quantize_to_file(args: QuantizeArgs) -> dict[str, str]:
    """Run the quantization and write `--out`; returns the GGUF type (or leaf type) of each tensor.

    Every flag is checked before anything is loaded or created; a run that fails later removes what it
    created (the output and the directories made for it).
    """
    from jmem.data import load_documents
    from jmem.io.paths import undo_on_failure
    from jmem.lm import model_source
    from jmem.quant.api import CALIBRATED, METHOD_BITS
    from jmem.quant.ggml import resolve_qtype
    from jmem.quant.saved import check_new_dir

    model_source(args.model, "--model")  # a missing model named as the flag, before the other checks
    kind = out_kind(args.out)
    method = args.method.lower()
    methods = (*METHOD_BITS, *GGUF_METHODS, *FLOAT_TYPES)
    if method not in methods:
        raise ValueError(f"--method {args.method!r}; accepted: {', '.join(methods)}")
    if method in FLOAT_TYPES and kind == "dir":
        raise ValueError(f"--method {method} writes a .gguf file; accepted with --out PATH.gguf (a directory keeps "
                         f"the float weights of `--save` as they are)")
    check_flags_apply(args, method, kind)
    if method in METHOD_BITS and args.bits is not None and args.bits not in METHOD_BITS[method]:
        raise ValueError(f"--bits={args.bits} is not supported by --method {method}; accepted: "
                         f"{', '.join(map(str, METHOD_BITS[method]))}")
    _check_numbers(args, method)
    docs = load_documents(args.calibration, "--calibration") if method in CALIBRATED else None
    if kind == "gguf":
        try:
            resolve_qtype(args.store_type)
        except ValueError as e:
            raise ValueError(f"--store-type {args.store_type!r}: {e}") from None
        check_gguf_out(args.out, args.model, args.force)
    else:
        check_new_dir(args.out)
    # A directory --out is created empty now; a .gguf one is opened once (a read-only mount, /proc: refused now).
    with undo_on_failure(args.out, "--out", directory=kind == "dir"):
        return _quantize_and_write(args, method, kind, docs)


def _say(line: str) -> None:
    """A progress line on stdout; a reader that went away (`| head`) costs the line, not the output
    being written (the command ends quietly once it is written)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        pass


def _quantize_and_write(args: QuantizeArgs, method: str, kind: str, docs) -> dict[str, str]:
    import jmem
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.quant import quantize
    from jmem.quant.api import CALIBRATED, check_float_model, group_sizes, method_kwargs
    from jmem.quant.ggml import block_format, fallback_lines, fitting_qtype, output_qtype
    from jmem.quant.ggml_weight import quantize_gguf_blocks
    from jmem.quant.saved import save_quantized

    lm = jmem.load(args.model)
    weights = check_float_model(lm.model)
    if method in ("rtn", "gptq", "awq"):
        check_group_fits(weights, args.group_size, _bits(args, method))
    tok_meta = lm.source.tokenizer_metadata() if lm.source is not None else byte_tokenizer_metadata()
    general = getattr(lm.source, "metadata", None)  # a GGUF file's or a directory's general.* fields

    # The output head, or the token embedding that is also the head: llama.cpp keeps it at Q6_K or above.
    head = "token_embd.weight" if lm.config.tie_embeddings else "output.weight"

    def write(params, qtype: str) -> dict[str, str]:
        """`qtype` for every matrix, with llama.cpp's fallback where its block does not divide the rows,
        and llama.cpp's type for the output head."""
        rows: dict[str, int] = {}

        def qtype_of(name: str, shape_OI) -> str:
            if name == head:
                return output_qtype(qtype, shape_OI[1]).name
            rows[name] = shape_OI[1]
            fitting = fitting_qtype(qtype, shape_OI[1])
            if shape_OI[1] % block_format(fitting).block_size:
                raise ValueError(f"{name}: row length {shape_OI[1]} is not a multiple of the {fitting.name} block "
                                 f"size {block_format(fitting).block_size}; accepted: a k-quant --method (q2_k .. "
                                 "q6_k), which falls back per tensor as llama.cpp does, down to F16")
            return fitting.name

        types = write_gguf(args.out, lm.config, params, tokenizer_metadata=tok_meta, qtype_by_tensor=qtype_of,
                           general_metadata=general,
                           file_type=qtype)
        for line in fallback_lines(qtype, {n: (r, types[n]) for n, r in rows.items()}):
            _say(line)
        if types.get(head, qtype.upper()) != qtype.upper():
            _say(f"{head} (the output head): stored as {types[head]}, as llama.cpp keeps the head at Q6_K "
                 f"(Q8_0 where 256 does not divide its rows, F16 where 32 does not either)")
        return types

    c = lm.config
    if kind == "gguf" and c.moe_experts and not c.moe_dropless:
        _say(f"note: a GGUF file records no expert capacity and loads routing every token (dropless, as llama.cpp "
             f"routes); this model's full-sequence forward drops tokens past capacity factor "
             f"{c.moe_capacity_factor}, so its logits there differ (cached generation is dropless in both)")
    if method in FLOAT_TYPES:
        return write_gguf(args.out, c, lm.model, tokenizer_metadata=tok_meta, qtype_by_tensor=method.upper(),
                          general_metadata=general, file_type=method.upper())
    if method in GGUF_METHODS:
        if kind == "gguf":
            return write(lm.model, method)
        qmodel, _ = quantize_gguf_blocks(lm.model, method, log=_say)
    else:
        context = lm.config.max_seq_len
        seq_len = min(512, context) if args.calibration_seq_len is None else args.calibration_seq_len
        if method in CALIBRATED and seq_len > context:
            raise ValueError(f"--calibration-seq-len {seq_len} exceeds the model's context of {context} tokens; "
                             f"accepted: 1..{context}")
        qmodel = quantize(lm.model, method, bits=args.bits, log=_say, **method_kwargs(
            method, group_size=args.group_size, calibration=docs, tokenizer=lm.tokenizer, symmetric=args.symmetric,
            act_order=args.act_order, max_seqs=args.calibration_windows, seq_len=seq_len))
        if kind == "gguf":
            return write(qmodel, args.store_type)
    save_quantized(args.out, qmodel, tokenizer=lm.tokenizer,  # a GGUF tokenizer carries its own fields
                   quantization=quantization_spec(args, method, group_sizes(qmodel)), general_metadata=general)
    return _leaf_kinds(qmodel)


def run_quantize(args: QuantizeArgs) -> None:
    """`jmem quantize`: quantize, write, print what was written (one error line and exit 2 on bad input
    or a failed read or write)."""
    try:
        types = quantize_to_file(args)
    except BrokenPipeError:
        raise
    except (ValueError, OSError) as e:
        print(f"jmem quantize: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    print(f"wrote {args.out}: {', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))}")
