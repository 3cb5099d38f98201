"""Tokenizers: GGUF byte-level BPE rebuilt with HF `tokenizers`, and a byte tokenizer for small models.

Both expose `encode(text) -> list[int]`, `encode_chat(rendered_chat) -> list[int]`,
`decode(ids) -> str`, `vocab_size`, `eos_id`, `bos_id` and `apply_chat_template(messages)`.
"""

from __future__ import annotations

import datetime
import functools
import json
import operator
from typing import Any

import jinja2.ext
import jinja2.sandbox

from jmem.checks import check_bool, is_int

# llama.cpp pre-tokenizer names -> the regex split used before byte-level BPE.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama3", "llama-bpe")
IGNORE_MERGES = ("llama3", "llama-bpe")
_CONTROL = 3  # GGUF token type of control (special) tokens
_USER_DEFINED = 4
_UNUSED = 5  # not matched in text as a whole; decode drops it (llama.cpp renders it as nothing)


class TokenizerError(ValueError):
    """A tokenizer that cannot be built from the given metadata."""


def _raise_exception(message):
    """The `raise_exception(msg)` helper chat templates call on conversations they refuse (as HF provides)."""
    raise TokenizerError(f"chat template: {message}")


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """Templates' `tojson` as HF's: characters kept as they are (Jinja's own escapes non-ASCII and HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF marks assistant tokens with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=8)
def _chat_template(template: str) -> jinja2.Template:
    """The compiled template, in a sandbox with the helpers HF's chat templates use: `raise_exception`,
    `strftime_now`, `tojson`, loop controls (`break`, `continue`) and the `generation` block."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def _render_chat(template: str, messages: list[dict[str, str]], add_generation_prompt: bool, **extra) -> str:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"chat messages {messages!r}; accepted: a non-empty list of {{'role': str, 'content': str}} "
                         "dicts")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"chat message {m!r}; accepted: a dict with a string 'role' and a string 'content'")
    try:
        return _chat_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               **extra)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from None


def _check_encode(text, add_bos) -> None:
    """One ValueError for what `encode` cannot take: text that is not a str (bytes included), an add_bos
    that is not None, True or False."""
    if not isinstance(text, str):
        shown = f"={text!r:.60}" if text is None or isinstance(text, bytes) else f" is a {type(text).__name__}"
        raise ValueError(f"encode: text{shown}; accepted: a str (bytes: decode them first, e.g. "
                         "data.decode('utf-8'))")
    if add_bos is not None:
        check_bool("add_bos", add_bos)


def _non_negative(ids) -> list[int]:
    """`ids` as Python ints: one ValueError for a negative or non-integer id (a float was truncated)."""
    out = []
    for i in ids:
        try:
            out.append(operator.index(i))  # int, NumPy or JAX integer scalars
        except TypeError:
            raise ValueError(f"decode: token id {i!r}; accepted: integer ids >= 0") from None
    if out and min(out) < 0:
        raise ValueError(f"decode: token id {min(out)}; accepted: integer ids >= 0")
    return out


def _encode_chat(tok, text: str) -> list[int]:
    # A template that writes `{{ bos_token }}` itself already starts the text with BOS; adding
    # another would feed the model two (HF encodes rendered chats without special tokens).
    bos = tok.bos_text()
    return tok.encode(text, add_bos=False if bos and text.startswith(bos) else None)


def check_same_tokens(tok, draft_tok, what: str = "the draft model") -> None:
    """ValueError naming the first token where `draft_tok` (of `what`) and `tok` differ: a draft
    that maps ids to other text proposes tokens its target rejects (the output stays the target's,
    the speed-up is lost). A tokenizer without a token list (`ByteTokenizer`) is not compared here
    (the vocabulary sizes are, by the speculative decoders)."""
    a, b = getattr(tok, "tokens", None), getattr(draft_tok, "tokens", None)
    if a is None or b is None:
        return
    if len(a) != len(b):
        raise ValueError(f"{what}'s vocabulary has {len(b)} tokens, the model's {len(a)}; accepted: a draft with "
                         "the model's tokenizer")
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is not None:
        raise ValueError(f"{what}'s token {i} is {b[i]!r}, the model's {a[i]!r}; accepted: a draft with the model's "
                         "tokenizer")


class GGUFTokenizer:
    """A byte-level BPE tokenizer from GGUF `tokenizer.*` metadata.

    Example:
        >>> tok = GGUFTokenizer(gguf_file.tokenizer_metadata())
        >>> tok.decode(tok.encode("Hello world"))
        'Hello world'
    """

    def __init__(self, metadata: dict[str, Any]):
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"tokenizer.ggml.model={kind!r} is not supported; accepted: 'gpt2' (byte-level BPE)")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"tokenizer.ggml.pre={pre!r} is not supported; accepted: {', '.join(PRE_TOKENIZERS)}")
        if not metadata.get("tokenizer.ggml.tokens"):
            raise TokenizerError("required key tokenizer.ggml.tokens is missing (the file has no vocabulary)")
        self.metadata = {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}  # to save it again
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        types: list[int] = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else ()
                  for m in metadata.get("tokenizer.ggml.merges", [])]
        bad = next((i for i, m in enumerate(merges) if len(m) != 2), None)
        if bad is not None:
            raise TokenizerError(f"tokenizer.ggml.merges[{bad}]={metadata['tokenizer.ggml.merges'][bad]!r}; accepted: "
                                 "two tokens joined by one space, e.g. 'Ġ t'")
        if len(types) != len(tokens):  # zip would pair the first ones and drop the rest's types
            raise TokenizerError(f"tokenizer.ggml.token_type holds {len(types)} entries for {len(tokens)} tokens; "
                                 "accepted: one type per token")
        for key in ("bos", "eos"):
            i = metadata.get(f"tokenizer.ggml.{key}_token_id")
            if i is not None and not (is_int(i) and 0 <= i < len(tokens)):
                raise TokenizerError(f"tokenizer.ggml.{key}_token_id={i!r}; accepted: a token id in "
                                     f"0..{len(tokens) - 1}")
        vocab = {t: i for i, t in enumerate(tokens)}
        # llama.cpp (and HF's Llama-3 tokenizer.json) look a whole pre-token up in the vocabulary
        # before merging for the llama3 pre-tokenizers.
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                             ignore_merges=pre in IGNORE_MERGES)
        except Exception as e:  # the library raises a bare Exception, e.g. for a merge of an unknown token
            raise TokenizerError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e}); accepted: merges "
                                 "of tokens in the vocabulary") from None
        tok = Tokenizer(bpe)
        split = _LLAMA3_SPLIT if pre.startswith("llama") else _GPT2_SPLIT
        steps = [pre_tokenizers.Digits(individual_digits=True)] if pre == "smollm" else []
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        # Both types match as whole tokens; control tokens are hidden by decode(skip_special=True),
        # user-defined ones (`<think>` ...) are text and always rendered, as llama.cpp does.
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        self._tok = tok
        self.vocab_size = len(tokens)
        self.tokens = tokens
        self.bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template = metadata.get("tokenizer.chat_template")
        self.special_ids = {i for i, ty in enumerate(types) if ty == _CONTROL}
        self._unused = {i for i, ty in enumerate(types) if ty == _UNUSED}

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        _check_encode(text, add_bos)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_chat(self, text: str) -> list[int]:
        """`encode` for text rendered by `apply_chat_template`: no BOS added when it already starts with one."""
        return _encode_chat(self, text)

    def _text(self, token_id: int | None) -> str:
        """A special token's text for chat templates; "" for one no text encodes to (unused type, as
        `ByteTokenizer`'s), so the BOS is added as an id instead."""
        return self.tokens[token_id] if token_id is not None and token_id not in self._unused else ""

    def bos_text(self) -> str:
        return self._text(self.bos_id)

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of `ids`; ids past the vocabulary (a model's padded rows) decode to nothing."""
        n = len(self.tokens)
        return self._tok.decode([i for i in _non_negative(ids) if i < n and i not in self._unused],
                                skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("this model file has no chat template (tokenizer.chat_template)")
        return _render_chat(self.chat_template, messages, add_generation_prompt, bos_token=self.bos_text(),
                            eos_token=self._text(self.eos_id))


class IncrementalDecoder:
    """`tokenizer.decode(ids)` of a growing list of ids, decoding only the ids after the last settled
    point (a tail of at most SETTLE_AFTER ids ending on a whole character), not the whole list again:
    with a byte-level vocabulary (this module's tokenizers) the text of a sequence is the text of its
    pieces joined when the earlier piece ends on a character boundary. A list shorter than the settled
    point starts over. `skip_special=False` is passed on only when asked (a tokenizer whose `decode`
    takes the ids alone serves the default)."""

    SETTLE_AFTER = 16

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok, self.skip_special = tokenizer, skip_special
        self._ids, self._text = 0, ""  # decode(ids[:_ids]), whole characters

    def __call__(self, ids) -> str:
        if len(ids) < self._ids:
            self._ids, self._text = 0, ""
        tail = self.tok.decode(ids[self._ids:], **({} if self.skip_special else {"skip_special": False}))
        text = self._text + tail
        if len(ids) - self._ids >= self.SETTLE_AFTER and not tail.endswith("\ufffd"):
            self._ids, self._text = len(ids), text
        return text


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus three specials: 256 BOS, 257 EOS, 258 PAD (vocab 259).

    The random-init presets (`tiny`, `small`) use it: no vocabulary file is needed and
    every text round-trips exactly.
    """

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258
    add_bos = False
    special_ids = {256, 257, 258}
    chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        _check_encode(text, add_bos)
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def encode_chat(self, text: str) -> list[int]:
        """`encode` for text rendered by `apply_chat_template` (the byte template adds no BOS)."""
        return _encode_chat(self, text)

    def bos_text(self) -> str:
        return ""  # BOS is id 256, which no text encodes to

    def decode(self, ids, skip_special: bool = True) -> str:
        return bytes(i for i in _non_negative(ids) if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return _render_chat(self.chat_template, messages, add_generation_prompt)
