"""`jmem quantize`: quantize a model and write it as a GGUF file.

GGUF block methods (q4_0, q4_k, q8_0, ...) are written packed in that format. The
other methods (rtn, int8, nf4, fp8, gptq, awq) have no GGUF block type of their own:
their quantized weights are dequantized and stored as `--store-type` (F16 by
default), which keeps the method's accuracy in any llama.cpp-compatible reader.
"""

from __future__ import annotations

import dataclasses
import sys

import tyro

GGUF_METHODS = ("q2_k", "q3_k", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0")


@dataclasses.dataclass(frozen=True)
class QuantizeArgs:
    """Quantize a model and write it as a GGUF file."""

    out: str
    """Output path, ending in .gguf."""
    model: str = "smollm2-135m"
    """Preset name or .gguf path of the float source."""
    method: str = "gptq"
    """rtn, int8, nf4, fp8, gptq, awq, or a GGUF block type (q4_0, q4_k, q6_k, q8_0, ...)."""
    bits: int | None = None
    """Bits for rtn/gptq/awq (2, 3, 4, 8); the method's own width when unset."""
    group_size: int | None = 64
    """Input rows per scale for rtn/gptq/awq (must divide every input dimension)."""
    calibration: str | None = None
    """Text file for gptq/awq calibration; the standard library's help text when unset."""
    calibration_windows: int = 16
    """512-token calibration windows used by gptq/awq."""
    store_type: str = "F16"
    """GGUF type that stores the dequantized weights of non-GGUF methods (F32, F16, Q8_0, ...)."""


def quantize_to_gguf(args: QuantizeArgs) -> dict[str, str]:
    """Run the quantization and write the file; returns the GGUF type of each tensor."""
    import jmem
    from jmem.data import default_documents, load_documents
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.quant import quantize
    from jmem.quant.api import METHOD_BITS
    from jmem.quant.ggml import resolve_qtype

    if not args.out.endswith(".gguf"):
        raise ValueError(f"--out {args.out!r} must end in .gguf")
    method = args.method.lower()
    if method not in (*METHOD_BITS, *GGUF_METHODS):
        raise ValueError(f"--method {args.method!r}; accepted: {', '.join((*METHOD_BITS, *GGUF_METHODS))}")
    resolve_qtype(args.store_type)  # fail before any heavy work
    lm = jmem.load(args.model)
    tok_meta = lm.source.tokenizer_metadata() if lm.source is not None else byte_tokenizer_metadata()
    if method in GGUF_METHODS:
        return write_gguf(args.out, lm.config, lm.model, tokenizer_metadata=tok_meta, qtype_by_tensor=method.upper())
    docs = load_documents(args.calibration) if args.calibration else default_documents()
    qmodel = quantize(lm.model, method, bits=args.bits, group_size=args.group_size, calibration=docs,
                      tokenizer=lm.tokenizer, max_seqs=args.calibration_windows, log=print)
    return write_gguf(args.out, lm.config, qmodel, tokenizer_metadata=tok_meta, qtype_by_tensor=args.store_type)


def quantize_main(argv: list[str] | None = None) -> None:
    args = tyro.cli(QuantizeArgs, args=argv, prog="jmem quantize")
    try:
        types = quantize_to_gguf(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jmem quantize: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    print(f"wrote {args.out}: {', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))}")
