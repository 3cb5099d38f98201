"""Greedy decode tokens/s of jmem vs Hugging Face transformers (torch CPU), same GGUF file.

    python experiments/bench_generate.py            # batch 1 and 8, 64 new tokens
    python experiments/bench_generate.py --skip-hf  # jmem only

Both sides generate greedily from the same prompts; the table reports new tokens
per second after one warm-up call (compilation excluded), and whether the greedy
texts are identical.

Bad flags end with one `error:` line on stderr and exit status 2, before any model loads.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import jmem
from jmem.experiment import run_experiment
from jmem.lm import packaged_model_path

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):", "The three laws of thermodynamics are", "In 1969, the first humans",
           "A good recipe for bread needs", "The main difference between TCP and UDP is", "Photosynthesis converts"]


@dataclasses.dataclass(frozen=True)
class Args:
    """Greedy decode tokens/s of jmem vs Hugging Face transformers."""

    batches: tuple[int, ...] = (1, 8)
    """Batch sizes to time."""
    new_tokens: int = 64
    """New tokens per row (EOS is ignored so every row decodes the same count)."""
    repeats: int = 3
    """Timed runs per batch size; the median is reported."""
    skip_hf: bool = False
    """Time jmem alone (when torch/transformers are not installed)."""
    threads: int = 2
    """CPU threads for torch (the HF side). JAX's XLA uses every core, so give the machine's core count for a
    like-for-like speed-up (docs/benchmarks.md's runs: 2 cores, 2 threads)."""


def validate(args: Args) -> None:
    """A ValueError naming the first bad flag; nothing is loaded."""
    if not args.batches:
        raise ValueError("--batches is empty; accepted: one or more integers >= 1")
    for b in args.batches:
        if b < 1:
            raise ValueError(f"--batches={b}; accepted: integers >= 1")
    for flag, v in (("--new-tokens", args.new_tokens), ("--repeats", args.repeats), ("--threads", args.threads)):
        if v < 1:
            raise ValueError(f"{flag}={v}; accepted: an integer >= 1")
    from jmem.io.gguf import config_from_gguf, read_gguf  # the header only: the weights stay on disk

    context = config_from_gguf(read_gguf(packaged_model_path("smollm2-135m"))).max_seq_len
    most = context - max(len(p.encode()) for p in PROMPTS)  # a prompt has at most one token per byte
    if args.new_tokens > most:
        raise ValueError(f"--new-tokens={args.new_tokens}; accepted: at most {most} (the model's context of "
                         f"{context} tokens less the longest prompt)")


def _median(xs):
    return statistics.median(xs)


def time_jmem(lm, prompts, n):
    from jmem.generate import generate_ids

    ids = [lm.tokenizer.encode(p) for p in prompts]
    generate_ids(lm.model, ids, n)  # compile
    t0 = time.perf_counter()
    out = generate_ids(lm.model, ids, n)
    dt = time.perf_counter() - t0
    return sum(len(o) for o in out) / dt, [lm.tokenizer.decode(o) for o in out]


def time_hf(model, tok, prompts, n):
    import torch

    enc = tok(prompts, return_tensors="pt", padding=True)
    # No EOS on either side: both decode exactly n argmax tokens, EOS included.
    kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
    with torch.inference_mode():
        model.generate(**enc, **kw)
        t0 = time.perf_counter()
        out = model.generate(**enc, **kw)
        dt = time.perf_counter() - t0
    new = out[:, enc["input_ids"].shape[1]:]
    return new.numel() / dt, [tok.decode(r, skip_special_tokens=True) for r in new]


def main(args: Args) -> None:
    validate(args)
    lm = jmem.load("smollm2-135m")
    hf = None
    if not args.skip_hf:
        import os

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(args.threads)
        path = packaged_model_path("smollm2-135m")
        folder, name = os.path.dirname(path), os.path.basename(path)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tok.padding_side = "left"
        tok.pad_token = tok.pad_token or tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        hf = (model, tok)
    print("| batch | jmem tok/s | HF tok/s | speed-up | greedy text identical |")
    print("| --- | --- | --- | --- | --- |")
    for b in args.batches:
        prompts = (PROMPTS * (b // len(PROMPTS) + 1))[:b]
        runs = [time_jmem(lm, prompts, args.new_tokens) for _ in range(args.repeats)]
        ours, texts = _median([r[0] for r in runs]), runs[0][1]
        if hf is None:
            print(f"| {b} | {ours:.1f} | - | - | - |", flush=True)
            continue
        hruns = [time_hf(*hf, prompts, args.new_tokens) for _ in range(args.repeats)]
        theirs, htexts = _median([r[0] for r in hruns]), hruns[0][1]
        same = sum(a == h for a, h in zip(texts, htexts))
        print(f"| {b} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {same}/{b} |", flush=True)


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 2 for bad input (one `error: ...` line for a bad value; tyro's
    message for a flag it cannot parse)."""
    return run_experiment(Args, main, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(cli())
