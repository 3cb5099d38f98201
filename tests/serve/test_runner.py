"""Paged runner and engine on the tiny model, checked against the model's own full forward pass."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.io.tokenizer import ByteTokenizer, IncrementalDecoder
from jmem.models import Llama, LlamaConfig
from jmem.serve.engine import Engine, EngineConfig, _Detok
from jmem.serve.paged_cache import kv_bytes_per_token
from jmem.serve.request import SamplingParams
from jmem.serve.runner import ModelRunner, _step_fn

MAX_LEN = 64
# Block 8 and max_model_len 64 give one page bucket; budget 16 gives one token bucket: few compilations
# (decode-only or prefilling steps, times 1, 2 or 4 sampled rows).
SMALL = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens and their logprobs by recomputing the full sequence each step (no cache)."""
    fwd = jax.jit(lambda ids: jax.nn.log_softmax(model(ids)[0][0], -1))

    @functools.lru_cache(maxsize=None)
    def run(prompt: tuple, n: int):
        ids, out, lps = list(prompt), [], []
        for _ in range(n):
            buf = np.zeros((1, MAX_LEN), np.int32)
            buf[0, : len(ids)] = ids
            lp = np.asarray(fwd(jnp.asarray(buf)))[len(ids) - 1]
            t = int(np.argmax(lp))
            out.append(t), lps.append(float(lp[t])), ids.append(t)
        return out, lps

    return run


def prompts(seed, n, shared_prefix=()):
    rng = np.random.default_rng(seed)
    return [list(shared_prefix) + [int(x) for x in rng.integers(0, 256, size=rng.integers(1, 24))] for _ in range(n)]


def greedy(max_tokens=8, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1, **kw)


def test_paged_engine_matches_full_forward(model, reference):
    """Chunked prefill, decode, preemption and prefix sharing all give the uncached model's tokens."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=12, **SMALL))
    ps = prompts(0, 6, shared_prefix=range(30, 46)) + prompts(1, 4)
    outs = engine.generate(ps, greedy())
    for p, o in zip(ps, outs, strict=True):
        want, want_lp = reference(tuple(p), 8)
        assert o.token_ids == want
        np.testing.assert_allclose([lp for lp, _ in o.logprobs], want_lp, atol=1e-4)
        assert o.finish_reason == "length"
    m = engine.metrics()
    assert m["preemptions_total"] > 0, "pool meant to be too small for all at once"
    assert m["prefix_cache_hit_tokens_total"] > 0
    assert m["kv_cache_blocks_in_use"] == 0 and m["num_requests_running"] == 0
    first = engine.runner.num_compilations
    shapes = engine.runner.compiled_shapes
    assert len({s._replace(sample_rows=0) for s in shapes}) <= 2 and {s.sample_rows for s in shapes} <= {1, 2, 4}
    compiled = _step_fn._cache_size()
    # A different mix of lengths and batch sizes reuses the compiled step.
    outs = engine.generate(prompts(2, 3), greedy(max_tokens=5))
    assert engine.runner.num_compilations == first and _step_fn._cache_size() == compiled
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]


def test_shared_prefix_submitted_together_matches_full_forward(model, reference):
    """Requests sharing a full block submitted together (a prefill chunk and a one-token rest), then again."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=16, **SMALL))
    prefix = [int(x) for x in np.random.default_rng(3).integers(0, 256, size=8)]  # one full block
    ps = [prefix + [7, 9], prefix + [11], prefix + [4, 5, 6, 2]]
    # Round one: the first request writes the block, the others wait one step and share it; round two
    # hits it three times.
    for want_cached in ([0, 8, 8], [8, 8, 8]):
        outs = engine.generate(ps, greedy(4))
        assert [o.num_cached_tokens for o in outs] == want_cached
        for p, o in zip(ps, outs, strict=True):
            want, want_lp = reference(tuple(p), 4)
            assert o.token_ids == want
            np.testing.assert_allclose([lp for lp, _ in o.logprobs], want_lp, atol=1e-4)


def test_precompiled_engine_never_waits_for_a_compilation(model, reference):
    """After `precompile`, steps of new shapes run padded to a compiled one (same tokens) while their
    own shape compiles in the background; once compiled, the next steps use it."""
    # No prefix cache: the second round schedules exactly as the first.
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=24, enable_prefix_caching=False,
                                                         **{**SMALL, "max_model_len": 128}))
    engine.precompile()
    runner = engine.runner
    envelopes = set(runner.compiled_shapes)
    ran = []
    choose = runner._shape_to_run
    runner._shape_to_run = lambda need: ran.append((need, choose(need))) or ran[-1][1]
    ps = prompts(5, 4)
    for round_ in range(2):
        ran.clear()
        for p, o in zip(ps, engine.generate(ps, greedy(6)), strict=True):
            want, want_lp = reference(tuple(p), 6)
            assert o.token_ids == want
            np.testing.assert_allclose([lp for lp, _ in o.logprobs], want_lp, atol=1e-4)
        assert runner.num_blocking_compilations == 0
        assert all(run.holds(need) for need, run in ran)
        if round_ == 0:
            assert any(need != run for need, run in ran), "meant to meet shapes smaller than the largest"
            runner.finish_compilations()
        else:
            assert all(need == run for need, run in ran)
    assert envelopes < runner.compiled_shapes and not runner._compiling


def test_a_dropped_engine_is_freed_while_its_compilations_wait(model):
    """Background compilations queued for an engine hold it weakly: dropping the engine frees its
    runner (weights and KV cache) before the queue reaches them, and they are skipped."""
    import gc
    import threading
    import weakref

    from jmem.serve.runner import _background_compiler

    gate = threading.Event()
    _background_compiler().submit(gate.wait, 60)  # the compile thread is busy: later shapes stay queued
    try:
        engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=24, **{**SMALL, "max_model_len": 128}))
        engine.precompile()
        engine.generate(prompts(5, 3), greedy(4))
        assert engine.runner._compiling, "meant to queue shapes smaller than the compiled ones"
        runner = weakref.ref(engine.runner)
        del engine
        gc.collect()
        assert runner() is None
    finally:
        gate.set()
    _background_compiler().submit(lambda: None).result()  # the queued shapes ran as no-ops


def test_moe_prompt_logprobs_are_dropless_as_decoding_is():
    """Capacity routing dropped tokens of the (padded) prompt: scores then depended on the length bucket."""
    moe = Llama(LlamaConfig.tiny_moe(moe_capacity_factor=0.5), rngs=nnx.Rngs(0))
    engine = Engine(moe, ByteTokenizer(), EngineConfig(num_blocks=16, **SMALL))
    [ids] = prompts(20, 1)
    got = engine.prompt_logprobs(ids, k=1)
    h = moe.hidden(jnp.asarray([ids]), dropless=True)[0]
    lsm = np.asarray(jax.nn.log_softmax(moe.logits_from_hidden(h)[0], -1))
    np.testing.assert_allclose([got[t][0] for t in range(1, len(ids))],
                               [lsm[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4)


def test_prompt_logprobs_equal_the_full_forward(model):
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=16, **SMALL))
    [ids] = prompts(11, 1)
    ids = ids + [7] * (20 - len(ids))  # 20 tokens, padded to 24: three chunks of 8 positions, the last part padding
    got = engine.prompt_logprobs(ids, k=3)
    lsm = np.asarray(jax.nn.log_softmax(model(jnp.asarray([ids]))[0][0], -1))
    assert got[0] is None and len(got) == len(ids)
    for t in range(1, len(ids)):
        lp, top, rank = got[t]
        np.testing.assert_allclose(lp, lsm[t - 1, ids[t]], atol=1e-4)
        assert rank == 1 + np.sum(lsm[t - 1] > lsm[t - 1, ids[t]])  # ties with the token count as below it
        want_ids = np.argsort(-lsm[t - 1])[:3]
        assert [i for i, _ in top] == list(want_ids)
        np.testing.assert_allclose([v for _, v in top], lsm[t - 1, want_ids], atol=1e-4)
    assert all(len(x[1]) == 0 for x in engine.prompt_logprobs(ids[:5], k=0)[1:])
    from jmem.serve.runner import _prompt_logprobs_fn

    programs = _prompt_logprobs_fn._cache_size()
    for k in (1, 2, 5, 20):  # one program per length, whatever k a request asks for
        assert [len(x[1]) for x in engine.prompt_logprobs(ids, k=k)[1:]] == [k] * (len(ids) - 1)
    assert _prompt_logprobs_fn._cache_size() == programs
    for bad, message in [([], "empty"), (list(range(70)), "at most 64"), ([1, 2], "logprobs=21")]:
        with pytest.raises(ValueError, match=message):
            engine.prompt_logprobs(bad, k=21 if message.startswith("logprobs") else 1)


def test_penalty_shapes_compile_in_the_background_without_failing_steps(model):
    """Steps with penalties have their own history-length dimension: a short request after a long one runs
    padded to the long one's shape while its own compiles in the background; later steps all work."""
    tok = ByteTokenizer()
    engine = Engine(model, tok, EngineConfig(num_blocks=24, **{**SMALL, "max_model_len": 128}))
    engine.precompile()
    pen = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, frequency_penalty=1.0)
    engine.generate([list(range(1, 71))], pen)  # 70+ tokens of history: H = 128, compiled in the foreground
    runner = engine.runner
    [short] = engine.generate([tok.encode("ab")], pen)  # H = 64 runs padded to 128 meanwhile
    runner.finish_compilations()
    assert not runner._compile_failed
    assert any(s.hist_len == 64 for s in runner.compiled_shapes), runner.compiled_shapes
    [again] = engine.generate([tok.encode("ab")], pen)  # now on its own shape: same tokens
    assert again.token_ids == short.token_ids and len(short.token_ids) == 4
    [plain] = engine.generate([tok.encode("ab")], greedy(4))
    assert len(plain.token_ids) == 4


@pytest.mark.parametrize("kv_dtype, atol", [("int8", 0.05), ("fp8_e4m3", 0.25)])
def test_quantized_kv_close_to_full_precision(model, reference, kv_dtype, atol):
    """With K/V stored quantized, the reference's next token keeps nearly its log-probability.

    (Its rank may change where two tokens are nearly tied, so the check reads the
    reference token's log-probability from the top-5 list.)
    """
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=32, kv_cache_dtype=kv_dtype, **SMALL))
    assert engine.runner.cache.k_pages.dtype == {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}[kv_dtype]
    ps = prompts(3, 3)
    outs = engine.generate(ps, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5))
    for p, o in zip(ps, outs, strict=True):
        # One token: its logprob depends on the quantized cache of the whole prompt.
        want, want_lp = reference(tuple(p), 1)
        top = dict(o.logprobs[0][1])
        assert want[0] in top
        assert abs(top[want[0]] - want_lp[0]) < atol


def test_capacity_fp8_twice_bf16():
    cfg = LlamaConfig.smollm2_135m()
    per_bf16, per_fp8 = kv_bytes_per_token(cfg, "bf16"), kv_bytes_per_token(cfg, "fp8_e4m3")
    assert per_bf16 == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 == 2 * per_fp8
    budget = 64 << 20
    n_bf16 = ModelRunner.num_blocks_for_budget(cfg, budget, 16, "bf16")
    n_fp8 = ModelRunner.num_blocks_for_budget(cfg, budget, 16, "fp8_e4m3")
    # int8/fp8 pools also hold f32 per-page-per-head scales: slightly under twice the blocks.
    assert 0.99 * 2 * (n_bf16 + 1) <= n_fp8 + 1 <= 2 * (n_bf16 + 1)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_bytes_per_token(cfg, "fp4")


def test_stop_strings_cut_at_the_earliest_match():
    """Two stop strings completed by one token: the text ends before the earlier one, whatever the list's order."""
    class Pieces:  # a token id is its text; "<s>" is a control token
        def decode(self, ids, skip_special=True):
            return "".join(i for i in ids if not (skip_special and i == "<s>"))

    for stop in (["is", "Par"], ["Par", "is"]):
        d = _Detok(Pieces(), SamplingParams(stop=stop))
        assert d.update([" The"], False) == (" T", False)  # the last 2 characters held back for a stop string
        assert d.update([" The", " capital", " Paris"], False) == ("he capital ", True)
        d = _Detok(Pieces(), SamplingParams(stop=stop, include_stop_str_in_output=True))
        assert d.update([" The", " capital", " Paris"], False) == (" The capital Par", True)
    assert _Detok(Pieces(), SamplingParams()).update(["<s>", "a"], True) == ("a", False)
    assert _Detok(Pieces(), SamplingParams(skip_special_tokens=False)).update(["<s>", "a"], True) == ("<s>a", False)


def test_streamed_text_decodes_each_id_a_bounded_number_of_times():
    """Byte tokens (multi-byte characters split across them, an invalid byte, a stop string late in
    the output): the deltas join to the text of the whole output, and each update decodes a bounded
    tail, not the whole output again."""
    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids, skip_special=True):
            Counting.decoded += len(ids)
            return super().decode(ids, skip_special)

    text = "naïve café — 東京 🙂 " * 12
    ids = list(text.encode()) + [0xE6] + list("end STOP tail".encode())  # 0xE6: a character never finished
    want = ByteTokenizer().decode(ids)
    want = want[: want.find("STOP")]
    d = _Detok(Counting(), SamplingParams(stop=["STOP"]))
    deltas = []
    for m in range(1, len(ids) + 1):
        delta, hit = d.update(ids[:m], m == len(ids))
        deltas.append(delta)
        if hit:
            break
    assert hit and "".join(deltas) == want
    # The whole output decoded each time would be len(ids)**2 / 2.
    assert Counting.decoded < 3 * IncrementalDecoder.SETTLE_AFTER * len(ids)


def test_stop_strings_with_characters_split_across_tokens():
    """A multi-byte character that finishes a stop string: no character of the stop string is sent
    before it (the held-back characters are whole ones); a stop string holding U+FFFD does not
    match a character still being built."""
    tok = ByteTokenizer()

    def stream(ids, stop):
        d, out = _Detok(tok, SamplingParams(stop=stop)), ""
        for m in range(1, len(ids) + 1):
            delta, hit = d.update(ids[:m], m == len(ids))
            out += delta
            if hit:
                return out, True
        return out, False

    text = "xé é café"
    for stop in (["é é"], ["é c"], [" ca"]):
        want = text[: text.find(stop[0])]
        assert stream(list(text.encode()), stop) == (want, True), stop
    assert stream(list("xéa".encode()), ["\ufffd"]) == ("xéa", False)
    assert stream(list("xé".encode())[:-1], ["\ufffd"]) == ("x", True)  # an invalid byte at the end is U+FFFD


def test_stop_strings_penalties_and_abort(model):
    tok = ByteTokenizer()
    engine = Engine(model, tok, EngineConfig(num_blocks=16, **SMALL))
    p = tok.encode("abc")
    [free] = engine.generate([p], greedy(max_tokens=12))
    text = free.text
    # Stop at a string inside the free-running text: output ends right before it.
    stop = text[3:5]
    if stop and "\ufffd" not in stop:
        [o] = engine.generate([p], greedy(max_tokens=12, stop=[stop]))
        assert o.text == text[: text.find(stop)] and o.finish_reason == "stop"
    # Stop token id: excluded from the text (with EOS ignored too), reason "stop".
    [o] = engine.generate([p], greedy(max_tokens=12, stop_token_ids=[free.token_ids[2]]))
    assert o.token_ids == free.token_ids[:3] and o.finish_reason == "stop"
    assert o.text == tok.decode(free.token_ids[:2])
    # A strong frequency penalty forbids repeating an output token within this short run.
    [o] = engine.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                frequency_penalty=2.0, repetition_penalty=2.0))
    assert len(o.token_ids) == 10
    # Abort frees the blocks, sends the text a stop string's look-ahead held back and counts the tokens made
    # (its final output said 0 tokens, so usage billed an aborted request none).
    s = engine.add_request(tok.encode("hello world"), greedy(max_tokens=40, stop=["not in this output at all"]))
    for _ in range(4):
        engine.step()
    assert engine.kv.pool.num_used > 0
    engine.abort(s.request_id)
    engine.step()
    items = []
    while (x := s.get_nowait()) is not None:
        items.append(x)
    assert items[-1].finished and items[-1].finish_reason == "abort"
    ids = [i for x in items for i in x.token_ids]
    assert items[-1].num_output_tokens == len(ids) >= 4 and items[-1].num_prompt_tokens == len("hello world")
    assert "".join(x.text for x in items) == tok.decode(ids)
    assert engine.kv.pool.num_used == 0
    with pytest.raises(ValueError, match="exceeds the maximum context"):
        engine.add_request(list(range(60)), greedy(max_tokens=8))
    for bad in (0, model.config.max_seq_len + 1):
        with pytest.raises(ValueError, match=f"max_model_len={bad} is out of range; accepted: 1..512"):
            Engine(model, tok, EngineConfig(num_blocks=16, **{**SMALL, "max_model_len": bad}))
    # One stop string is one string, not its characters; None is none.
    if stop and "\ufffd" not in stop:
        [one] = engine.generate([p], greedy(max_tokens=12, stop=stop))
        assert one.text == text[: text.find(stop)]
    assert engine.generate([p], greedy(max_tokens=12, stop=None))[0].text == text
    vocab = model.config.vocab_size
    for prompt, params, message in [
            ([vocab], greedy(), f"prompt holds token id {vocab}; accepted: 0..{vocab - 1}"),
            ([-1, 5], greedy(), "prompt holds token id -1"),
            (np.array([5, vocab + 1]), greedy(), f"prompt holds token id {vocab + 1}"),  # an array prompt too
            (["h"], greedy(), "prompt holds 'h'; accepted: integer token ids"),
            (p, greedy(stop_token_ids=[vocab + 3]), f"stop_token_ids holds token id {vocab + 3}"),
            (p, greedy(max_tokens=4.5), "max_tokens=4.5; accepted: an integer"),
            (p, SamplingParams(temperature="0"), "temperature='0'; accepted: a finite number"),
            (p, greedy(stop=[""]), "stop=\\[''\\]; accepted: a non-empty string")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params)
    for field_, bad in (("block_size", 0), ("max_num_seqs", "4"), ("max_num_batched_tokens", True)):
        with pytest.raises(ValueError, match=f"{field_}={bad!r}; accepted: an integer >= 1"):
            EngineConfig(**{**SMALL, field_: bad})
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts; accepted: one, or one per prompt"):
        engine.generate([p, p], [greedy()])
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()
    # stop() ends what is still running: a final "abort" output, the blocks freed.
    engine.start()
    s = engine.add_request(tok.encode("hello world"), greedy(max_tokens=40))
    engine.stop()
    items = []
    while (x := s.get_nowait()) is not None:
        items.append(x)
    assert items and items[-1].finished and items[-1].finish_reason in ("abort", "length")
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()


def test_kernel_impl_matches_tiled(model, reference):
    """The Pallas ragged kernel (interpreted on CPU) through the same engine gives the same tokens."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=16, attention_impl="kernel", **SMALL))
    assert engine.runner.cache.impl == "kernel"
    ps = prompts(4, 3)
    for p, o in zip(ps, engine.generate(ps, greedy(max_tokens=3)), strict=True):
        want, want_lp = reference(tuple(p), 3)
        assert o.token_ids == want
        np.testing.assert_allclose([lp for lp, _ in o.logprobs], want_lp, atol=1e-4)
    # Tiles and decode rows, which only the plain-jnp path reads, stay out of the kernel path's shapes.
    assert {(s.tiles, s.pages_per_tile, s.decode_rows, s.decode_chunks) for s in engine.runner.compiled_shapes} \
        == {(1, 1, 1, 1)}


MiB = 2**20


def fake_device(monkeypatch, limit, in_use):
    """The first device reports `limit` bytes with `in_use` taken (as a GPU's allocator does)."""
    import jmem.serve.runner as runner_module

    monkeypatch.setattr(runner_module, "device_memory_stats", lambda: {"bytes_limit": limit, "bytes_in_use": in_use})


def test_budget_counts_weights_already_on_the_device_once(monkeypatch):
    from jmem.serve.runner import kv_cache_budget

    fake_device(monkeypatch, 1000 * MiB, 300 * MiB)
    # The 200 MiB of weights are part of the 300 MiB in use: not subtracted again.
    assert kv_cache_budget(200 * MiB, None, 0.9, resident_weight_bytes=200 * MiB) == 600 * MiB
    # Weights still to be placed (a split copy per device) come out of the budget.
    assert kv_cache_budget(200 * MiB, None, 0.9) == 400 * MiB
    with pytest.raises(ValueError, match=r"memory_utilization=0.5 leaves no room .* \(200 MiB\) .* "
                                         r"\(300 MiB in use of 1000 MiB\)"):
        kv_cache_budget(200 * MiB, None, 0.5)


def test_a_pool_larger_than_memory_is_refused_before_it_is_built(model, monkeypatch):
    """num_blocks or kv_cache_memory asking for more than the device holds: one error naming both (the
    block pool's bookkeeping grew until the process was killed)."""
    import jmem.serve.runner as runner_module

    monkeypatch.setattr(runner_module, "memory_limit", lambda: (16 * MiB, "the device holds"))
    per_block = kv_bytes_per_token(model.config, "auto", 8) * 8
    fits = (16 * MiB - Engine(model, ByteTokenizer(), EngineConfig(num_blocks=4, block_size=8)).weight_bytes) \
        // per_block
    assert Engine(model, ByteTokenizer(), EngineConfig(num_blocks=fits, block_size=8)).kv.pool.num_blocks == fits
    for kw in (dict(num_blocks=fits + 1), dict(kv_cache_memory=10**15)):
        with pytest.raises(ValueError, match=rf"^a KV cache of \d+ blocks .* does not fit: the device holds 16 MiB; "
                                             rf"accepted: num_blocks \(--num-blocks\) up to {fits}, or a smaller "
                                             r"kv_cache_memory \(--kv-cache-memory\)$"):
            Engine(model, ByteTokenizer(), EngineConfig(block_size=8, **kw))


def test_engine_budget_does_not_count_resident_weights_twice(model, monkeypatch):
    """One device: the model's arrays already sit on it, so the KV cache gets the fraction less what is in use."""
    fake_device(monkeypatch, 64 * MiB, 8 * MiB)
    engine = Engine(model, ByteTokenizer(), EngineConfig(memory_utilization=0.5, block_size=8))
    assert engine.weight_bytes > 0
    per_block = kv_bytes_per_token(model.config, "auto", 8) * 8
    assert engine.kv.pool.num_blocks == (32 * MiB - 8 * MiB) // per_block - 1  # one spare page


def test_a_failed_step_or_output_ends_its_requests_and_leaves_no_stale_prefix(model, reference):
    """A step that raised left its blocks' prefix hashes pending: a later request reusing the id had its
    other prompt cached under them, and a third request got wrong tokens from the 'hit'. An exception
    while emitting (the tokenizer's decode) left the stream without a final output forever."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=16, **SMALL))
    x, y = prompts(21, 1)[0] + list(range(20)), list(range(100, 120))
    real_step, calls = engine.runner.step, []

    def fails_once(out):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real_step(out)

    engine.runner.step = fails_once
    s = engine.add_request(x, greedy(), request_id="A")
    engine.step()
    last = s.get_nowait()
    assert last.finish_reason == "error" and "device lost" in last.error
    assert engine.metrics()["requests_failed_total"] == 1 and engine.metrics()["requests_finished_total"] == 0
    engine.add_request(y, greedy(), request_id="A")
    engine.run_until_idle()
    [o] = engine.generate([x], greedy())
    assert o.token_ids == reference(tuple(x), 8)[0]
    assert engine.kv.pool.num_used == 0

    class BadDecode(ByteTokenizer):
        def decode(self, ids, skip_special=True):
            if len(ids) >= 3:
                raise UnicodeError("cannot decode")
            return super().decode(ids, skip_special)

    engine = Engine(model, BadDecode(), EngineConfig(num_blocks=16, **SMALL))
    [o] = engine.generate([[1, 2, 3]], greedy(max_tokens=6))
    assert o.finish_reason == "error" and "UnicodeError: cannot decode" in o.error
    assert engine.metrics()["requests_failed_total"] == 1
    assert engine.kv.pool.num_used == 0 and not engine._streams and not engine._detok


def test_engine_arguments_of_the_wrong_kind_are_one_error(model):
    tok = ByteTokenizer()
    for kw, message in ((dict(num_blocks=-3), "num_blocks=-3; accepted: an integer >= 1"),
                        (dict(num_blocks=2.5), "num_blocks=2.5; accepted: an integer >= 1"),
                        (dict(num_blocks=True), "num_blocks=True; accepted: an integer >= 1"),
                        (dict(max_model_len=40.5), "max_model_len=40.5; accepted: an integer in 1..the model's"),
                        (dict(max_model_len="64"), "max_model_len='64'; accepted: an integer"),
                        # Adapter settings are checked without adapters too (a typo waited for the first one).
                        (dict(max_loras=0), "max_loras=0; accepted: an integer >= 1"),
                        (dict(max_lora_rank=0), "max_lora_rank=0; accepted: an integer >= 1"),
                        (dict(lora_impl="dense"), "lora_impl='dense'; accepted: onehot, ragged"),
                        (dict(enable_prefix_caching="no"), "enable_prefix_caching='no'; accepted: True or False"),
                        (dict(static_batching=1), "static_batching=1; accepted: True or False"),
                        # memory_utilization=True was accepted as 1.0; a string failed a comparison at Engine.
                        (dict(memory_utilization=True), "memory_utilization=True; accepted: a fraction in (0, 1]"),
                        (dict(memory_utilization="0.5"), "memory_utilization='0.5'; accepted: a fraction in (0, 1]"),
                        (dict(memory_utilization=1.5), "memory_utilization=1.5; accepted: a fraction in (0, 1]"),
                        (dict(kv_cache_memory=True), "kv_cache_memory=True; accepted: a number of bytes > 0"),
                        (dict(kv_cache_memory=0), "kv_cache_memory=0; accepted: a number of bytes > 0")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            EngineConfig(**kw)
    with pytest.raises(ValueError, match="^LoRA module 'a' path 5; accepted: a path to an .npz"):  # a TypeError before
        Engine(model, tok, EngineConfig(num_blocks=16, **SMALL), lora_modules={"a": 5})
    engine = Engine(model, tok, EngineConfig(num_blocks=16, **SMALL))
    for prompt, message in ((None, "prompt of type NoneType; accepted: a list of integer token ids"),
                            ("abc", "prompt of type str; accepted: a list of integer token ids")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            engine.add_request(prompt, greedy())
    for params in (None, {"max_tokens": 4}):
        with pytest.raises(ValueError, match="^params of type .*; accepted: a jmem.serve.request.SamplingParams$"):
            engine.add_request([1, 2], params)
    # Arrays of ids are ids (a JAX array was refused as holding "Array(1, dtype=int32)").
    [a, b] = engine.generate([jnp.asarray([1, 2, 3]), np.asarray([1, 2, 3])], greedy(max_tokens=3))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 3


def test_unseeded_requests_do_not_follow_the_program_random_seed(model):
    """Unseeded sampling drew its seed from Python's `random`: a program seeding it repeated every request."""
    import random

    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=16, **SMALL))
    outs = []
    for _ in range(2):
        random.seed(0)
        [o] = engine.generate(prompts(3, 1), SamplingParams(max_tokens=16, temperature=1.0))
        outs.append(o.token_ids)
    assert outs[0] != outs[1]


def test_token_utilization_counts_a_shared_prefix_block_once(model):
    """Requests sharing prefix blocks counted those blocks' tokens once per request over the blocks in use
    counted once: the utilization went above 1."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=32, block_size=8, max_num_seqs=4,
                                                         max_num_batched_tokens=64, max_model_len=MAX_LEN))
    prompt = list(range(1, 41))  # five full blocks, shared
    first = engine.add_request(prompt, greedy(max_tokens=6))
    engine.step()  # its prompt computed: the blocks are cached
    others = [engine.add_request(prompt, greedy(max_tokens=6)) for _ in range(2)]
    engine.step()
    m = engine.metrics()
    assert m["num_requests_running"] == 3 and m["prefix_cache_hit_tokens_total"] > 0
    assert 0.5 < m["kv_cache_token_utilization"] <= 1.0, m  # was 1.89
    assert set(m) == set(Engine.METRICS_HELP)  # every metric says what it is on /metrics
    for s in (first, *others):
        engine.abort(s.request_id)
    engine.step()
