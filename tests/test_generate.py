"""Generation: sampling reproducible by seed, EOS and stop strings, argument errors."""

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem.generate import SamplingParams, generate_ids
from jmem.sampling import make_arrays, sample


@pytest.fixture(scope="module")
def lm():
    return jmem.load("tiny")


def test_sampling_reproducible_by_seed(lm):
    kw = dict(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.9)
    a = lm.generate(["hello", "x"], seed=3, **kw)
    b = lm.generate(["hello", "x"], seed=3, **kw)
    c = lm.generate(["hello", "x"], seed=4, **kw)
    assert a == b and a != c
    assert lm.generate(["hello", "x"], seed=3 + 2**32, **kw) != a  # the whole seed counts, not its low 32 bits


def test_greedy_batch_equals_single(lm):
    prompts = ["short", "a much longer prompt here"]
    batch = generate_ids(lm.model, [lm.tokenizer.encode(p) for p in prompts], 20)
    for p, row in zip(prompts, batch):
        assert generate_ids(lm.model, [lm.tokenizer.encode(p)], 20)[0] == row
    ids = [lm.tokenizer.encode(p) for p in prompts]  # JAX arrays of ids, as a JAX program holds them
    assert generate_ids(lm.model, [jnp.asarray(i) for i in ids], 20) == batch
    assert generate_ids(lm.model, jnp.asarray([ids[0]]), 20) == batch[:1]


def test_every_submodule_is_reachable_from_import_jmem():
    import importlib
    import subprocess
    import sys

    for name in jmem.SUBMODULES:
        assert getattr(jmem, name) is importlib.import_module(f"jmem.{name}")
    code = "import jmem; print(jmem.optim.adafactor.__module__, jmem.prune.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["jmem.optim.adafactor", "jmem.prune"]
    with pytest.raises(AttributeError, match="module 'jmem' has no attribute 'optimm'"):
        jmem.optimm


def test_eos_and_stop_strings(lm):
    ids = lm.tokenizer.encode("abc")
    free = generate_ids(lm.model, [ids], 20)[0]
    eos = free[5]
    cut = generate_ids(lm.model, [ids], 20, eos_id=eos)[0]
    assert cut == free[: free.index(eos)]
    text = lm.generate(["abc"], max_new_tokens=20)[0]
    stop = text[4:6]
    stopped = lm.generate(["abc"], max_new_tokens=20, stop=[stop])[0]
    assert stopped == text[: text.find(stop)]
    assert lm.generate(["abc"], max_new_tokens=20, stop=stop)[0] == stopped  # one string: one stop string
    # Not its characters: the text starts with this string's first character but never holds the string.
    assert lm.generate(["abc"], max_new_tokens=20, stop=text[0] + " is not in the text")[0] == text
    assert lm.chat([{"role": "user", "content": "hi"}], max_new_tokens=4, stop=text[0] + " nowhere") == \
        lm.chat([{"role": "user", "content": "hi"}], max_new_tokens=4)
    for bad in ([3], 3, ["a", None], "", ["a", ""]):  # an empty stop string would end every output at once
        with pytest.raises(ValueError, match=re.escape(f"stop={bad!r}; accepted: a non-empty string or a list of them")):
            lm.generate(["abc"], max_new_tokens=2, stop=bad)


def test_streamed_pieces_join_to_the_completion(lm):
    """on_text: pieces as each decode chunk lands, never text past a stop string or an unfinished
    character that a later token would change; one prompt only."""
    text = lm.generate(["abc"], max_new_tokens=40)[0]
    for kw in (dict(), dict(stop=[text[20:23]]), dict(stop=[text[15:17], "never there"]),
               dict(temperature=0.9, seed=1)):
        pieces = []
        out = lm.generate(["abc"], max_new_tokens=40, on_text=pieces.append, **kw)[0]
        assert "".join(pieces) == out, (pieces, out)
        assert len(pieces) >= (1 if "stop" in kw else 5)  # 40 tokens: ten calls of STREAM_CHUNK = 4
    plain, held = [], []
    lm.generate(["abc"], max_new_tokens=40, on_text=plain.append)
    # The first chunk's text ends with the first character of a stop string: held back until the next chunk.
    lm.generate(["abc"], max_new_tokens=40, on_text=held.append, stop=[plain[0][-1] + " never there"])
    assert held[0] == plain[0][:-1] and "".join(held) == "".join(plain)
    pieces = []
    assert lm.chat([{"role": "user", "content": "hi"}], max_new_tokens=20, on_text=pieces.append) == "".join(pieces)
    for bad in (dict(prompts=["a", "b"], on_text=print), dict(prompts=["a"], on_text="print")):
        with pytest.raises(ValueError, match="on_text streams one completion; accepted: a callable with one prompt"):
            lm.generate(max_new_tokens=2, **bad)


class _ThreeCharTokens:
    """Each token decodes to three characters, so a stop string can start inside a token."""

    def __init__(self, tok):
        self.eos_id = tok.eos_id

    def decode(self, ids):
        return "".join(f"{i:03d}" for i in ids)


def test_stop_string_starting_inside_a_token(lm):
    multi = copy.copy(lm)
    multi.tokenizer = _ThreeCharTokens(lm.tokenizer)
    prompt = [lm.tokenizer.encode("abc")]
    text = multi._complete(prompt, max_new_tokens=12)[0]
    for stop in (text[4:8], text[7:9], text[:2]):  # from the middle of a token into the next ones
        assert multi._complete(prompt, max_new_tokens=12, stop=stop)[0] == text[: text.find(stop)], stop


def test_generation_params_drive_the_shared_sampler():
    """`jmem.generate.SamplingParams` (no min_p/penalties, None = off) packs into the sampler's arrays."""
    sample_jit = jax.jit(sample)  # as the engine and generate call it: one compilation per shape
    logits = jax.random.normal(jax.random.key(0), (4, 50))
    top1 = make_arrays([SamplingParams(temperature=1.0, top_k=1)] * 4, seeds=range(4), steps=[0] * 4)
    np.testing.assert_array_equal(sample_jit(logits, top1)[0], jnp.argmax(logits, -1))
    peaked = jnp.zeros((1, 10)).at[0, 3].set(10.0)  # p(3) ~ 0.9996: top_p 0.5 keeps only it
    nucleus = [make_arrays([SamplingParams(temperature=1.0, top_p=0.5)], seeds=[s], steps=[0]) for s in range(20)]
    assert {int(sample_jit(peaked, a)[0][0]) for a in nucleus} == {3}
    free = [make_arrays([SamplingParams(temperature=1.0)], seeds=[s], steps=[0]) for s in range(20)]
    assert len({int(sample_jit(jnp.zeros((1, 10)), a)[0][0]) for a in free}) > 1


def test_bad_arguments(lm):
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p=1.5"):
        lm.generate(["a"], top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        lm.generate(["a"], max_new_tokens=-1)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        lm.generate(["a"], max_new_tokens=10_000)
    with pytest.raises(ValueError, match="list of prompt strings"):
        lm.generate("a")
    with pytest.raises(ValueError, match="token ids must be in"):
        lm.logits(np.array([[1, 100000]]))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, \d+\); got 4294967301\.\.4294967301"):
        lm.logits(np.array([[2**32 + 5]]))  # wrapped to id 5 by the int32 cast before the check
    for empty in ([[]], []):  # "integer token ids; got dtype float64" before
        with pytest.raises(ValueError, match=r"^logits expects ids of shape \[batch, seq\] with batch >= 1"):
            lm.logits(empty)
    with pytest.raises(ValueError, match="integer token ids; got dtype float64"):
        lm.logits([[1.7, 2.2]])
    with pytest.raises(ValueError, match="rows of equal length"):
        lm.logits([[1, 2], [3]])
    n = lm.config.max_seq_len + 1  # generate refused this length; logits computed it
    with pytest.raises(ValueError, match=f"^logits expects at most the model's context of {n - 1} tokens per row; "
                                         f"got {n}$"):
        lm.logits(np.ones((1, n), np.int32))
    # Straight to generate_ids: ids outside the vocabulary (NaN logits or wrapped rows before),
    # a flat prompt, a float count, chunk=0 (never finished), a float top_k: one clear error each.
    for prompts, message in [([[1, 259]], "prompt 0 holds 259; accepted: integer token ids in 0..258"),
                             ([[1, 2], [-5]], "prompt 1 holds -5"), ([1, 2, 3], r"not \[1, 2, 3\]")]:
        with pytest.raises(ValueError, match=message):
            generate_ids(lm.model, prompts, 2)
    with pytest.raises(ValueError, match=re.escape("prompt 0 is not a flat list of token ids ([[1, 2]])")):
        generate_ids(lm.model, [[[1, 2]]], 2)
    V = lm.model.config.vocab_size
    for eos in (-1, V, 1.5):  # an id no token can be would never stop a row
        with pytest.raises(ValueError, match=re.escape(f"eos_id={eos!r}; accepted: a token id in 0..{V - 1}, or None")):
            generate_ids(lm.model, [[1, 2]], 2, eos_id=eos)
    with pytest.raises(ValueError, match="params=.*accepted: a jmem.generate.SamplingParams"):
        generate_ids(lm.model, [[1, 2]], 2, params={"temperature": 1.0})
    with pytest.raises(ValueError, match="max_new_tokens=2.5; accepted: an integer >= 0"):
        generate_ids(lm.model, [[1, 2]], 2.5)
    with pytest.raises(ValueError, match="chunk=0; accepted: an integer >= 1"):
        generate_ids(lm.model, [[1, 2]], 2, chunk=0)
    with pytest.raises(ValueError, match=re.escape("top_k=2.5; accepted: an integer in 1..2**31-1, or None, 0 or -1 (off)")):
        SamplingParams(top_k=2.5)
    assert SamplingParams(top_k=0).top_k is None and SamplingParams(top_k=-1).top_k is None  # off, as in serving
    with pytest.raises(ValueError, match="attention_impl='flash'; accepted: auto, pallas, xla, reference"):
        jmem.load("tiny", attention_impl="flash")


@pytest.mark.parametrize("kwargs, expected", [
    (dict(temperature="0.7"), "temperature='0.7'; accepted: a finite number >= 0 (0 is greedy)"),
    (dict(temperature=float("nan")), "temperature=nan; accepted: a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature=inf; accepted: a finite number >= 0"),
    (dict(temperature=True), "temperature=True; accepted: a finite number >= 0"),
    (dict(top_p="0.5"), "top_p='0.5'; accepted: a number in (0, 1], or None (off)"),
    (dict(top_p=float("nan")), "top_p=nan; accepted: a number in (0, 1]"),
    (dict(top_k=5.0), "top_k=5.0; accepted: an integer in 1..2**31-1, or None, 0 or -1 (off)"),
    (dict(top_k=2**31), "top_k=2147483648; accepted: an integer in 1..2**31-1, or None, 0 or -1 (off)"),
    (dict(seed="a"), "seed='a'; accepted: an integer"),
    (dict(seed=1.5), "seed=1.5; accepted: an integer"),
    (dict(seed=True), "seed=True; accepted: an integer"),
    (dict(seed=2**64), "seed=18446744073709551616; accepted: an integer in [-2**63, 2**64)"),
    (dict(max_new_tokens=4.0), "max_new_tokens=4.0; accepted: an integer >= 0"),
])
def test_wrong_typed_sampling_values_are_one_clear_error(lm, kwargs, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        lm.generate(["a"], **kwargs)


def test_numpy_and_jax_sampling_values_are_accepted(lm):
    kw = dict(max_new_tokens=3, temperature=1.0, top_p=0.9, seed=3)
    want = lm.generate(["a"], **kw)
    assert lm.generate(["a"], **kw | dict(temperature=np.float32(1.0), top_p=np.float64(0.9), seed=np.int64(3))) == want
    assert lm.generate(["a"], **kw | dict(temperature=jnp.float32(1.0), top_p=jnp.array(0.9), seed=jnp.int32(3))) == want
    with pytest.raises(ValueError, match=r"temperature=Array\(\[1\.\], dtype=float32\); accepted: a finite number"):
        lm.generate(["a"], **kw | dict(temperature=jnp.ones(1)))
    assert lm.generate(["a"], **kw | dict(max_new_tokens=np.int64(3))) == want  # an AttributeError (bit_length)


def test_load_checks_its_seed():
    """seed=2**64 was an OverflowError and seed='a' flax's 'Invalid rng value'."""
    import jmem

    for seed in (2**63, "a", 1.5):
        with pytest.raises(ValueError, match=rf"^seed={re.escape(repr(seed))}; accepted: an integer in \[-2\*\*63"):
            jmem.load("tiny", seed=seed)


def test_chat_feeds_one_bos(tmp_path, monkeypatch):
    """A GGUF with add_bos_token=true whose chat template writes {{ bos_token }} (Llama 3 / Mistral):
    LM.chat and `jmem generate --chat` feed the model one BOS, not two."""
    import jmem.cli
    import jmem.lm
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.models.config import LlamaConfig
    from tests.helpers import random_model

    cfg = LlamaConfig.tiny(n_layers=1)
    meta = {**byte_tokenizer_metadata(), "tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template":
            "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"}
    path = str(tmp_path / "bos.gguf")
    write_gguf(path, cfg, random_model(cfg, 0), tokenizer_metadata=meta)
    fed = []
    monkeypatch.setattr(jmem.lm, "generate_ids", lambda model, prompts, *a, **k: (fed.extend(prompts), [[]])[1])
    chat_lm = jmem.load(path)
    chat_lm.chat([{"role": "user", "content": "hi"}], max_new_tokens=2)
    monkeypatch.setattr(jmem, "load", lambda *a, **k: chat_lm)
    jmem.cli.generate(prompt="hi", model=path, chat=True, max_new_tokens=2)
    chat_lm.generate(["hi"], max_new_tokens=2)  # plain prompts keep add_bos_token's BOS
    bos = chat_lm.tokenizer.bos_id
    assert [p[:2] for p in fed] == [[bos, ord("<")], [bos, ord("<")], [bos, ord("h")]]
    assert [p.count(bos) for p in fed] == [1, 1, 1]


def test_empty_inputs_name_the_problem(lm):
    with pytest.raises(ValueError, match=re.escape("prompts=[]; accepted: a non-empty list of prompt strings")):
        lm.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 encodes to no tokens"):
        lm.generate(["hello", ""])
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        generate_ids(lm.model, [[1], []], 2)
    for shape in ((0, 4), (2, 0)):
        with pytest.raises(ValueError, match=r"batch >= 1 and seq >= 1; got \(%d, %d\)" % shape):
            lm.logits(np.zeros(shape, np.int32))


def test_stop_callback_result_is_checked_and_chunks_end_near_the_last_token(lm, monkeypatch):
    """A stop callback returning -1 dropped the last token without a word (a float: a slicing TypeError);
    chunk=4000 for one new token ran 4000 decode steps."""
    import jmem.generate as gen

    for keep in (-1, 1.5, 99):
        with pytest.raises(ValueError, match=re.escape(f"stop(row=0, ids) returned {keep!r}; accepted: None, or how "
                                                       "many of the row's 3 ids to keep (0..3)")):
            generate_ids(lm.model, [[1, 2]], 3, stop=lambda i, ids, keep=keep: keep)
    assert generate_ids(lm.model, [[1, 2]], 3, stop=lambda i, ids: 1) == [generate_ids(lm.model, [[1, 2]], 3)[0][:1]]
    calls, decode = [], gen._decode
    monkeypatch.setattr(gen, "_decode", lambda *a, steps, **kw: calls.append(steps) or decode(*a, steps=steps, **kw))
    want = generate_ids(lm.model, [[1, 2]], 3, chunk=4)
    assert generate_ids(lm.model, [[1, 2]], 3, chunk=4000) == want and calls == [4, 4]


def test_bad_model_or_stop_is_one_clear_error(lm):
    """`stop="x"` failed with 'str' object is not callable after the prefill; `model=None` with an AttributeError."""
    for stop in ("x", ["x"], 3):
        with pytest.raises(ValueError, match=re.escape(f"stop={stop!r}; accepted: None or a callable stop(row, ids) -> "
                                                       "int | None (how many ids to keep); for stop strings: "
                                                       "jmem.LM.generate(..., stop=...)")):
            generate_ids(lm.model, [[1, 2]], 3, stop=stop)
    for model in (None, "tiny", lm):
        with pytest.raises(ValueError, match=r"^model(=| is a ).*; accepted: a jmem.models.Llama model$"):
            generate_ids(model, [[1]], 4)


def test_completion_watch_decodes_a_short_tail_per_call():
    """`CompletionWatch.stop` decodes each row's text incrementally (`IncrementalDecoder`): over a
    completion fed one id at a time it decodes O(length) ids in all, where decoding the whole
    completion per call decoded length**2 / 2; the stop point and the streamed text are the same."""
    from jmem.io.tokenizer import ByteTokenizer, IncrementalDecoder
    from jmem.lm import CompletionWatch

    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids, skip_special=True):
            Counting.decoded += len(ids)
            return super().decode(ids, skip_special)

    text = "naïve café — 東京 🙂 " * 20 + "the END here"
    ids = list(text.encode())
    pieces = []
    watch = CompletionWatch(Counting(), "END", on_text=pieces.append)
    for m in range(1, len(ids) + 1):
        keep = watch.stop(0, ids[:m])
        if keep is not None:
            break
    decode = ByteTokenizer().decode
    assert decode(ids[:keep]).endswith("END") and not decode(ids[:keep - 1]).endswith("END")
    calls = Counting.decoded
    assert calls < 3 * IncrementalDecoder.SETTLE_AFTER * len(ids) < len(ids) ** 2 / 2, calls
    assert watch.finish(ids[:keep]) == "".join(pieces) == text[: text.find("END")]
    other = CompletionWatch(ByteTokenizer(), "END")  # rows of their own: each row's text is its own
    assert other.stop(1, ids[:5]) is None and other.stop(0, list(b"x END")) == 5
