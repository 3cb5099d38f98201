"""The `jmem` command: `jmem generate`, `jmem info`, `jmem serve`, `jmem quantize`.

Each subcommand is a typed function; tyro builds the flags from its signature.
Bad input ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import math
import sys
from collections import Counter

import tyro


def generate(prompt: str = "The capital of France is", model: str = "smollm2-135m", max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             chat: bool = False, draft: str | None = None, draft_k: int | None = None,
             stop: tuple[str, ...] = (), lora: str | None = None, init_seed: int = 0) -> None:
    """Print a completion of PROMPT as it is generated.

    Args:
        prompt: Text to continue; `-` reads it from standard input.
        model: The packaged smollm2-135m, a random-init preset (tiny, ...), a .gguf path or a model directory
            (`jmem quantize --out DIR`, `experiments/train.py --save DIR`).
        max_new_tokens: Upper bound on generated tokens.
        temperature: 0 is greedy; higher samples more freely.
        top_k: Keep only the k most likely tokens (off when unset, 0 or -1, as in the server and vLLM).
        top_p: Keep the smallest set of tokens with this much probability (off when unset).
        seed: Sampling seed.
        chat: Wrap the prompt in the model's chat template as a user message.
        draft: A smaller model with the same tokenizer: speculative decoding, DRAFT_K proposals per pass
            of MODEL (same output distribution; acceptance printed on stderr). Temperature only.
        draft_k: Draft proposals per target pass (with --draft; 4 when unset).
        stop: Strings that end the completion: it is printed up to the first one it reaches.
        lora: A LoRA adapter file (.npz, written by `train.py --lora-rank R --save` or
            jmem.lora.save_adapters) or a Hugging Face PEFT LoRA directory, applied to MODEL, the base
            it was trained on.
        init_seed: Seed of a random-init preset's weights (the --seed of the train.py run that trained
            the --lora adapter on it); 0 for any other model.
    """
    import jmem
    from jmem.checks import stop_strings
    from jmem.lm import check_seed, model_source

    top_k = None if top_k in (0, -1) else top_k  # off, as the server and vLLM read them
    _check_sampling(max_new_tokens, temperature, top_k, top_p, draft_k)
    try:
        stops = stop_strings(list(stop))
    except ValueError:
        raise ValueError(f"--stop {list(stop)}; accepted: non-empty strings") from None
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"standard input (--prompt -) holds bytes that are not UTF-8 text (at byte {e.start}); "
                             "accepted: UTF-8 text") from None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes the shell passed that are not UTF-8 (held as surrogates)
        raise ValueError(f"--prompt holds bytes that are not UTF-8 text (at character {e.start}); accepted: "
                         "UTF-8 text") from None
    if draft is not None and (top_k is not None or top_p is not None):
        raise ValueError("--draft samples with --temperature only; accepted: no --top-k / --top-p with --draft")
    if draft is None and draft_k is not None:
        raise ValueError(f"--draft-k={draft_k} without --draft; accepted: --draft-k with a --draft model")
    check_seed(init_seed, model_source(model, "--model")[0], model, "--init-seed")
    if draft is not None:
        from jmem.experiment import check_draft_vocabulary

        check_draft_vocabulary(model, draft, "--draft")
    if lora is not None:
        from jmem.lora import load_adapters, read_adapters

        read_adapters(lora)  # a file that is not an adapter: refused before the model loads
    lm = jmem.load(model, seed=init_seed)
    if lora is not None:
        load_adapters(lm.model, lora, inplace=True)
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  stop=stops or None)

    def show(piece: str) -> None:  # the completion as it is generated
        print(piece, end="", flush=True)

    if draft is not None:
        from jmem.io.tokenizer import check_same_tokens
        from jmem.lm import CompletionWatch
        from jmem.speculative import speculative_generate

        tok = lm.tokenizer
        ids = tok.encode_chat(tok.apply_chat_template([{"role": "user", "content": prompt}])) if chat \
            else tok.encode(prompt)
        draft_lm = jmem.load(draft)
        check_same_tokens(tok, draft_lm.tokenizer, f"--draft {draft!r}")
        k = 4 if draft_k is None else draft_k
        watch = CompletionWatch(tok, stops, on_text=show)  # streams each round's tokens, ends at a stop string
        out, stats = speculative_generate(lm.model, draft_lm.model, [ids], max_new_tokens, k=k,
                                          temperature=temperature, seed=seed, eos_id=tok.eos_id, stop=watch.stop)
        watch.finish(out[0])
        print()
        print(f"speculative: {stats.accepted}/{stats.proposed} proposals accepted "
              f"({stats.acceptance_rate:.0%}), {stats.tokens_per_target_pass:.2f} tokens per target pass",
              file=sys.stderr)
        return

    if chat:
        lm.chat([{"role": "user", "content": prompt}], on_text=show, **kwargs)
    else:
        lm.generate([prompt], on_text=show, **kwargs)
    print()


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                    draft_k: int | None) -> None:
    """generate's numeric flags, before the model loads."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={max_new_tokens}; accepted: an integer >= 0")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature={temperature}; accepted: a finite number >= 0 (0 is greedy)")
    if top_k is not None and not 1 <= top_k < 2**31:
        raise ValueError(f"--top-k={top_k}; accepted: an integer in 1..2**31-1, or unset, 0 or -1 (off)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p={top_p}; accepted: a number in (0, 1], or unset (off)")
    if draft_k is not None and draft_k < 1:
        raise ValueError(f"--draft-k={draft_k}; accepted: an integer >= 1")


def info(path: tyro.conf.Positional[str]) -> None:
    """Print a GGUF file's (or a quantized model directory's) architecture, hyper-parameters,
    tensor types, parameter count and bytes.

    Args:
        path: A .gguf file, a directory written by `jmem quantize --out DIR`, or a packaged model name
            (smollm2-135m: the GGUF file inside its package).
    """
    from jmem.lm import PACKAGED_MODELS, model_source
    from jmem.quant.saved import MANIFEST, describe, is_quantized_dir

    accepted = (f"accepted: a .gguf file, a directory written by `jmem quantize --out DIR`, or a packaged model "
                f"name ({', '.join(PACKAGED_MODELS)})")
    try:  # as `jmem generate --model` resolves it (packaged names, `~`)
        kind, resolved = model_source(path)
    except ValueError:
        raise FileNotFoundError(f"{path!r}: no such file or directory; {accepted}") from None
    if kind == "preset":
        raise ValueError(f"{path!r} is a random-init preset, with no file to describe; {accepted}")
    if kind == "directory":
        if not is_quantized_dir(resolved):
            raise ValueError(f"{path!r} is a directory without {MANIFEST}; {accepted}")
        print(describe(resolved))
        return
    path = resolved
    from jmem.io.gguf import config_from_gguf, read_gguf

    gf = read_gguf(path)
    config = config_from_gguf(gf)
    n_params = sum(int(_numel(t.shape)) for t in gf.tensors.values())
    n_bytes = sum(int(t.data.nbytes) for t in gf.tensors.values())
    types = Counter(t.qtype for t in gf.tensors.values())
    print(f"file:          {gf.path} (GGUF v{gf.version})")
    print(f"architecture:  {gf.architecture}  name: {gf.metadata.get('general.name', '?')}")
    print(f"layers:        {config.shape_line()}")
    rope = f"rope base:     {config.rope_base:g}"
    if config.rope_scaling != "none":
        rope += f"  scaling: {config.rope_scaling} x{config.rope_factor:g}"
    if config.rope_freq_factors is not None:
        rope += f"  per-frequency divisors: {min(config.rope_freq_factors):g}..{max(config.rope_freq_factors):g}"
    if config.rope_dim:
        rope += f"  rotated dims: {config.rope_dim}/{config.head_dim}"
    print(f"{rope}  context: {config.max_seq_len}  tied embeddings: {config.tie_embeddings}")
    print(f"tensor types:  {', '.join(f'{k} x{v}' for k, v in types.most_common())}")
    print(f"parameters:    {n_params:,} ({n_params / 1e6:.1f}M)")
    print(f"tensor bytes:  {n_bytes:,} ({8 * n_bytes / n_params:.2f} bits/parameter)")


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv: list[str] | None = None) -> None:
    """Run one subcommand. A reader of stdout that goes away (`| head`) ends it quietly with status 141,
    as a tool killed by SIGPIPE; Ctrl-C with one line and status 130."""
    try:
        _main(argv)
    except BrokenPipeError:
        from jmem.io.paths import quiet_closed_stdout

        quiet_closed_stdout()
        raise SystemExit(141) from None
    except KeyboardInterrupt:
        print("jmem: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def _main(argv: list[str] | None) -> None:
    from jmem.quant.cli import QuantizeArgs, run_quantize
    from jmem.serve.cli import ServeArgs, run_serve

    commands = {"generate": generate, "info": info, "serve": ServeArgs, "quantize": QuantizeArgs}
    try:
        parsed = tyro.extras.subcommand_cli_from_dict(commands, args=sys.argv[1:] if argv is None else argv,
                                                      prog="jmem")
    except BrokenPipeError:
        raise
    except (ValueError, OSError) as e:  # generate and info run inside tyro's call
        print(f"jmem: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if isinstance(parsed, ServeArgs):
        run_serve(parsed)
    elif isinstance(parsed, QuantizeArgs):
        run_quantize(parsed)
