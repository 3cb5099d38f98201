"""N-gram speculative decoding in the serving engine: same greedy tokens, same sampling distribution,
same stops, no leaked blocks, a bounded number of compiled steps."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.io.tokenizer import ByteTokenizer
from jmem.models import Llama, LlamaConfig
from jmem.sampling import make_arrays, masked_logits
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.ngram import propose_ngram
from jmem.serve.request import SamplingParams
from jmem.serve.runner import _bucket, _fine_bucket
from jmem.serve.spec_decode import NO_DRAFT, verify_rows

K = 3
# One config for every engine here: the runners share compiled steps.
# One token bucket (16) and one pool size: few programs to compile.
SMALL = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=12)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def repetitive(seed, n):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = [int(x) for x in rng.integers(0, 256, size=rng.integers(2, 5))]
        out.append((motif * 8)[: int(rng.integers(9, 20))])
    return out


def randoms(seed, n):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, 256, size=rng.integers(1, 16))] for _ in range(n)]


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df) (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def pearson(observed, expected, min_expected=5.0) -> tuple[float, int]:
    """Pearson's statistic over bins with enough expected mass (the rest pooled) and its degrees of freedom."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    big = expected >= min_expected
    o = np.append(observed[big], observed[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    o, e = o[keep], e[keep]
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def test_propose_ngram_takes_latest_longest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2], k=2, n_max=3) == [3, 9]
    # The longest suffix wins over a later match of a shorter one.
    assert propose_ngram([5, 6, 7, 8, 0, 6, 4, 5, 6], k=2, n_max=2) == [7, 8]
    assert propose_ngram([4, 6, 7, 5, 6, 8, 6], k=1, n_max=3) == [8]  # latest occurrence of [6]
    assert propose_ngram([1, 2, 3, 4], k=3, n_max=3) == []  # nothing repeats
    assert propose_ngram([1, 2, 1, 2, 1], k=5, n_max=2) == [2, 1]  # cut at the end of the sequence
    assert propose_ngram([1, 2, 1], k=0, n_max=2) == []


def test_verify_rows_keeps_a_proposal_exactly_when_it_is_the_drawn_token():
    tokens = jnp.asarray([5, 7, 7, 2], jnp.int32)
    draft = jnp.asarray([5, 6, NO_DRAFT, 2], jnp.int32)
    assert np.asarray(verify_rows(tokens, draft)).tolist() == [True, False, False, True]


def test_seeded_sampling_is_the_same_with_speculation_in_any_batch_and_pool(model):
    """A seeded sampled request draws the tokens it draws without speculation, whether it runs alone or
    beside others, on a roomy pool or one so small that requests are preempted and recomputed: a
    proposal is kept only when it is the token sampled at its step (with the same key), so neither
    the number of proposals (which the budget and the pool decide) nor a rejection moves the draws."""
    prompts = repetitive(3, 6)
    params = [SamplingParams(max_tokens=24, temperature=0.3, top_p=0.95, frequency_penalty=0.3, ignore_eos=True,
                             logprobs=1, seed=7 + i) for i in range(len(prompts))]
    plain = Engine(model, ByteTokenizer(), EngineConfig(**{**SMALL, "num_blocks": 64})).generate(prompts, params)
    tight = Engine(model, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **{**SMALL, "num_blocks": 8}))
    roomy = Engine(model, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **{**SMALL, "num_blocks": 64}))
    runs = {"tight": tight.generate(prompts, params), "roomy": roomy.generate(prompts, params),
            "alone": roomy.generate(prompts[1:2], params[1:2])}  # the middle request, beside others above
    assert tight.metrics()["preemptions_total"] > 0
    assert roomy.metrics()["spec_decode_num_accepted_tokens_total"] > 0
    for name, outs in runs.items():
        ref = plain[1:2] if name == "alone" else plain
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], name
        np.testing.assert_allclose([lp for o in outs for lp, _ in o.logprobs],
                                   [lp for o in ref for lp, _ in o.logprobs], atol=1e-4, err_msg=name)
    for e in (tight, roomy):
        assert e.kv.pool.num_free == e.kv.pool.num_blocks


def _greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1, **kw)


def test_greedy_speculation_matches_plain_decoding(model):
    """Token for token and logprob for logprob, with proposals accepted and the pool all free after,
    under preemption (a pool of 12 blocks, too small for every request at once); compiled shapes stay in
    the buckets, and after `precompile` no step blocks on a compilation."""
    prompts = repetitive(0, 5) + randoms(1, 3)
    base = Engine(model, ByteTokenizer(), EngineConfig(**SMALL))
    spec = Engine(model, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **SMALL))
    want = base.generate(prompts, _greedy())
    spec.precompile()  # then no step, verify steps included, waits for a compilation
    got = spec.generate(prompts, _greedy())
    spec.runner.finish_compilations()
    assert spec.runner.num_blocking_compilations == 0
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason == "length"
        np.testing.assert_allclose([lp for lp, _ in g.logprobs], [lp for lp, _ in w.logprobs], atol=1e-4)
        assert [t for t, _ in g.logprobs[0][1]] == [t for t, _ in w.logprobs[0][1]]
    m = spec.metrics()
    assert m["spec_decode_num_accepted_tokens_total"] > 0
    assert m["spec_decode_num_draft_tokens_total"] >= m["spec_decode_num_accepted_tokens_total"]
    assert m["preemptions_total"] > 0
    assert m["engine_steps_total"] < base.metrics()["engine_steps_total"]  # fewer steps for the same tokens
    assert m["generation_tokens_total"] == sum(len(g.token_ids) for g in got)
    for e in (base, spec):
        assert e.kv.pool.num_free == e.kv.pool.num_blocks and not e.kv.req_blocks
    # Shapes come from the buckets, whatever was accepted: tokens up to the budget, sampled rows up
    # to a power of two over max_num_seqs * (1 + K).
    rows = {2 ** i for i in range(_bucket(SMALL["max_num_seqs"] * (1 + K), 1).bit_length())}
    tokens = {_fine_bucket(n, 16) for n in range(1, SMALL["max_num_batched_tokens"] + 1)}
    for shape in spec.runner.compiled_shapes:
        assert shape.sample_rows in rows and shape.tokens in tokens
    assert spec.runner.num_compilations <= 2 * len(rows) * len(tokens)


def test_stops_match_plain_decoding(model):
    """On the real (random) model: stop strings, stop token ids and max_tokens give the outputs of
    decoding without speculation."""
    prompts = repetitive(0, 4)
    base = Engine(model, ByteTokenizer(), EngineConfig(**SMALL))
    spec = Engine(model, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **SMALL))
    full = base.generate(prompts, _greedy(14))
    params = []
    for i, o in enumerate(full):
        mid = len(o.text) // 2
        params += [_greedy(14, stop=[o.text[mid : mid + 2]]) if i % 2 == 0 else
                   _greedy(14, stop_token_ids=[o.token_ids[9]])]
    prompts, params = prompts + prompts[1:2], params + [_greedy(5)]
    want = base.generate(prompts, params)
    got = spec.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert (g.text, g.token_ids, g.finish_reason, g.num_output_tokens, len(g.logprobs)) == \
            (w.text, w.token_ids, w.finish_reason, w.num_output_tokens, len(w.logprobs))
    assert [g.finish_reason for g in got] == ["stop"] * 4 + ["length"] and len(got[-1].token_ids) == 5
    assert spec.kv.pool.num_free == spec.kv.pool.num_blocks and not spec.kv.req_blocks


class _ScriptedRunner:
    """A greedy "model" that continues each request with a fixed script: a proposal is kept while it
    matches the script. Stands in for `ModelRunner.step`, so the cuts inside runs of kept proposals can
    be placed on purpose."""

    def __init__(self, runner, script: list[int]):
        self.runner, self.script = runner, script
        self.reached: dict[str, int] = {}  # request id -> output length its last step proposed to reach

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def step(self, out):
        from jmem.serve.runner import StepResult

        res = StepResult({}, {})
        for s in out.seqs:
            if not s.samples:
                continue
            rid, o = s.request.request_id, len(s.request.output_token_ids)
            kept = []
            for x in s.draft_token_ids:
                if x != self.script[o + len(kept)]:
                    break
                kept.append(x)
            res.tokens[rid] = self.script[o + len(kept)]
            self.reached[rid] = o + len(kept) + 1
            res.logprobs[rid] = (-0.5, [])
            if s.draft_token_ids:
                res.accepted[rid] = (kept, [(-0.25, [])] * len(kept))
                res.num_draft_tokens += len(s.draft_token_ids)
                res.num_accepted_tokens += len(kept)
        return res


def test_stops_cut_inside_a_run_of_kept_proposals(model):
    """A stop string, a stop token or EOS inside a step's run of kept proposals ends the output at that
    token, exactly as one token per step would; the tokens after it are dropped with their logprobs."""
    tok = ByteTokenizer()
    enc = lambda t: tok.encode(t, add_bos=False)  # noqa: E731
    # EOS inside the prompt's pattern: proposed, kept, and then it must end the output mid-run.
    prompt = enc("the cat sat.") + [tok.eos_id] + enc(" the")
    script = enc(" cat sat.") + [tok.eos_id] + enc(" the cat ran. the cat sat. the cat")
    text = tok.decode(script)
    cases = [(_greedy(30, stop=["t sat"]), "stop"), (_greedy(30, stop=["sat. t"]), "stop"),
             (_greedy(30, stop_token_ids=[ord("a")]), "stop"), (_greedy(7), "length"),
             (SamplingParams(max_tokens=30, temperature=0.0), "stop")]
    outs = {}
    for k in (0, K):
        engine = Engine(model, tok, EngineConfig(num_speculative_tokens=k, **SMALL))
        engine.runner = _ScriptedRunner(engine.runner, script)
        outs[k] = engine.generate([prompt] * len(cases), [p for p, _ in cases])
        reached = [engine.runner.reached[o.request_id] for o in outs[k]]
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks and not engine.kv.req_blocks
        if k:
            m = engine.metrics()
            assert m["spec_decode_num_accepted_tokens_total"] > 0
            assert m["engine_steps_total"] < len(script)  # several tokens per step
            # The second stop string, the stop token and EOS each fall before the end of a step's run.
            assert [reached[i] > len(outs[k][i].token_ids) for i in (1, 2, 4)] == [True, True, True]
        # The tokens dropped after a stop were not generated output (as one token per step counts).
        assert engine.metrics()["generation_tokens_total"] == sum(o.num_output_tokens for o in outs[k])
    for (p, reason), w, g in zip(cases, outs[0], outs[K], strict=True):
        assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason), (p, g.text)
        assert g.finish_reason == reason
        assert len(g.logprobs) == len(w.logprobs) == (len(g.token_ids) if p.logprobs is not None else 0)
        if p.stop:  # the text up to the stop; the tokens up to the one completing it
            assert g.text == text[: text.find(p.stop[0])]
            n = next(n for n in range(len(script) + 1) if p.stop[0] in tok.decode(script[:n]))
            assert g.token_ids == script[:n]
    assert outs[K][2].token_ids == script[: script.index(ord("a")) + 1]
    assert outs[K][3].token_ids == script[:7]
    assert outs[K][4].token_ids == script[: script.index(tok.eos_id) + 1] and outs[K][4].text == " cat sat."


def test_sampled_speculation_follows_the_target_distribution(model):
    """Seeded sampled requests: the token after the first, where proposals are verified, has the
    frequencies the model's own processed distribution gives it (Pearson, 0.1% level)."""
    fwd = jax.jit(lambda ids: model(ids)[0][0])

    def next_logits(ids):
        buf = np.zeros((1, SMALL["max_model_len"]), np.int32)
        buf[0, : len(ids)] = ids
        return fwd(jnp.asarray(buf))[len(ids) - 1]

    # A prompt [x, y] + tail where x is the likely first output and y likely after it: the first output
    # then often has a match (x at the start) whose proposal (y) is worth verifying.
    def consistent(seed):
        tail = [int(t) for t in np.random.default_rng(seed).integers(0, 256, size=8)]
        prompt = tail
        for _ in range(3):
            x = int(jnp.argmax(next_logits(prompt)))
            prompt = [x, int(jnp.argmax(next_logits(prompt + [x])))] + tail
        x = int(jnp.argmax(next_logits(prompt)))
        ok = x == prompt[0] and x not in prompt[1:] and int(jnp.argmax(next_logits(prompt + [x]))) == prompt[1]
        return prompt if ok else None  # x occurs once, so its lookup proposes y

    prompt = next(p for p in map(consistent, range(20)) if p is not None)
    n = 96
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True, seed=i) for i in range(n)]
    spec = Engine(model, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **SMALL))
    outs = spec.generate([prompt] * n, sp)
    m = spec.metrics()
    assert m["spec_decode_num_draft_tokens_total"] > 0 and m["spec_decode_num_accepted_tokens_total"] > 0
    assert spec.kv.pool.num_free == spec.kv.pool.num_blocks
    sarr = jax.tree.map(jnp.asarray, make_arrays([sp[0]], seeds=[0], steps=[0]))
    V = model.config.vocab_size
    expected, cond = np.zeros(V), {}
    for o in outs:
        t0 = o.token_ids[0]
        if t0 not in cond:
            cond[t0] = np.asarray(jax.nn.softmax(masked_logits(next_logits(prompt + [t0])[None], sarr), axis=-1))[0]
        expected += cond[t0]
    observed = np.bincount([o.token_ids[1] for o in outs], minlength=V)
    stat, df = pearson(observed, expected)
    assert df >= 1 and stat < chi2_critical(df), (stat, df)


def test_flags_are_checked(model, capsys):
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        Engine(model, ByteTokenizer(), EngineConfig(num_speculative_tokens=-1, **SMALL))
    with pytest.raises(ValueError, match="prompt_lookup_max=0"):
        Engine(model, ByteTokenizer(), EngineConfig(num_speculative_tokens=2, prompt_lookup_max=0,
                                                    **SMALL))
    # Wrong types: one line at construction, not a TypeError from the first step.
    for bad in (2.5, "3", True):
        with pytest.raises(ValueError, match=f"num_speculative_tokens={bad!r}; accepted: an integer >= 0"):
            EngineConfig(num_speculative_tokens=bad, **SMALL)
    with pytest.raises(ValueError, match="draft_model='tiny'; accepted: a model"):
        Engine(model, ByteTokenizer(), EngineConfig(num_speculative_tokens=2, **SMALL), draft_model="tiny")
    with pytest.raises(ValueError, match=r"lora_modules=\['a.npz'\]; accepted: a dict"):
        Engine(model, ByteTokenizer(), EngineConfig(**SMALL), lora_modules=["a.npz"])
    from jmem.serve.cli import serve_main

    for flags, msg in [(["--num-speculative-tokens", "-2"], "--num-speculative-tokens=-2; accepted: >= 0"),
                       (["--num-speculative-tokens", "2", "--prompt-lookup-max", "0"], "--prompt-lookup-max=0")]:
        with pytest.raises(SystemExit) as exit_info:
            serve_main(["--model", "tiny", *flags])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"jmem serve: error: {msg}"), lines
