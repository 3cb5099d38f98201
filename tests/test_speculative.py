"""Speculative decoding: greedy output equals the target's greedy generation, the acceptance rule
preserves the target's distribution, and bad input is one clear error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.distill import student_from_teacher
from jmem.generate import generate_ids
from jmem.models import Llama, LlamaConfig
from jmem.speculative import accept, speculative_generate

PROMPTS = [[5, 17, 42], list(range(30, 49)), [7]]


@pytest.fixture(scope="module")
def models():
    target = Llama(LlamaConfig.tiny(n_layers=4), rngs=nnx.Rngs(0))
    return target, student_from_teacher(target, [0, 1, 2])  # a layer-dropped draft: some proposals accepted


def test_greedy_equals_the_targets_greedy_generation(models):
    target, draft = models
    want = generate_ids(target, PROMPTS, 14)
    got, stats = speculative_generate(target, draft, PROMPTS, 14, k=3)
    assert got == want
    assert 0 < stats.accepted < stats.proposed  # rows advance by different amounts
    # The target drafting for itself: every proposal accepted, k + 1 tokens per target pass.
    same, full = speculative_generate(target, target, PROMPTS, 14, k=3)
    assert same == want
    assert full.acceptance_rate == 1.0 and full.tokens_per_target_pass > 3.0


def test_a_k_above_max_new_tokens_drafts_max_new_tokens(models):
    """A k of a million sized the caches and the draft scan by k (an out-of-memory error); a row never
    keeps more than max_new_tokens proposals, so no more are drafted."""
    target, draft = models
    out, stats = speculative_generate(target, draft, PROMPTS, 4, k=10**6)
    assert out == generate_ids(target, PROMPTS, 4) and stats.proposed == 4 * stats.row_passes


def test_a_draft_generates_up_to_the_context_as_plain_generation_does():
    """prompt + max_new_tokens may fill the context (a draft's k was added to the limit: refused there); the
    proposals past it are scored and dropped, so the tokens equal the target's own up to the last position."""
    target = Llama(LlamaConfig.tiny(n_layers=2, max_seq_len=24), rngs=nnx.Rngs(0))
    draft = student_from_teacher(target, [0])
    prompts = [[5, 17, 42], [7]]
    for d in (draft, target):  # some proposals kept; every one kept
        got, _ = speculative_generate(target, d, prompts, 21, k=4)
        assert got == generate_ids(target, prompts, 21)
    with pytest.raises(ValueError, match=r"prompt \(3 tokens\) \+ max_new_tokens \(22\) exceeds the models' "
                                         r"context of 24 tokens"):
        speculative_generate(target, draft, prompts, 22, k=4)


def test_tokens_per_target_pass_is_per_row(models):
    """Tokens kept in the output after the prefill over row-passes: the same for 1 row as for 4 alike,
    k + 1 with the target drafting for itself (cut only by max_new_tokens), 1.0 when nothing is accepted."""
    target, _ = models
    one_out, one = speculative_generate(target, target, PROMPTS[:1], 8, k=4)
    four_out, four = speculative_generate(target, target, PROMPTS[:1] * 4, 8, k=4)
    assert four_out == one_out * 4 and len(one_out[0]) == 8
    # The prefill gives token 1; round 1 keeps 5 (4 accepted + 1), round 2 keeps the last 2 of its 5.
    assert (one.rounds, one.row_passes, one.emitted, one.accepted, one.proposed) == (2, 2, 7, 8, 8)
    assert (four.rounds, four.row_passes, four.emitted, four.accepted, four.proposed) == (2, 8, 28, 32, 32)
    assert one.tokens_per_target_pass == four.tokens_per_target_pass == 3.5
    assert one.acceptance_rate == four.acceptance_rate == 1.0
    long_out, long = speculative_generate(target, target, PROMPTS[:1] * 2, 41, k=4)  # 40 after the prefill: 8 x 5
    assert long.tokens_per_target_pass == 5.0 and long.emitted == 80 and long.row_passes == 16
    # A draft of zeros proposes token 0 every time, which the target's greedy continuation never holds.
    graphdef, state = nnx.split(target)
    zeros = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, state))
    want = generate_ids(target, PROMPTS, 14)
    assert not any(0 in row for row in want)
    got, rejected = speculative_generate(target, zeros, PROMPTS, 14, k=3)
    assert got == want
    assert (rejected.accepted, rejected.rounds, rejected.row_passes, rejected.emitted) == (0, 13, 39, 39)
    assert rejected.tokens_per_target_pass == 1.0 and rejected.acceptance_rate == 0.0


def test_acceptance_rule_keeps_the_targets_distribution():
    """Proposals drawn from q, kept with min(1, p/q), the first rejection redrawn from
    max(0, p - q): the first emitted token is distributed as p (Leviathan et al. 2023, thm 1)."""
    V, N = 5, 40_000
    p_logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1],
                                  [0.2, 0.2, 0.2, 0.2, 0.2]]))[None]
    q = jnp.array([[0.1, 0.4, 0.3, 0.1, 0.1], [0.3, 0.3, 0.1, 0.2, 0.1]])[None]

    def one(key):
        k_prop, k_acc = jax.random.split(key)
        props = jax.random.categorical(k_prop, jnp.log(q), axis=-1).astype(jnp.int32)  # [1, K]
        n, nxt = accept(p_logits, q, props, k_acc, 1.0, greedy=False)
        first = jnp.where(n[0] > 0, props[0, 0], nxt[0])
        second = jnp.where(n[0] > 1, props[0, 1], nxt[0])
        return first, second, n[0]

    first, second, n = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), N))
    freq = np.bincount(np.asarray(first), minlength=V) / N
    np.testing.assert_allclose(freq, np.exp(np.asarray(p_logits[0, 0])), atol=0.01)
    # Given the first proposal was kept, the second place follows p's second row.
    kept = np.asarray(n) >= 1
    freq2 = np.bincount(np.asarray(second)[kept], minlength=V) / kept.sum()
    np.testing.assert_allclose(freq2, np.exp(np.asarray(p_logits[0, 1])), atol=0.015)
    # Greedy: keep proposals equal to the argmax, then the argmax.
    n_g, next_g = accept(p_logits, q, jnp.array([[0, 1]], jnp.int32), None, 1.0, greedy=True)
    assert int(n_g[0]) == 1 and int(next_g[0]) == 2


def test_sampled_tokens_follow_the_targets_tempered_distribution():
    """End to end at temperature 0.5 (the draft's q tempered like the target's p): the token verified
    after the first has the target's marginal (Pearson, 0.1% level) over many identical rows."""
    from scipy.stats import chisquare

    target = Llama(LlamaConfig.tiny(n_layers=2, vocab_size=12), rngs=nnx.Rngs(1))
    draft = student_from_teacher(target, [0])
    prompt, rows, temp = [3, 7, 5], 4000, 0.5
    out, stats = speculative_generate(target, draft, [prompt] * rows, 2, k=2, temperature=temp, seed=0)
    assert 0 < stats.accepted < stats.proposed
    probs = lambda ids: np.asarray(jax.nn.softmax(target(jnp.asarray([ids]))[0][0, -1] / temp), np.float64)  # noqa
    first = probs(prompt)
    second = sum(first[x] * probs(prompt + [x]) for x in range(12))
    for pos, want in ((0, first), (1, second)):
        counts = np.bincount([r[pos] for r in out], minlength=12)
        assert chisquare(counts, want / want.sum() * rows).pvalue > 1e-3, (pos, counts, want * rows)


def test_sampling_runs_stops_at_eos_and_is_seeded(models):
    target, draft = models
    a, _ = speculative_generate(target, draft, PROMPTS, 10, k=2, temperature=1.0, seed=3)
    b, _ = speculative_generate(target, draft, PROMPTS, 10, k=2, temperature=1.0, seed=3)
    assert a == b and all(len(r) == 10 for r in a)
    eos = a[0][4]
    c, _ = speculative_generate(target, draft, PROMPTS, 10, k=2, temperature=1.0, seed=3, eos_id=eos)
    assert c[0] == a[0][:a[0].index(eos)]
    for t in (np.float32(1.0), jnp.float32(1.0)):  # NumPy and JAX scalars are numbers too
        assert speculative_generate(target, draft, PROMPTS, 10, k=2, temperature=t, seed=3)[0] == a
    assert speculative_generate(target, draft, PROMPTS, 10, k=2, temperature=1.0, seed=np.int64(3))[0] == a
    # Every bit of a 64-bit seed counts: seeds equal in their low 32 bits draw differently.
    draws = {str(speculative_generate(target, draft, PROMPTS, 10, k=2, temperature=1.0, seed=s)[0])
             for s in (3, 3 + 2**32, 3 + 2**40)}
    assert len(draws) == 3


@pytest.mark.parametrize("kwargs, expected", [
    (dict(k=0), "k=0; accepted: an integer >= 1"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(temperature=True), "temperature=True; accepted: a finite number >= 0"),
    (dict(temperature=jnp.ones(2)), "accepted: a finite number >= 0"),
    (dict(temperature=0.5, seed="x"), "seed='x'; accepted: an integer"),
    (dict(temperature=0.5, seed=1.5), "seed=1.5; accepted: an integer"),
    (dict(seed=True), "seed=True; accepted: an integer"),
    (dict(seed=2**64), r"seed=18446744073709551616; accepted: an integer in \[-2\*\*63, 2\*\*64)"),
    (dict(prompts=[[]]), "prompt 0 has no tokens"),
    (dict(prompts=[[1, 10_000]]), "prompt 0 holds 10000; accepted: integer token ids"),
    (dict(max_new_tokens=10_000), "exceeds the models' context"),
    (dict(eos_id=-1), "eos_id=-1; accepted: a token id in 0..258, or None"),  # ran, and never matched
    (dict(eos_id="x"), "eos_id='x'; accepted: a token id"),
    (dict(draft="draft"), "draft='draft'; accepted: a jmem.models.Llama model"),
])
def test_bad_input_is_one_clear_error(models, kwargs, expected):
    target, draft = models
    args = dict(prompts=PROMPTS, max_new_tokens=4, draft=draft) | kwargs
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        speculative_generate(target, args.pop("draft"), args.pop("prompts"), args.pop("max_new_tokens"), **args)
    other = Llama(LlamaConfig.tiny(vocab_size=300), rngs=nnx.Rngs(2))
    with pytest.raises(ValueError, match="draft vocab_size=300 differs"):
        speculative_generate(target, other, PROMPTS, 4)


def test_lora_dropout_keys_do_not_reach_inference():
    """A model still carrying LoRA dropout keys (set for training) drafted and verified with dropout on,
    so greedy speculation was not the target's greedy continuation; generate_ids drops the keys."""
    from jmem.lora import LoRA, apply_lora, set_dropout_key

    target = apply_lora(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), rank=4, dropout=0.5)
    for var in (target.layers.wq.kernel, target.layers.wv.kernel):  # B = 0 would make the adapters no-ops
        lo = var.get_value()
        var.set_value(LoRA(lo.base, lo.lora_a, jnp.full_like(lo.lora_b, 0.5), lo.alpha, lo.dropout, lo.rslora))
    clean = generate_ids(target, PROMPTS, 12)
    set_dropout_key(target, jax.random.key(1))
    assert generate_ids(target, PROMPTS, 12) == clean
    assert speculative_generate(target, target, PROMPTS, 12, k=3)[0] == clean


def test_stop_strings_end_rows_early_and_the_text_streams(models):
    """`stop(row, ids)` after each round, as generate_ids calls it: with `jmem.lm.CompletionWatch` a greedy
    speculative completion ends at a stop string where the plain one does (fewer rounds than without it),
    and the streamed pieces join to it."""
    from jmem.io.tokenizer import ByteTokenizer
    from jmem.lm import LM, CompletionWatch

    target, draft = models
    lm, tok = LM(target, ByteTokenizer()), ByteTokenizer()
    text = lm.generate(["abc"], max_new_tokens=40)[0]
    stop = [text[12:14]]
    want = lm.generate(["abc"], max_new_tokens=40, stop=stop)[0]
    assert len(want) < len(text)
    pieces = []
    watch = CompletionWatch(tok, stop, on_text=pieces.append)
    out, stats = speculative_generate(target, draft, [tok.encode("abc")], 40, k=3, stop=watch.stop)
    assert watch.finish(out[0]) == want == "".join(pieces) and len(pieces) >= 2
    _, full = speculative_generate(target, draft, [tok.encode("abc")], 40, k=3)
    assert stats.rounds < full.rounds
    # emitted counts what the rounds left in the output: here the one token after the prefill's.
    out, stats = speculative_generate(target, target, [[5, 6, 7]], 10, k=4,
                                      stop=lambda row, ids: 2 if len(ids) >= 2 else None)
    assert len(out[0]) == 2 and (stats.emitted, stats.tokens_per_target_pass) == (1, 1.0)
    with pytest.raises(ValueError, match=r"stop\(row=0, ids\) returned -1; accepted: None, or how many"):
        speculative_generate(target, draft, [[5, 6]], 8, k=3, stop=lambda row, ids: -1)
