"""Perplexity and weight bytes of SmolLM2-135M under each quantization method.

    python experiments/eval_quant.py --text FILE --windows 16 \
        --methods float,int8,rtn4,rtn3,nf4,gptq4,gptq3,awq4,awq3,fp8,q4_0,q4_k,q6_k,q8_0 --out quant.json

Evaluation: the first `--windows` non-overlapping 512-token windows of the text;
calibration (gptq, awq): the `--calibration-windows` windows after them, so the
two never overlap. Default text: the standard library's `pydoc_data.topics`.
`float` is the dequantized source model (its stored types are printed first: the
packaged SmolLM2 file stores its layer matrices as Q4_1, so `q4_1` reproduces `float`).
GGUF block formats use llama.cpp's own fallback for
matrices whose input dimension is not a multiple of 256 (Q4_K -> Q5_0,
Q6_K -> Q8_0; SmolLM2's width 576 needs it; `jmem.quant.ggml_weight.quantize_gguf_blocks`),
recorded per method. Likewise the
4/3-bit methods' group 128 does not divide the width 576: those matrices get
group 96 (`jmem.quant.quantize`'s substitution), recorded per matrix in
`group_sizes`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import Counter

import numpy as np

import jmem
from jmem.data import load_documents
from jmem.experiment import check_flags_read, check_windows_fit, model_config, run_experiment
from jmem.io.paths import prepare_output
from jmem.quant import group_sizes, quantize, weight_bytes
from jmem.quant.api import method_kwargs, resolve_group_size
from jmem.quant.ggml_weight import quantize_gguf_blocks
from jmem.train.loss import window_perplexity

WINDOW = 512
CALIBRATED = {"gptq4": ("gptq", 4), "gptq3": ("gptq", 3), "awq4": ("awq", 4), "awq3": ("awq", 3)}
PLAIN = {"int8": ("int8", 8), "rtn4": ("rtn", 4), "rtn3": ("rtn", 3), "nf4": ("nf4", 4), "fp8": ("fp8", 8)}
GGUF = {"q4_0": "Q4_0", "q4_k": "Q4_K", "q6_k": "Q6_K", "q8_0": "Q8_0", "q4_1": "Q4_1", "q5_0": "Q5_0",
        "iq4_nl": "IQ4_NL"}
ALL = ("float", *PLAIN, *CALIBRATED, *GGUF)
GROUPED = ("rtn", "gptq", "awq")  # the methods --group-size applies to


@dataclasses.dataclass(frozen=True)
class Config:
    """Quantization perplexity table."""

    text: str | None = None
    """Text file to evaluate and calibrate on (default: pydoc_data.topics)."""
    windows: int = 16
    """Non-overlapping 512-token evaluation windows."""
    methods: str = ",".join(ALL)
    """Comma-separated methods among: float, int8, rtn4, rtn3, nf4, fp8, gptq4, gptq3, awq4, awq3, q4_0, q4_k, q6_k,
    q8_0, q4_1, q5_0, iq4_nl (all by default)."""
    out: str = "quant.json"
    """JSON output: a list of {method, ppl, weight_bytes, ...}."""
    model: str = "smollm2-135m"
    """Model name or GGUF path for `jmem.load`."""
    group_size: int = 128
    """Input rows per scale of rtn, gptq and awq: a positive multiple of 8. A matrix of fewer input rows is one
    group; one whose input dimension it does not divide gets the largest multiple of 32 below it that does
    (SmolLM2's width 576 with 128: 96), recorded in each record's `group_sizes`; a value that fits no input
    dimension this way is refused before the model loads."""
    calibration_windows: int = 16
    """512-token calibration windows for gptq/awq (taken after the evaluation windows)."""
    symmetric: bool = False
    """Scale-only grids for rtn/int8/gptq/awq; the default adds a zero point per group (per channel for int8), as
    the GPTQ and AWQ papers do."""
    act_order: bool = True
    """GPTQ column order by decreasing Hessian diagonal."""
    batch: int = 4
    """Windows per forward pass."""


def validate(cfg: Config) -> tuple[list[str], str]:
    """(methods, text) after checking every flag; a ValueError naming the first bad one. No model is loaded."""
    methods = [m.strip() for m in cfg.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError(f"--methods is empty; accepted: a comma-separated list among {', '.join(ALL)}")
    bad = [m for m in methods if m not in ALL]
    if bad:
        raise ValueError(f"--methods: unknown methods {bad}; accepted: {', '.join(ALL)}")
    positive = [("--windows", cfg.windows), ("--batch", cfg.batch), ("--group-size", cfg.group_size)]
    if any(m in CALIBRATED for m in methods):
        positive.append(("--calibration-windows", cfg.calibration_windows))
    elif cfg.calibration_windows < 0:
        raise ValueError(f"--calibration-windows {cfg.calibration_windows}; accepted: a non-negative integer")
    for flag, v in positive:
        if v < 1:
            raise ValueError(f"{flag} {v}; accepted: a positive integer")
    spec = {**PLAIN, **CALIBRATED}

    def kind(m):
        return spec[m][0] if m in spec else m

    check_flags_read(cfg, methods, {
        "--group-size": ("group_size", lambda m: kind(m) in GROUPED, "rtn4, rtn3, gptq4, gptq3, awq4, awq3"),
        "--calibration-windows": ("calibration_windows", lambda m: m in CALIBRATED, "gptq4, gptq3, awq4, awq3", 0),
        "--symmetric": ("symmetric", lambda m: kind(m) in ("int8", *GROUPED), "int8, rtn, gptq and awq methods"),
        "--no-act-order": ("act_order", lambda m: kind(m) == "gptq", "gptq4, gptq3"),
    })
    grouped_bits = sorted({spec[m][1] for m in methods if m in spec and spec[m][0] in GROUPED})
    if grouped_bits:
        check_group_flag(cfg.group_size, cfg.model, grouped_bits)
    text = "\n\n".join(load_documents(cfg.text, "--text"))
    prepare_output(cfg.out, "--out")
    return methods, text


def input_dims(model: str) -> dict[str, int]:
    """Input dimension of each weight `quantize` replaces in `model` (`quant_targets`: the linears, or an MoE
    model's experts in place of its MLP linears), from its config alone: no weights are loaded."""
    from flax import nnx

    from jmem.models.llama import Llama
    from jmem.quant.api import quant_targets

    config = model_config(model)
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return {n: int(v.get_value().shape[-2]) for n, v in quant_targets(abstract).items()}


def check_group_flag(group_size: int, model: str, bits: list[int]) -> None:
    """A ValueError naming --group-size when `quantize` at any of `bits` would refuse it for a linear of `model`
    (`resolve_group_size`'s rule, checked on the input dimensions before anything loads)."""
    dims = input_dims(model)

    def fits(n_in, g):
        try:
            for b in bits:
                resolve_group_size(n_in, g, b)
        except ValueError:
            return False
        return True

    bad = sorted({n for n in dims.values() if not fits(n, group_size)})
    if not bad:
        return
    examples = [g for g in (32, 64, 128, 256) if all(fits(n, g) for n in dims.values())]
    raise ValueError(f"--group-size={group_size} does not fit the input dimension{'s' * (len(bad) > 1)} "
                     f"{', '.join(map(str, bad))} of --model {model}; accepted: a positive multiple of 8 that divides "
                     f"each input dimension ({', '.join(map(str, sorted(set(dims.values()))))}) or has a multiple "
                     f"of 32 below it that does" + (f", e.g. {', '.join(map(str, examples))}" if examples else ""))


def source_types(lm) -> str:
    """The stored types of the source GGUF's layer matrices (e.g. 'Q4_1 x 180, Q6_K x 30'); '' for
    a model not read from a GGUF file."""
    tensors = getattr(getattr(lm, "source", None), "tensors", None)
    if not isinstance(tensors, dict):
        return ""
    counts = Counter(str(t.qtype) for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2)
    return ", ".join(f"{k} x {n}" for k, n in counts.most_common())


def main(cfg: Config) -> list[dict]:
    """Quantize and evaluate every method of `cfg`; the flags are checked before the model loads."""
    methods, text = validate(cfg)
    lm = jmem.load(cfg.model)
    tokens = np.asarray(lm.tokenizer.encode(text), np.int32)
    n_calib = cfg.calibration_windows if any(m in CALIBRATED for m in methods) else 0  # only gptq and awq calibrate
    need = (cfg.windows + n_calib) * WINDOW
    check_windows_fit(int(tokens.size), cfg.windows, n_calib, "--calibration-windows", WINDOW)
    windows = tokens[: cfg.windows * WINDOW].reshape(cfg.windows, WINDOW)
    calib = tokens[cfg.windows * WINDOW: need].reshape(n_calib, WINDOW)
    base = lm.model
    float_bytes = weight_bytes(base)
    print(f"{tokens.size} tokens; eval {windows.size}, calibration {calib.size} (disjoint); "
          f"float linear weights {float_bytes / 2**20:.1f} MiB")
    stored = source_types(lm)
    if stored:  # `float` is this file's weights dequantized: a method of the same format loses little or nothing
        print(f"source weights (float = them, dequantized): {stored}")

    records = []
    for m in methods:
        t0 = time.time()
        extra = {}
        if m == "float":
            model = base
        elif m in PLAIN:
            method, bits = PLAIN[m]
            model = quantize(base, method, bits=bits, log=print,
                             **method_kwargs(method, group_size=cfg.group_size, symmetric=cfg.symmetric))
            extra["group_sizes"] = group_sizes(model)
        elif m in CALIBRATED:
            method, bits = CALIBRATED[m]
            model = quantize(base, method, bits=bits, log=lambda line: print(line, flush=True), **method_kwargs(
                method, group_size=cfg.group_size, calibration=calib, symmetric=cfg.symmetric,
                act_order=cfg.act_order, max_seqs=cfg.calibration_windows))
            extra["group_sizes"] = group_sizes(model)
        else:
            model, used = quantize_gguf_blocks(base, GGUF[m], log=print)
            extra["gguf_types"] = used
        t_quant = time.time() - t0
        ppl = window_perplexity(model, windows, cfg.batch)
        rec = dict(method=m, ppl=ppl, weight_bytes=weight_bytes(model), float_weight_bytes=float_bytes,
                   bytes_ratio=weight_bytes(model) / float_bytes, quantize_s=round(t_quant, 1),
                   eval_s=round(time.time() - t0 - t_quant, 1), windows=cfg.windows,
                   group_size=cfg.group_size if m not in ("float", "int8", "fp8", "nf4") and m not in GGUF else None,
                   **extra)
        records.append(rec)
        print(f"{m:>6}: ppl {ppl:8.3f}  bytes {rec['weight_bytes'] / 2**20:7.2f} MiB "
              f"({rec['bytes_ratio']:.3f} of f32)  quantize {t_quant:.0f}s", flush=True)
        with open(os.path.expanduser(cfg.out), "w") as f:
            json.dump(records, f, indent=1)
    print(markdown(records))
    return records


def markdown(records: list[dict]) -> str:
    ref = next((r["ppl"] for r in records if r["method"] == "float"), None)
    lines = ["| method | perplexity | vs float | linear weight bytes | of f32 |", "|---|---|---|---|---|"]
    for r in records:
        rel = f"{100 * (r['ppl'] / ref - 1):+.2f}%" if ref else ""
        lines.append(f"| {r['method']} | {r['ppl']:.3f} | {rel} | {r['weight_bytes']:,} | {r['bytes_ratio']:.3f} |")
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 2 for bad input (one `error: ...` line for a bad value; tyro's
    message for a flag it cannot parse)."""
    return run_experiment(Config, main, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(cli())
