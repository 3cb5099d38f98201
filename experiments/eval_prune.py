"""Perplexity and linear-weight bytes of SmolLM2-135M under magnitude and Wanda pruning.

    python experiments/eval_prune.py --windows 16 --calibration-windows 32 \
        --methods float,magnitude,wanda,magnitude-2:4,wanda-2:4,wanda-4:8 --sparsity 0.5 --out prune.json

Evaluation: the first `--windows` non-overlapping 512-token windows of the text;
Wanda's calibration: the `--calibration-windows` windows after them, so the two
never overlap. Default text: the standard library's `pydoc_data.topics`. A method is
`magnitude` or `wanda` (unstructured, `--sparsity` zeros per output column),
or `magnitude-N:M` / `wanda-N:M` (keep N of every M consecutive input weights;
N:M kernels are stored packed, `jmem.prune.NMSparse`). Embeddings, norms and
the tied head stay dense; bytes are the 7 block linears' stored bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

import jmem
from jmem.data import load_documents
from jmem.experiment import check_dense, check_flags_read, check_windows_fit, run_experiment
from jmem.io.paths import prepare_output
from jmem.prune import METHODS, check_fits, check_spec, prune, sparsity_report
from jmem.quant import weight_bytes
from jmem.train.loss import window_perplexity

WINDOW = 512
DEFAULT_METHODS = ("float", "magnitude", "wanda", "magnitude-2:4", "wanda-2:4")


@dataclasses.dataclass(frozen=True)
class Config:
    """Pruning perplexity table."""

    text: str | None = None
    """Text file to evaluate and calibrate on (default: pydoc_data.topics)."""
    windows: int = 4
    """Non-overlapping 512-token evaluation windows."""
    calibration_windows: int = 8
    """512-token calibration windows for wanda (taken after the evaluation windows)."""
    methods: str = ",".join(DEFAULT_METHODS)
    """Comma-separated: float, magnitude, wanda (unstructured), or magnitude-N:M, wanda-N:M (e.g. wanda-2:4)."""
    sparsity: float = 0.5
    """Fraction of zeros per output column of the unstructured methods, in [0, 1)."""
    out: str = "prune.json"
    """JSON output: a list of {method, ppl, weight_bytes, zeros, ...}."""
    model: str = "smollm2-135m"
    """Model name or GGUF path for `jmem.load`."""
    batch: int = 4
    """Windows per forward pass."""


def parse_method(name: str, sparsity: float) -> tuple[str, float | None, str | None]:
    """`"wanda-2:4"` -> ("wanda", None, "2:4"); `"magnitude"` -> ("magnitude", sparsity, None)."""
    method, dash, pattern = name.partition("-")
    if method not in METHODS or (dash and not pattern):
        raise ValueError(f"--methods: unknown method {name!r}; accepted: float, "
                         f"{', '.join(METHODS)}, or METHOD-N:M (e.g. wanda-2:4)")
    if not pattern:
        return method, sparsity, None
    try:
        check_spec(method, None, pattern)
    except ValueError as e:
        raise ValueError(f"--methods {name!r}: {e}") from None
    return method, None, pattern


def validate(cfg: Config) -> tuple[list[str], str]:
    """(methods, text) after checking every flag; a ValueError naming the first bad one. No model is loaded."""
    methods = [m.strip() for m in cfg.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods is empty; accepted: a comma-separated list among float, magnitude, wanda, "
                         "magnitude-N:M, wanda-N:M")
    for m in methods:
        if m != "float":
            parse_method(m, 0.5)
    try:
        check_spec("magnitude", cfg.sparsity, None)
    except ValueError:
        raise ValueError(f"--sparsity {cfg.sparsity}; accepted: a fraction of zeros in [0, 1)") from None
    positive = [("--windows", cfg.windows), ("--batch", cfg.batch)]
    if any(m.startswith("wanda") for m in methods):
        positive.append(("--calibration-windows", cfg.calibration_windows))
    elif cfg.calibration_windows < 0:
        raise ValueError(f"--calibration-windows {cfg.calibration_windows}; accepted: a non-negative integer")
    for flag, v in positive:
        if v < 1:
            raise ValueError(f"{flag} {v}; accepted: a positive integer")
    check_flags_read(cfg, methods, {
        "--calibration-windows": ("calibration_windows", lambda m: m.startswith("wanda"), "wanda or wanda-N:M", 0),
        "--sparsity": ("sparsity", lambda m: m in METHODS, "magnitude or wanda (N:M patterns fix their sparsity)"),
    })
    check_dense(cfg.model, "pruning")
    text = "\n\n".join(load_documents(cfg.text, "--text"))
    prepare_output(cfg.out, "--out")
    return methods, text


def _every_tenth_layer(line: str) -> None:
    # "wanda: layer 10/30 done, 12.3s": one progress line per ten layers.
    layer = int(line.split("layer ")[1].split("/")[0])
    if layer % 10 == 0:
        print(line, flush=True)


def main(cfg: Config) -> list[dict]:
    """Prune and evaluate every method of `cfg`; the flags are checked before the model loads, and the
    N:M patterns against its dimensions before any method runs."""
    methods, text = validate(cfg)
    lm = jmem.load(cfg.model)
    tokens = np.asarray(lm.tokenizer.encode(text), np.int32)
    n_calib = cfg.calibration_windows if any(m.startswith("wanda") for m in methods) else 0
    need = (cfg.windows + n_calib) * WINDOW
    check_windows_fit(int(tokens.size), cfg.windows, n_calib, "--calibration-windows", WINDOW)
    for name in methods:
        if name != "float":
            method, sparsity, pattern = parse_method(name, cfg.sparsity)
            try:
                check_fits(lm.model, check_spec(method, sparsity, pattern))
            except ValueError as e:
                raise ValueError(f"--methods {name!r}: {e}") from None
    windows = tokens[: cfg.windows * WINDOW].reshape(cfg.windows, WINDOW)
    calib = tokens[cfg.windows * WINDOW: need].reshape(n_calib, WINDOW) if n_calib else None
    base = lm.model
    float_bytes = weight_bytes(base)
    print(f"{tokens.size} tokens; eval {windows.size}, calibration {0 if calib is None else calib.size} "
          f"(disjoint); float linear weights {float_bytes / 2**20:.1f} MiB", flush=True)

    records = []
    for name in methods:
        t0 = time.time()
        if name == "float":
            model = base
        else:
            method, sparsity, pattern = parse_method(name, cfg.sparsity)
            model = prune(base, method, sparsity, pattern, calibration=calib if method == "wanda" else None,
                          max_seqs=max(n_calib, 1), seq_len=WINDOW, log=_every_tenth_layer)
        t_prune = time.time() - t0
        ppl = window_perplexity(model, windows, cfg.batch)
        total = sparsity_report(model)["total"]
        rec = dict(method=name, ppl=ppl, zeros=total["zeros"], weight_bytes=weight_bytes(model),
                   float_weight_bytes=float_bytes, bytes_ratio=weight_bytes(model) / float_bytes,
                   prune_s=round(t_prune, 1), eval_s=round(time.time() - t0 - t_prune, 1), windows=cfg.windows,
                   calibration_windows=n_calib if name.startswith("wanda") else 0)
        records.append(rec)
        print(f"{name:>14}: ppl {ppl:9.3f}  zeros {rec['zeros']:.3f}  bytes {rec['weight_bytes'] / 2**20:7.2f} MiB "
              f"({rec['bytes_ratio']:.3f} of f32)  prune {t_prune:.0f}s", flush=True)
        with open(os.path.expanduser(cfg.out), "w") as f:
            json.dump(records, f, indent=1)
    print(markdown(records))
    return records


def markdown(records: list[dict]) -> str:
    ref = next((r["ppl"] for r in records if r["method"] == "float"), None)
    lines = ["| method | perplexity | vs float | zeros | linear weight bytes | of f32 |", "|---|---|---|---|---|---|"]
    for r in records:
        rel = f"{100 * (r['ppl'] / ref - 1):+.1f}%" if ref else ""
        lines.append(f"| {r['method']} | {r['ppl']:.3f} | {rel} | {r['zeros']:.3f} | {r['weight_bytes']:,} | "
                     f"{r['bytes_ratio']:.3f} |")
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 2 for bad input (one `error: ...` line for a bad value; tyro's
    message for a flag it cannot parse)."""
    return run_experiment(Config, main, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(cli())
