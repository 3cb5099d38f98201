"""OpenAI's logit_bias and vLLM's min_tokens: the sampler's sparse biases against adding them to dense
logits, and the engine's tokens against a full-forward greedy reference that applies them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.io.tokenizer import ByteTokenizer
from jmem.models import Llama, LlamaConfig
from jmem.sampling import make_arrays, sample
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.request import SamplingParams

MAX_LEN = 64
SMALL = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_LEN)


def test_sparse_biases_equal_dense_logits_plus_biases():
    """Fresh random logits and biases (bans, padding, greedy and seeded rows): `sample` with the bias
    arrays draws what it draws from the dense biased logits without them."""
    rng = np.random.default_rng(0)
    B, V = 6, 300
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    biases = [{int(t): float(rng.uniform(-100, 100)) for t in rng.choice(V, size=rng.integers(0, 9), replace=False)}
              for _ in range(B)]
    biases[0][int(np.argmax(logits[0]))] = -np.inf  # the greedy pick banned
    dense = logits.copy()
    for i, row in enumerate(biases):
        for t, v in row.items():
            dense[i, t] += v
    params = [SamplingParams(temperature=t, top_k=k) for t, k in
              [(0.0, 0), (0.0, 0), (0.8, 0), (1.0, 20), (1.3, 5), (0.5, 0)]]
    seeds, steps = list(range(10, 10 + B)), [3] * B
    with_bias = make_arrays(params, seeds, steps, biases=biases, bias_len=16)
    assert (with_bias.bias_ids[:, 8:] == -1).all()  # padding ids are dropped
    got = jax.jit(sample)(jnp.asarray(logits), with_bias)
    want = jax.jit(sample)(jnp.asarray(dense), make_arrays(params, seeds, steps))
    np.testing.assert_array_equal(got[0], want[0])
    assert int(got[0][0]) != int(np.argmax(logits[0])) and int(got[0][0]) == int(np.argmax(dense[0]))
    # Log-probabilities stay those of the model's own distribution.
    raw = jax.nn.log_softmax(jnp.asarray(logits), -1)
    np.testing.assert_allclose(got[1], np.take_along_axis(np.asarray(raw), np.asarray(got[0])[:, None], 1)[:, 0],
                               rtol=1e-6)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward(model):
    return jax.jit(lambda ids: model(ids)[0][0])


def reference(forward, prompt, max_tokens, bias_at=lambda step: {}, stop_ids=(), min_tokens=0):
    """Greedy tokens from the full forward pass, `bias_at(step)` added to the logits, ending at a stop
    id from `min_tokens` tokens on."""
    ids, out = list(prompt), []
    for step in range(max_tokens):
        buf = np.zeros((1, MAX_LEN), np.int32)
        buf[0, : len(ids)] = ids
        logits = np.asarray(forward(jnp.asarray(buf)))[len(ids) - 1].copy()
        for t, v in bias_at(step).items():
            logits[t] += v
        t = int(np.argmax(logits))
        out.append(t), ids.append(t)
        if t in stop_ids and len(out) >= min_tokens:
            break
    return out


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, ByteTokenizer(), EngineConfig(num_blocks=24, **SMALL))


def test_logit_bias_forces_and_bans_tokens(engine, forward):
    tok = ByteTokenizer()
    p = tok.encode("abc")
    free = reference(forward, p, 8)
    [forced] = engine.generate([p], greedy(6, logit_bias={ord("Z") + 3: 100.0}))
    assert forced.token_ids == reference(forward, p, 6, lambda s: {ord("Z") + 3: 100.0})
    banned = {free[0]: -100.0, free[1]: -100.0}
    [o] = engine.generate([p], greedy(8, logit_bias=banned))
    assert o.token_ids == reference(forward, p, 8, lambda s: banned)
    assert free[0] not in o.token_ids and free[1] not in o.token_ids
    assert engine.kv.pool.num_used == 0


def test_min_tokens_bans_stop_ids_and_stop_strings_until_reached(engine, forward):
    tok = ByteTokenizer()
    p = tok.encode("abc")
    free = reference(forward, p, 12)
    stop_id = free[1]
    [early] = engine.generate([p], greedy(12, stop_token_ids=[stop_id]))
    assert early.token_ids == free[:2] and (early.finish_reason, early.stop_reason) == ("stop", stop_id)
    # The stop id cannot be drawn before 5 tokens: the reference bans it there too.
    [o] = engine.generate([p], greedy(12, stop_token_ids=[stop_id], min_tokens=5))
    want = reference(forward, p, 12, lambda s: {stop_id: -np.inf} if s < 5 else {}, stop_ids=(stop_id,), min_tokens=5)
    assert o.token_ids == want and len(o.token_ids) >= 5
    # EOS likewise (the model's EOS id, unless ignore_eos).
    eos = engine.eos_ids[0]
    [o] = engine.generate([p], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6,
                                              logit_bias={eos: 100.0}))
    assert len(o.token_ids) == 6 and eos not in o.token_ids and (o.finish_reason, o.stop_reason) == ("length", None)
    [o] = engine.generate([p], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={eos: 100.0}))
    assert (o.token_ids, o.finish_reason, o.stop_reason) == ([eos], "stop", None)  # EOS: no stop_reason (vLLM)
    # A stop string met before min_tokens does not end the output; the first ending in a token from
    # min_tokens on does (as vLLM). Forced to "x" every token: stop "xx" at min_tokens 4 cuts 4 tokens
    # to "xx" (the match ending in the 4th).
    x = tok.encode("x")[0]
    [o] = engine.generate([p], greedy(10, stop=["xx"], min_tokens=4, logit_bias={x: 100.0}))
    assert (o.text, o.token_ids, o.finish_reason, o.stop_reason) == ("xx", [x] * 4, "stop", "xx")
    [o] = engine.generate([p], greedy(10, stop=["xxx", "xx"], logit_bias={x: 100.0}))
    assert (o.text, o.token_ids, o.finish_reason, o.stop_reason) == ("", [x] * 2, "stop", "xx")


def test_min_tokens_with_speculation_gives_the_same_tokens(model):
    """Prompt-lookup speculation: each verified position bans by its own step."""
    tok = ByteTokenizer()
    p = tok.encode("abcabcabcabcabc")
    plain = Engine(model, tok, EngineConfig(num_blocks=24, **SMALL))
    spec = Engine(model, tok, EngineConfig(num_blocks=24, num_speculative_tokens=3, prompt_lookup_max=3, **SMALL))
    [free] = plain.generate([p], greedy(10))
    params = greedy(10, stop_token_ids=[free.token_ids[0]], min_tokens=4, logit_bias={free.token_ids[2]: -5.0})
    [a] = plain.generate([p], params)
    [b] = spec.generate([p], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) >= 4
    assert spec.stats["spec_draft_tokens"] > 0  # proposals were verified


@pytest.mark.parametrize("params, message", [
    (greedy(4, min_tokens=5), r"min_tokens=5 is out of range; accepted: 0..max_tokens \(4\)"),
    (greedy(4, min_tokens=-1), r"min_tokens=-1 is out of range"),
    (greedy(4, min_tokens=1.5), r"min_tokens=1.5; accepted: an integer"),
    (greedy(4, logit_bias={5: 101}), r"logit_bias\[5\]=101 is out of range; accepted: a number in -100..100"),
    (greedy(4, logit_bias={5: float("nan")}), r"logit_bias\[5\]=nan is out of range"),
    (greedy(4, logit_bias={5: "x"}), r"logit_bias\[5\]='x' is a str; accepted: a number in -100..100"),
    (greedy(4, logit_bias={"5": 1.0}), r"logit_bias key '5' is not a token id; accepted: integer token ids"),
    (greedy(4, logit_bias=[5]), r"logit_bias=\[5\]; accepted: a map of token ids to numbers"),
    (greedy(4, logit_bias={10_000: 1.0}), r"logit_bias holds token id 10000; accepted: 0..258"),
])
def test_bad_values_are_one_error(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request([5, 6], params)
