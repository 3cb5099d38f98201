"""Batched sampling against a per-row numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.serve.request import SamplingParams
from jmem.sampling import apply_penalties, argmax_last, make_arrays, masked_logits, sample

V = 50


def ref_mask(logits, p: SamplingParams):
    """One row, written the slow obvious way (a sort, then walks down it), in vLLM's order: top-k and
    min-p, then top-p over the renormalised distribution they leave."""
    x = logits / p.temperature
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    first = np.zeros(x.shape[0], bool)
    for rank, i in enumerate(order):
        first[i] = rank == 0 or ((p.top_k <= 0 or rank < p.top_k) and probs[i] >= p.min_p * probs[order[0]])
    left = np.where(first, probs, 0.0) / probs[first].sum()
    keep = np.zeros(x.shape[0], bool)
    mass = 0.0
    for rank, i in enumerate(order):
        keep[i] = first[i] and (mass < p.top_p or rank == 0)
        mass += left[i]
    return np.where(keep, x, -np.inf)


def ref_penalties(logits, p: SamplingParams, prompt, out):
    x = logits.copy()
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


PARAMS = [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.5, top_k=10, top_p=0.9, min_p=0.05),
]


def test_masks_match_reference():
    logits = np.random.default_rng(1).normal(size=(4, V)).astype(np.float32) * 3
    s = make_arrays(PARAMS, seeds=[0] * 4, steps=[0] * 4)
    got = np.asarray(masked_logits(jnp.asarray(logits), s))
    for i, p in enumerate(PARAMS):
        want = ref_mask(logits[i], p)
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want))
        np.testing.assert_allclose(got[i][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)


def test_masks_match_reference_on_random_settings():
    # Many rows, a larger vocabulary, every filter alone and combined, down to k = 1 and tiny top_p.
    rng = np.random.default_rng(4)
    n, vocab = 48, 700
    logits = (rng.normal(size=(n, vocab)) * rng.uniform(0.5, 4, size=(n, 1))).astype(np.float32)
    params = [SamplingParams(temperature=float(rng.uniform(0.3, 2.0)),
                             top_k=int(rng.choice([0, 1, 2, 7, 50, vocab - 1, vocab])),
                             top_p=float(rng.choice([1.0, 0.99, 0.9, 0.5, 0.05, 1e-4])),
                             min_p=float(rng.choice([0.0, 0.0, 0.01, 0.3]))) for _ in range(n)]
    s = make_arrays(params, seeds=[0] * n, steps=[0] * n)
    got = np.asarray(jax.jit(masked_logits)(jnp.asarray(logits), s))
    for i, p in enumerate(params):
        want = ref_mask(logits[i], p)
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want), err_msg=str(p))


def test_penalties_match_reference():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0)]
    hist = [([1, 2, 3, 3], [3, 7, 7, 7]), ([4], [5, 4])]
    s = make_arrays(params, seeds=[0, 0], steps=[0, 0], histories=hist, hist_len=10)
    got = np.asarray(apply_penalties(jnp.asarray(logits), s))
    for i, p in enumerate(params):
        np.testing.assert_allclose(got[i], ref_penalties(logits[i], p, *hist[i]), rtol=1e-6)


def test_sample_greedy_seeded_and_within_mask():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(6, V)).astype(np.float32) * 2)
    params = [SamplingParams(temperature=0.0, logprobs=5)] + PARAMS + [SamplingParams(temperature=0.0)]
    fn = jax.jit(sample)
    s = make_arrays(params, seeds=[1, 2, 3, 4, 5, 6], steps=[0] * 6, batch=8)
    pad = jnp.concatenate([logits, jnp.zeros((2, V))])
    tok, lp, top_lp, top_ids = fn(pad, s)
    tok = np.asarray(tok)
    assert tok[0] == np.argmax(logits[0]) and tok[5] == np.argmax(logits[5])
    lsm = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(np.asarray(lp)[:6], lsm[np.arange(6), tok[:6]], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids)[:6, 0], np.argmax(lsm, -1))
    np.testing.assert_allclose(np.asarray(top_lp)[:6], -np.sort(-lsm, axis=-1)[:, :20], rtol=1e-5)
    # No row asks for log-probabilities: the top ones are skipped (zeros), the tokens are the same.
    s0 = make_arrays([SamplingParams(temperature=0.0)] + params[1:], seeds=[1, 2, 3, 4, 5, 6], steps=[0] * 6, batch=8)
    tok0, lp0, top_lp0, top_ids0 = fn(pad, s0)
    np.testing.assert_array_equal(np.asarray(tok0), tok)
    np.testing.assert_array_equal(np.asarray(lp0), np.asarray(lp))
    assert not np.asarray(top_lp0).any() and not np.asarray(top_ids0).any()
    # Same seed and step, different batch position and neighbours: same token.
    s2 = make_arrays(params[::-1], seeds=[6, 5, 4, 3, 2, 1], steps=[0] * 6, batch=8)
    tok2 = np.asarray(fn(jnp.concatenate([logits[::-1], jnp.zeros((2, V))]), s2)[0])
    np.testing.assert_array_equal(tok2[:6][::-1], tok[:6])
    # Many draws: every one inside the row's mask, and more than one distinct token appears.
    for i, p in enumerate(PARAMS, start=1):
        allowed = np.isfinite(ref_mask(np.asarray(logits[i]), p))
        draws = []
        for step in range(40):
            si = make_arrays([p] * 8, seeds=[7] * 8, steps=[step * 8 + j for j in range(8)])
            draws += list(np.asarray(fn(jnp.broadcast_to(logits[i], (8, V)), si)[0]))
        assert allowed[draws].all(), p
        if allowed.sum() > 1:
            assert len(set(draws)) > 1


def _filtered_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """float64 reference in vLLM's order: softmax(logits / T); top-k and min-p; top-p on what they left."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    keep = p >= min_p * p.max()
    if 0 < top_k < len(p):
        keep &= logits >= np.sort(logits)[-top_k]
    q = np.where(keep, p, 0.0) / p[keep].sum()
    order = np.argsort(-q, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])  # mass of the likelier tokens
    keep[order[before >= top_p]] = False
    return np.where(keep, p, 0.0) / p[keep].sum()


@pytest.mark.parametrize("settings", [dict(temperature=0.8), dict(temperature=1.7), dict(temperature=0.5, top_k=3),
                                      dict(temperature=1.0, top_p=0.7),
                                      dict(temperature=0.8, top_k=4, top_p=0.8, min_p=0.1)])
def test_sample_frequencies_follow_distribution(settings):
    """Draw frequencies follow the filtered softmax(logits / T), each within 5 standard errors of 20k draws
    (256 draws let a temperature of 1 or 1.2 pass for 0.8)."""
    logits = np.asarray([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0] + [-30.0] * (V - 7), np.float32)
    n = 20_000
    s = make_arrays([SamplingParams(**settings)] * n, seeds=list(range(n)), steps=[0] * n)
    tok = np.asarray(jax.jit(sample)(jnp.broadcast_to(jnp.asarray(logits), (n, V)), s)[0])
    want = _filtered_probs(logits.astype(np.float64), **settings)
    freq = np.bincount(tok, minlength=V) / n
    assert not freq[want == 0].any()  # nothing filtered out is drawn
    se = np.sqrt(want * (1 - want) / n)
    assert (np.abs(freq - want)[want > 0] < 5 * se[want > 0]).all(), (freq[:7], want[:7])


def test_a_temperature_too_small_to_divide_by_samples_greedily():
    """Logits / 1e-30 overflow f32 (NaN rows whose argmax was token 0); below GREEDY_BELOW the row is greedy."""
    from jmem.generate import SamplingParams as GenerateParams
    from jmem.sampling import GREEDY_BELOW

    logits = jnp.asarray(np.random.default_rng(5).normal(size=(4, V)).astype(np.float32) * 4)
    temps = [1e-30, 1e-12, GREEDY_BELOW / 2, 0.0]
    s = make_arrays([SamplingParams(temperature=t, top_k=5) for t in temps], seeds=[1] * 4, steps=[0] * 4)
    np.testing.assert_array_equal(np.asarray(jax.jit(sample)(logits, s)[0]), np.argmax(np.asarray(logits), -1))
    assert GenerateParams(temperature=1e-30).greedy and not GenerateParams(temperature=GREEDY_BELOW).greedy


def test_argmax_last_equals_argmax_with_ties_infinities_and_nan():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 1000)).astype(np.float32)
    x[1, [3, 500]] = 10.0  # ties: the first index
    x[2] = -np.inf  # a row masked out entirely
    x[3, 7], x[3, 9] = np.inf, np.inf
    x[4, 20], x[4, 10] = np.nan, np.inf  # NaN wins over inf, wherever it is
    x[5, [30, 40]] = np.nan
    x[6] = np.round(x[6])  # many ties
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    got = np.asarray(jax.jit(argmax_last)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, want)
    assert list(want[1:6]) == [3, 0, 7, 20, 30]


def test_a_seed_is_64_bits_and_one_below_2_to_the_32_keys_as_before():
    from jmem.sampling import row_keys

    seeds = [0, 7, 2**32, 2**32 + 7, 2**64 - 1, 2**32 - 1]
    keys = jax.random.key_data(row_keys(make_arrays([SamplingParams()] * 6, seeds=seeds, steps=[3] * 6)))
    assert len({tuple(np.asarray(k).tolist()) for k in keys}) == 6  # no two seeds share a key
    for i, seed in ((0, 0), (1, 7), (5, 2**32 - 1)):
        want = jax.random.key_data(jax.random.fold_in(jax.random.key(np.uint32(seed)), 3))
        np.testing.assert_array_equal(keys[i], want)
