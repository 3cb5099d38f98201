"""Tokenizers: the GGUF BPE round trip and specials, the byte tokenizer, chat templates."""

import re

from jmem.io.tokenizer import ByteTokenizer
from tests.helpers import smollm2


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🙂"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.encode("a", add_bos=True) == [tok.bos_id, 97]
    assert "<|assistant|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_tokenizer_round_trip_and_specials():
    tok = smollm2().tokenizer
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]  # round trips pass wrong merges too
    for text in ["Hello world", "  two  spaces\n\nand 12345 digits", "naïve café 東京 🙂", "def f(x):\n\treturn x"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12") == [tok.encode("1")[0], tok.encode("2")[0]]  # digits split one by one
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == 1 and tok.tokens[1] == "<|im_start|>"
    assert tok.decode(ids) == "user"  # specials are skipped when decoding
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user"


def test_chat_template():
    tok = smollm2().tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


# --- GGUF tokenizers built from small synthetic metadata (no model file) ---

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jmem.io.gguf_writer import byte_tokenizer_metadata  # noqa: E402
from jmem.io.tokenizer import GGUFTokenizer, TokenizerError, check_same_tokens  # noqa: E402


def _with_tokens(extra: list[str], types: list[int], **fields):
    """byte_tokenizer_metadata() with `extra` tokens after the 256 bytes (BOS/EOS/PAD move up)."""
    meta = byte_tokenizer_metadata()
    toks = meta["tokenizer.ggml.tokens"]
    n = 256 + len(extra)
    meta.update({"tokenizer.ggml.tokens": toks[:256] + extra + toks[256:],
                 "tokenizer.ggml.token_type": [1] * 256 + types + [3, 3, 3],
                 "tokenizer.ggml.bos_token_id": n, "tokenizer.ggml.eos_token_id": n + 1,
                 "tokenizer.ggml.padding_token_id": n + 2, **fields})
    return meta


@pytest.mark.parametrize("pre, whole", [("llama-bpe", True), ("llama3", True), ("gpt2", False), ("default", False)])
def test_llama3_pre_tokenizers_look_whole_words_up_first(pre, whole):
    """llama.cpp and HF's Llama-3 tokenizer.json ignore merges for a pre-token that is a vocabulary entry:
    'hello' is one id although the merges only reach 'hel' + 'lo'."""
    meta = _with_tokens(["he", "hel", "lo", "hello"], [1] * 4, **{"tokenizer.ggml.merges": ["h e", "he l", "l o"],
                                                                  "tokenizer.ggml.pre": pre})
    tok = GGUFTokenizer(meta)
    ids = tok.encode("hello")
    assert [tok.tokens[i] for i in ids] == (["hello"] if whole else ["hel", "lo"])
    assert tok.decode(ids) == "hello"


def test_user_defined_tokens_stay_in_decoded_text():
    """GGUF token type 4 (user-defined, e.g. <think>) matches as a whole token and is rendered by decode;
    control tokens (type 3) are hidden unless skip_special=False."""
    tok = GGUFTokenizer(_with_tokens(["<think>", "</think>"], [4, 4]))
    ids = tok.encode("<think>ok</think>")
    assert ids[0] == 256 and ids[-1] == 257 and len(ids) == 4
    assert tok.decode(ids) == "<think>ok</think>"
    with_control = [tok.bos_id, *ids, tok.eos_id]
    assert tok.decode(with_control) == "<think>ok</think>"
    assert tok.decode(with_control, skip_special=False) == "<|bos|><think>ok</think><|eos|>"
    # Ids past the vocabulary (a model's padded embedding rows) decode to nothing, 2**32 too (an
    # OverflowError in the tokenizers library); a negative or non-integer id is refused (1.5 was id 1).
    assert tok.decode([*ids, tok.vocab_size + 5, 2**32]) == "<think>ok</think>"
    assert tok.decode(np.asarray(ids)) == tok.decode(jnp.asarray(ids)) == "<think>ok</think>"
    for t in (tok, ByteTokenizer()):
        for bad in (-1, 1.5, "97"):
            with pytest.raises(ValueError, match=rf"^decode: token id {bad!r}; accepted: integer ids >= 0$"):
                t.decode([97, bad])


ALTERNATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
             "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}")


def test_chat_template_raise_exception_is_a_value_error():
    tok = GGUFTokenizer({**byte_tokenizer_metadata(), "tokenizer.chat_template": ALTERNATE})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>hi"
    with pytest.raises(TokenizerError, match="roles must alternate user/assistant"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    broken = GGUFTokenizer({**byte_tokenizer_metadata(), "tokenizer.chat_template": "{{ messages[0].content | nofilter }}"})
    with pytest.raises(ValueError, match="chat template failed"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])
    # Not a TypeError from inside the template, nor the text "None" rendered into the prompt.
    for bad in ([{"role": "user", "content": None}], [{"role": "user", "content": 3}], [{"role": 1, "content": "hi"}],
                [{"role": "user"}], ["hi"]):
        for t in (tok, ByteTokenizer()):
            with pytest.raises(ValueError, match=r"chat message .*; accepted: a dict with a string 'role' and a string"):
                t.apply_chat_template(bad)
    for bad in ("hi", []):  # an empty chat rendered a bare generation prompt
        with pytest.raises(ValueError, match=re.escape(f"chat messages {bad!r}; accepted: a non-empty list of")):
            tok.apply_chat_template(bad)


BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_encode_chat_adds_no_second_bos():
    meta = _with_tokens([], [], **{"tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": BOS_TEMPLATE})
    tok = GGUFTokenizer(meta)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode_chat(text)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.encode_chat("plain") == tok.encode("plain") == [tok.bos_id, *tok.encode("plain", add_bos=False)]
    # a template without BOS keeps add_bos_token's BOS
    no_bos = GGUFTokenizer({**meta, "tokenizer.chat_template": BOS_TEMPLATE.replace("{{ bos_token }}", "")})
    assert no_bos.encode_chat(no_bos.apply_chat_template([{"role": "user", "content": "hi"}]))[:2] == \
        [no_bos.bos_id, ord("<")]
    assert ByteTokenizer().encode_chat("<|user|>") == ByteTokenizer().encode("<|user|>")


def test_missing_vocabulary_is_one_error():
    meta = byte_tokenizer_metadata()
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(TokenizerError, match="required key tokenizer.ggml.tokens is missing"):
        GGUFTokenizer(meta)
    for merges, bad in ((["h e", "he"], "[1]='he'"), ([3], "[0]=3")):  # was a TypeError inside `tokenizers`
        with pytest.raises(TokenizerError, match=re.escape(f"tokenizer.ggml.merges{bad}; accepted: two tokens joined "
                                                           "by one space")):
            GGUFTokenizer(_with_tokens(["he"], [1], **{"tokenizer.ggml.merges": merges}))
    meta = byte_tokenizer_metadata()
    n = len(meta["tokenizer.ggml.tokens"])
    for change, message in (  # were a bare Exception, a silently shortened type list, an id past the vocabulary
            ({"tokenizer.ggml.merges": ["zz q"]}, "tokenizer.ggml.merges do not fit tokenizer.ggml.tokens"),
            ({"tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"][:-1]},
             f"tokenizer.ggml.token_type holds {n - 1} entries for {n} tokens"),
            ({"tokenizer.ggml.bos_token_id": n}, f"tokenizer.ggml.bos_token_id={n}; accepted: a token id in "
                                                 f"0..{n - 1}")):
        with pytest.raises(TokenizerError, match=re.escape(message)):
            GGUFTokenizer({**meta, **change})


@pytest.mark.parametrize("text", ["a<|eos|>b", "<|bos|>", "<|pad|> héllo", "👍🏽\r\n\x00", ""])
def test_byte_tokenizer_metadata_tokenizes_as_byte_tokenizer(text):
    """The GGUF tokenizer of `byte_tokenizer_metadata()` (the random-init presets written with write_gguf)
    gives ByteTokenizer's ids: "<|eos|>" in user text stays bytes, and decode drops BOS/EOS/PAD."""
    tok, byte = GGUFTokenizer(byte_tokenizer_metadata()), ByteTokenizer()
    assert tok.encode(text) == byte.encode(text)
    assert tok.encode(text, add_bos=True) == byte.encode(text, add_bos=True)
    ids = [byte.bos_id, *byte.encode(text), byte.eos_id, byte.pad_id]
    for skip in (True, False):
        assert tok.decode(ids, skip_special=skip) == byte.decode(ids, skip_special=skip) == text
    # A template's {{ bos_token }} renders as nothing, as with ByteTokenizer; add_bos_token adds the id.
    tok = GGUFTokenizer({**byte_tokenizer_metadata(), "tokenizer.ggml.add_bos_token": True,
                         "tokenizer.chat_template": BOS_TEMPLATE})
    rendered = tok.apply_chat_template([{"role": "user", "content": text}])
    assert rendered == f"<|user|>{text}<|assistant|>"
    assert tok.encode_chat(rendered) == [byte.bos_id, *byte.encode(rendered)]


def test_a_draft_with_other_tokens_is_refused_naming_the_first_difference():
    """Same vocabulary size, another vocabulary: the draft's proposals would be other tokens' ids."""
    meta = byte_tokenizer_metadata()
    tok = GGUFTokenizer(meta)
    check_same_tokens(tok, GGUFTokenizer(meta))
    check_same_tokens(tok, ByteTokenizer())  # no token list: the vocabulary size is compared elsewhere
    swapped = list(meta["tokenizer.ggml.tokens"])
    swapped[97], swapped[98] = swapped[98], swapped[97]
    with pytest.raises(ValueError, match=r"^--draft 'd.gguf''s token 97 is 'b', the model's 'a'; accepted: a draft "
                                         r"with the model's tokenizer$"):
        check_same_tokens(tok, GGUFTokenizer({**meta, "tokenizer.ggml.tokens": swapped}), "--draft 'd.gguf'")
    longer = GGUFTokenizer({**meta, "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], "x"],
                            "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], 1]})
    with pytest.raises(ValueError, match="vocabulary has 260 tokens, the model's 259"):
        check_same_tokens(tok, longer)


@pytest.mark.parametrize("template, expected", [
    # HF's tojson keeps non-ASCII and HTML characters (Jinja's own escapes them: "\u65e5", "\u003cb\u003e").
    ("{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}", '"日本 <b>&\'x\'"'),
    ("{% for m in messages %}{{ m['content'] | tojson(ensure_ascii=True) }}{% endfor %}",
     '"\\u65e5\\u672c <b>&\'x\'"'),
    ("{% for m in messages %}{{ m['role'] }}{% break %}{% endfor %}", "user"),  # loop controls
    ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}", "日本 <b>&'x'"),
    ("{{ strftime_now('%Y') | length }}", "4"),
])
def test_chat_templates_have_the_helpers_hf_gives_them(template, expected):
    """Templates other models ship (Llama 3, Qwen) use these; each rendered as transformers renders it."""
    tok = GGUFTokenizer({**byte_tokenizer_metadata(), "tokenizer.chat_template": template})
    assert tok.apply_chat_template([{"role": "user", "content": "日本 <b>&'x'"}]) == expected


def test_encode_refuses_what_is_not_text_alike_in_both_tokenizers():
    """`ByteTokenizer().encode(None)` and `.encode(b"hi")` were AttributeErrors; the GGUF tokenizer's a
    TypeError from the tokenizers library ("TextInputSequence must be str")."""
    for tok in (ByteTokenizer(), GGUFTokenizer(byte_tokenizer_metadata())):
        for text, shown in ((None, "=None"), (b"hi", "=b'hi'"), (3, " is a int"), (["a"], " is a list")):
            with pytest.raises(ValueError, match=rf"^encode: text{re.escape(shown)}; accepted: a str \(bytes: "):
                tok.encode(text)
        with pytest.raises(ValueError, match=r"^add_bos='yes'; accepted: True or False$"):
            tok.encode("a", add_bos="yes")
        assert tok.encode("hi", add_bos=None) == [104, 105]
