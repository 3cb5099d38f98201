"""Serving benchmark: continuous batching vs static batching vs Hugging Face one request at a time.

One request trace (prompts cut from `pydoc_data.topics`, varied prompt and
output lengths, all at once or with Poisson arrivals) is replayed through
(a) the jmem engine with continuous batching, (b) the same engine with static
batching (a batch is admitted only when the previous one has finished), and
(c) Hugging Face transformers generating one request at a time (torch CPU).
Reports output tokens/s, time to first token and inter-token latency
percentiles, KV utilization (token slots holding tokens over slots in
allocated blocks, mean over steps) and preemptions. Each engine compiles its
largest step shapes first (`Engine.precompile`, as `jmem serve` does), so a
step of a shape not compiled yet runs padded to one that is while its own
shape compiles in the background. Each engine mode replays the trace untimed
first (up to three times, until a replay compiles nothing: with Poisson
arrivals the batches depend on timing, so a replay can meet a padded shape the
previous one did not), and the XLA compilations that still fall in the timed
run are counted and reported (with the steps that waited for one).

With `--lora-adapters N`, more runs of (a) serve the trace with request i
using adapter i mod N (freshly initialized, rank `--lora-rank`, on every
linear weight), one run per `--max-loras` value: with fewer slots than
adapters, the others wait in host memory and are written into a slot when a
step needs them; the slot writes and their time are reported.

    python experiments/bench_serve.py                       # SmolLM2-135M, 64 requests at once
    python experiments/bench_serve.py --arrival poisson --rate 4
    python experiments/bench_serve.py --model tiny --num-requests 16 --hf-requests 0   # smoke run
    python experiments/bench_serve.py --lora-adapters 8 --max-loras 1 2 4 8 --hf-requests 0
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import jax
import numpy as np

from jmem.models.config import as_dtype
from jmem.serve.draft import load_draft
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.ngram import check_speculative_args
from jmem.serve.request import SamplingParams

MAX_TRACE_S = 3600  # longest Poisson trace (it is replayed in real time, three times or more)


@dataclasses.dataclass(frozen=True)
class Config:
    """Serving benchmark: jmem continuous vs static batching vs HF transformers one request at a time."""

    model: str = "smollm2-135m"
    """Preset or .gguf path."""
    random_weights: bool = False
    """Use the preset's architecture with random weights (no model file needed; speed only)."""
    num_requests: int = 64
    """Requests in the trace."""
    arrival: str = "burst"
    """burst (all at t=0) or poisson."""
    rate: float = 4.0
    """Poisson arrivals per second."""
    prompt_len: tuple[int, int] = (16, 256)
    """Prompt tokens, uniform in [lo, hi]."""
    output_len: tuple[int, int] = (16, 128)
    """Output tokens, uniform in [lo, hi] (EOS ignored, so lengths are exact)."""
    max_num_seqs: int = 32
    """Sequences per engine step (as `jmem serve --max-num-seqs`)."""
    max_num_batched_tokens: int = 256
    """Tokens per engine step (as `jmem serve --max-num-batched-tokens`)."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: auto, bf16, fp8_e4m3 or int8."""
    num_blocks: int | None = None
    """KV pool size in blocks; default: enough for every request at once."""
    compute_dtype: str = "f32"
    """Activation dtype of the jmem runs and of HF's: f32, bf16 or f16."""
    temperature: float = 0.0
    """0 decodes greedily; above 0 every request samples (no top-k/top-p), as OpenAI's default of 1 does."""
    hf_requests: int = 8
    """Requests of the trace run through HF transformers (0 skips); its tokens/s is over these."""
    seed: int = 0
    """Seed of the trace (prompts, lengths, arrivals) and of sampling."""
    num_speculative_tokens: int = 0
    """> 0 adds a run of (a) with speculation proposing this many tokens: n-gram prompt lookup, or the draft
    model of --speculative-model / --speculative-layers."""
    speculative_model: str | None = None
    """Draft model (preset, .gguf path or model directory with the model's vocabulary) for the speculation run."""
    speculative_layers: tuple[int, ...] = ()
    """Draft made of a copy of these layers of the model, for the speculation run."""
    lora_adapters: int = 0
    """> 0 adds runs of (a) where request i uses adapter i mod N of this many LoRA adapters."""
    lora_rank: int = 16
    """Rank of the --lora-adapters (on every linear weight)."""
    max_loras: tuple[int, ...] = ()
    """Device adapter slots, one run each (default: 1 and --lora-adapters)."""


def check(cfg: Config) -> None:
    """One clear `ValueError` for a flag out of range, before the model loads."""
    for flag, value in (("--num-requests", cfg.num_requests), ("--max-num-seqs", cfg.max_num_seqs),
                        ("--max-num-batched-tokens", cfg.max_num_batched_tokens), ("--block-size", cfg.block_size)):
        if value < 1:
            raise ValueError(f"{flag}={value}; accepted: an integer >= 1")
    check_speculative_args(cfg.num_speculative_tokens, flags=True, draft_model=cfg.speculative_model,
                           draft_layers=cfg.speculative_layers)
    try:
        as_dtype(cfg.compute_dtype)
    except ValueError:
        raise ValueError(f"--compute-dtype={cfg.compute_dtype!r}; accepted: f32, bf16, f16") from None
    if cfg.arrival not in ("burst", "poisson"):
        raise ValueError(f"--arrival={cfg.arrival!r}; accepted: burst, poisson")
    if cfg.arrival == "poisson" and not (cfg.rate > 0 and cfg.num_requests / cfg.rate <= MAX_TRACE_S):
        raise ValueError(f"--rate={cfg.rate}; accepted: > 0 arrivals per second, with --num-requests / --rate at "
                         f"most {MAX_TRACE_S} s (the trace is replayed in real time)")
    for flag, (lo, hi) in (("--prompt-len", cfg.prompt_len), ("--output-len", cfg.output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{flag} {lo} {hi}; accepted: LO HI with 1 <= LO <= HI")
    if not 0.0 <= cfg.temperature <= 2.0:
        raise ValueError(f"--temperature={cfg.temperature}; accepted: 0..2")
    if not 0 <= cfg.hf_requests <= cfg.num_requests:
        raise ValueError(f"--hf-requests={cfg.hf_requests}; accepted: 0..{cfg.num_requests} (--num-requests)")
    if cfg.lora_adapters < 0 or cfg.lora_rank < 1:
        raise ValueError(f"--lora-adapters={cfg.lora_adapters} --lora-rank={cfg.lora_rank}; accepted: "
                         "--lora-adapters >= 0 and --lora-rank >= 1")
    if cfg.max_loras and (not cfg.lora_adapters or not 1 <= min(cfg.max_loras) <= max(cfg.max_loras)
                          <= cfg.lora_adapters):
        raise ValueError(f"--max-loras {' '.join(map(str, cfg.max_loras))}; accepted: slot counts in "
                         f"1..--lora-adapters, with --lora-adapters > 0")
    if len(set(cfg.max_loras)) < len(cfg.max_loras):  # the same run twice, under one name in the table
        raise ValueError(f"--max-loras {' '.join(map(str, cfg.max_loras))} repeats a slot count; accepted: "
                         "distinct slot counts")
    if cfg.rate != Config.rate and cfg.arrival != "poisson":  # set away from its default, and unused
        raise ValueError(f"--rate={cfg.rate} needs --arrival poisson (--arrival {cfg.arrival} sends every request "
                         "at once); accepted: --rate with --arrival poisson")
    if cfg.lora_rank != Config.lora_rank and not cfg.lora_adapters:  # set away from its default
        raise ValueError(f"--lora-rank {cfg.lora_rank} needs --lora-adapters N; accepted: --lora-rank with "
                         "--lora-adapters > 0")
    if cfg.num_blocks is not None and cfg.num_blocks < 1:
        raise ValueError(f"--num-blocks={cfg.num_blocks}; accepted: an integer >= 1, or unset (enough for the trace)")
    from jmem.models.config import PRESETS
    from jmem.serve.paged_cache import KV_DTYPES

    if cfg.kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype={cfg.kv_cache_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
    if cfg.random_weights and cfg.model not in PRESETS:
        raise ValueError(f"--random-weights builds a preset; --model {cfg.model!r} is none; accepted: "
                         f"--random-weights with one of {', '.join(PRESETS)}")


def check_model(cfg: Config, mcfg) -> None:
    """The flags that depend on the loaded model: the trace fits its context, HF can run the same model."""
    longest = cfg.prompt_len[1] + cfg.output_len[1]
    if longest > mcfg.max_seq_len:
        raise ValueError(f"--prompt-len {cfg.prompt_len[1]} + --output-len {cfg.output_len[1]} (the longest "
                         f"request) exceeds the context of {cfg.model!r} ({mcfg.max_seq_len} tokens); accepted: "
                         f"HI values summing to at most {mcfg.max_seq_len}")
    if cfg.hf_requests and mcfg.moe_experts:
        raise ValueError(f"--hf-requests {cfg.hf_requests} with the mixture-of-experts model {cfg.model!r}: the HF "
                         "run builds a dense Llama, other work; accepted: --hf-requests 0")


def make_trace(cfg: Config, tokenizer):
    from pydoc_data.topics import topics

    ids = tokenizer.encode(" ".join(topics.values())[:400_000])
    rng = np.random.default_rng(cfg.seed)
    reqs = []
    t = 0.0
    for _ in range(cfg.num_requests):
        n = int(rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
        start = int(rng.integers(0, len(ids) - n))
        out = int(rng.integers(cfg.output_len[0], cfg.output_len[1] + 1))
        if cfg.arrival == "poisson":
            t += float(rng.exponential(1.0 / cfg.rate))
        reqs.append((t, ids[start : start + n], out))
    return reqs


class CompileClock:
    """XLA compilations and their seconds while the benchmark runs (a `jax.monitoring` listener)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax

        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self)

    def __call__(self, event: str, duration: float, **_):
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration


COMPILES = CompileClock()


def time_steps(engine: Engine) -> dict:
    """Time the engine's runner steps, split into steps that prefill (a sequence computes tokens of its
    prompt) and decode-only steps, and the LoRA slot writes before steps: {kind: [count, seconds]}."""
    split = {"prefill": [0, 0.0], "decode": [0, 0.0], "slot writes": [0, 0.0]}
    step, load_adapters = engine.runner.step, engine.runner.load_adapters

    def timed_load(names):
        start, loads = time.monotonic(), engine.runner.adapter_slots.num_loads
        load_adapters(names)
        if engine.runner.adapter_slots.num_loads > loads:
            jax.block_until_ready(engine.runner.state)
            split["slot writes"][0] += engine.runner.adapter_slots.num_loads - loads
            split["slot writes"][1] += time.monotonic() - start

    def timed(out):
        start = time.monotonic()
        res = step(out)
        # A prefill slice computes tokens before its sequence's last (a one-token chunk too); a decode, the last
        # token alone, plus any proposals it verifies.
        prefill = any(s.num_tokens - len(s.draft_token_ids) > 1 or not s.samples for s in out.seqs)
        entry = split["prefill" if prefill else "decode"]
        entry[0] += 1
        entry[1] += time.monotonic() - start
        return res

    engine.runner.step = timed
    engine.runner.load_adapters = timed_load
    return split


def runners(engine: Engine) -> list:
    """The engine's model runners: the model's, and the draft's when it speculates with one."""
    return [engine.runner] + ([engine.drafter.runner] if engine.drafter is not None else [])


def run_engine(engine: Engine, trace, temperature: float = 0.0, adapters: list | None = None) -> dict:
    """Replay `trace` stepping the engine inline; per-token timestamps from the streams. `adapters`: the
    LoRA adapter of each request (None: the base model for all)."""
    split = time_steps(engine)
    compiles0, compile_s0 = COMPILES.count, COMPILES.seconds
    t0 = time.monotonic()
    pending = list(range(len(trace)))
    streams, times, util = {}, {}, []
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        while pending and trace[pending[0]][0] <= now:
            i = pending.pop(0)
            _, prompt, out = trace[i]
            sp = SamplingParams(max_tokens=out, temperature=temperature, seed=i, ignore_eos=True)
            streams[i] = engine.add_request(prompt, sp, adapter=None if adapters is None else adapters[i])
            times[i] = [trace[i][0]]
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, trace[pending[0]][0] - now)))
            continue
        engine.step()
        m = engine.metrics()
        if m["kv_cache_blocks_in_use"]:
            util.append(m["kv_cache_token_utilization"])
        now = time.monotonic() - t0
        for i, s in streams.items():
            while (o := s.get_nowait()) is not None:
                times[i] += [now] * len(o.token_ids)
    elapsed = time.monotonic() - t0
    n_out = sum(len(v) - 1 for v in times.values())
    ttft = [v[1] - v[0] for v in times.values()]
    itl = [b - a for v in times.values() for a, b in zip(v[1:], v[2:])]
    return {"tok_s": n_out / elapsed, "elapsed": elapsed, "tokens": n_out, "ttft": ttft, "itl": itl,
            "kv_util": float(np.mean(util)) if util else 0.0, "preemptions": engine.metrics()["preemptions_total"],
            "compilations": engine.runner.num_compilations, "steps": split,
            "blocking_compilations": sum(r.num_blocking_compilations for r in runners(engine)),
            "compiled_in_run": COMPILES.count - compiles0, "compile_s": COMPILES.seconds - compile_s0,
            "spec_accepted": engine.stats["spec_accepted_tokens"], "spec_proposed": engine.stats["spec_draft_tokens"]}


def run_hf(cfg: Config, trace, model_path: str | None, mcfg):
    """One request at a time with transformers on torch CPU; None (with a message) when unavailable."""
    try:
        import torch
        import transformers
    except ImportError:
        print("(c) skipped: torch and transformers are not installed (pip install 'jmem[bench]')")
        return None
    torch.manual_seed(0)
    if model_path and not cfg.random_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(model_path)),
                                                                  gguf_file=os.path.basename(model_path))
    else:  # a preset or a quantized directory: the same architecture, random float weights (the same work)
        hf_cfg = transformers.LlamaConfig(vocab_size=mcfg.vocab_size, hidden_size=mcfg.dim,
                                          intermediate_size=mcfg.ffn_dim, num_hidden_layers=mcfg.n_layers,
                                          num_attention_heads=mcfg.n_heads, num_key_value_heads=mcfg.n_kv_heads,
                                          head_dim=mcfg.head_dim, rope_theta=mcfg.rope_base,
                                          tie_word_embeddings=mcfg.tie_embeddings)
        model = transformers.LlamaForCausalLM(hf_cfg)
    model.eval()
    model = model.to(getattr(torch, np.dtype(as_dtype(cfg.compute_dtype)).name))  # the jmem runs' dtype
    sub = trace[: cfg.hf_requests]
    sample = dict(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0) if cfg.temperature else \
        dict(do_sample=False)
    times = []
    t0 = time.monotonic()
    with torch.no_grad():
        for _, prompt, out in sub:
            start = time.monotonic()
            ids = torch.tensor([prompt])
            model.generate(ids, max_new_tokens=out, min_new_tokens=out, **sample)
            times.append(time.monotonic() - start)
    elapsed = time.monotonic() - t0
    n_out = sum(out for _, _, out in sub)
    return {"tok_s": n_out / elapsed, "elapsed": elapsed, "tokens": n_out, "ttft": [], "itl": [],
            "kv_util": float("nan"), "preemptions": 0, "compilations": 0, "steps": None}


def write_adapters(model, n: int, rank: int, folder: str) -> dict[str, str]:
    """`n` freshly initialized adapters of `rank` on every linear weight of `model`, saved in `folder`
    ({name: path}); their B starts at zero as in training, which costs the same compute as trained ones."""
    from jmem.lora import apply_lora, save_adapters
    from jmem.models.config import LINEARS

    targets = [t for t in LINEARS if hasattr(model.layers, t)]
    modules = {}
    for i in range(n):
        modules[f"lora{i}"] = os.path.join(folder, f"lora{i}.npz")
        save_adapters(apply_lora(model, rank, targets=targets, seed=i), modules[f"lora{i}"])
    return modules


def pct(xs, q):
    return 1000 * float(np.percentile(xs, q)) if xs else float("nan")


def main(cfg: Config) -> None:
    import jmem
    from flax import nnx

    check(cfg)

    from jmem.lm import model_source
    from jmem.models import Llama, get_config

    kind, path = model_source(cfg.model, "--model")
    model_path = path if kind == "gguf" and not cfg.random_weights else None  # HF reads the same file
    if cfg.random_weights:
        from jmem.io.tokenizer import ByteTokenizer

        mcfg = get_config(cfg.model, compute_dtype=cfg.compute_dtype, param_dtype=cfg.compute_dtype)
        model, tok = Llama(mcfg, rngs=nnx.Rngs(0)), ByteTokenizer()
    else:
        lm = jmem.load(cfg.model, compute_dtype=cfg.compute_dtype)
        model, tok, mcfg = lm.model, lm.tokenizer, lm.config
    check_model(cfg, mcfg)
    trace = make_trace(cfg, tok)
    longest = max(len(p) + o for _, p, o in trace)
    blocks = cfg.num_blocks or sum(-(-(len(p) + o) // cfg.block_size) for _, p, o in trace)
    rows = {}
    runs = [("(a) jmem continuous batching", False, 0, None), ("(b) jmem static batching", True, 0, None)]
    draft = load_draft(model, cfg.speculative_model, cfg.speculative_layers, compute_dtype=cfg.compute_dtype)
    if cfg.num_speculative_tokens:
        how = ("n-gram" if draft is None else f"{draft.config.n_layers}-layer draft"
               + (f" {cfg.speculative_model}" if cfg.speculative_model else " (the model's layers)"))
        runs.append((f"(a) + {how} speculation, k={cfg.num_speculative_tokens}", False, cfg.num_speculative_tokens,
                     None))
    N = cfg.lora_adapters
    for slots in (cfg.max_loras or sorted({1, N})) if N else ():
        runs.append((f"(a) + {N} LoRA adapters (rank {cfg.lora_rank}) in {slots} slot{'s' * (slots > 1)}", False, 0,
                     slots))
    adapter_dir = tempfile.TemporaryDirectory(prefix="bench_serve_lora_") if N else None
    modules = write_adapters(model, N, cfg.lora_rank, adapter_dir.name) if N else None
    adapters = [f"lora{i % N}" for i in range(len(trace))] if N else None
    for name, static, k, slots in runs:
        ecfg = EngineConfig(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=longest,
                            kv_cache_dtype=cfg.kv_cache_dtype, num_blocks=blocks, static_batching=static,
                            enable_prefix_caching=False, num_speculative_tokens=k, max_loras=slots,
                            max_lora_rank=cfg.lora_rank)
        def fresh_engine():
            engine = Engine(model, tok, ecfg, draft_model=draft if k else None,
                            lora_modules=modules if slots else None)
            engine.precompile()
            return engine

        for _ in range(3):  # warm-up: compiles the shapes the timed run uses
            engine = fresh_engine()  # its precompiled shapes are not the replay's
            compiles0 = COMPILES.count
            run_engine(engine, trace, cfg.temperature, adapters if slots else None)
            for runner in runners(engine):
                runner.finish_compilations()
            if COMPILES.count == compiles0:
                break
        rows[name] = run_engine(fresh_engine(), trace, cfg.temperature, adapters if slots else None)
        print(name, {k: v for k, v in rows[name].items() if k not in ("ttft", "itl", "steps")}, flush=True)
    if cfg.hf_requests:
        hf = run_hf(cfg, trace, model_path, mcfg)
        if hf is not None:
            rows[f"(c) HF transformers, one at a time ({cfg.hf_requests} req)"] = hf
    print(f"\nmodel {cfg.model}{' (random weights)' if cfg.random_weights else ''}, {cfg.num_requests} requests, "
          f"{cfg.arrival} arrivals, prompts {cfg.prompt_len}, outputs {cfg.output_len}, "
          f"max_num_seqs {cfg.max_num_seqs}, {blocks} KV blocks x {cfg.block_size}, kv {cfg.kv_cache_dtype}, "
          f"temperature {cfg.temperature}; "
          f"{sum(len(p) for _, p, _ in trace)} prompt and {sum(o for _, _, o in trace)} output tokens\n")
    print("| run | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | KV util | preemptions |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        ttft = f"{pct(r['ttft'], 50):.0f} / {pct(r['ttft'], 99):.0f}" if r["ttft"] else "-"
        itl = f"{pct(r['itl'], 50):.1f} / {pct(r['itl'], 99):.1f}" if r["itl"] else "-"
        util = "-" if np.isnan(r["kv_util"]) else f"{r['kv_util']:.1%}"
        print(f"| {name} | {r['tok_s']:.1f} | {ttft} | {itl} | {util} | {r['preemptions']:.0f} |")
    print("\n| run | prefill steps: count / s | decode-only steps: count / s | LoRA slot writes: count / s | "
          "compilations in the timed run: count / s (steps that waited) |\n|---|---|---|---|---|")
    for name, r in rows.items():
        if r["steps"]:
            (np_, tp), (nd, td), (nw, tw) = (r["steps"][k] for k in ("prefill", "decode", "slot writes"))
            print(f"| {name} | {np_} / {tp:.1f} | {nd} / {td:.1f} | {nw} / {tw:.2f} | {r['compiled_in_run']} / "
                  f"{r['compile_s']:.1f} ({r['blocking_compilations']}) |")
    for name, r in rows.items():
        if r.get("spec_proposed"):
            print(f"\n{name}: {r['spec_accepted']} of {r['spec_proposed']} proposed tokens accepted; "
                  f"{r['tok_s'] / rows['(a) jmem continuous batching']['tok_s']:.2f}x the output tokens/s of (a)")
    a = rows["(a) jmem continuous batching"]["tok_s"]
    print(f"\ncontinuous / static: {a / rows['(b) jmem static batching']['tok_s']:.2f}x")
    for name, r in rows.items():
        if name.startswith("(c)"):
            print(f"continuous / HF one-at-a-time: {a / r['tok_s']:.2f}x")


if __name__ == "__main__":
    from jmem.experiment import run_experiment

    sys.exit(run_experiment(Config, main, description=__doc__))  # a refused flag: one line, no traceback
