"""Speculative decoding: a small draft model proposes `k` tokens, the target verifies them in one pass.

Each round (one jitted call) the draft decodes `k` tokens autoregressively from
every row's last token, the target scores the last token and the `k` proposals
in one forward of `k + 1` positions, and each row keeps the longest prefix of
proposals the target accepts plus one token of the target's own, so every
round emits 1 to `k + 1` tokens for one target pass. Acceptance follows
Leviathan et al. 2023 / Chen et al. 2023: proposal `d` drawn from the draft's
`q` is kept with probability `min(1, p(d) / q(d))`; the first rejected place
draws from `normalize(max(0, p - q))`; when all `k` are kept a bonus token is
drawn from the target's next distribution. The emitted tokens are distributed
exactly as the target's own samples; greedy (temperature 0) emits exactly the
target's greedy continuation in f32 (with bf16 compute, a near-tie between two
tokens may resolve differently: the target scores k+1 tokens per forward, not one).

Both models keep a contiguous KV cache. Rows advance by different amounts:
every write lands at the token's absolute position, so entries a row wrote for
rejected proposals sit past its position and are overwritten before any query
reads them. The draft's first call of a round feeds the row's previous token
again beside its last one, so its cache also holds the last proposal when all
of them were accepted.

Example:
    >>> out, stats = speculative_generate(target, draft, [[1, 2, 3]], max_new_tokens=64, k=4)
    >>> stats.acceptance_rate
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem.checks import as_python_scalar, check_int, check_llama, is_int, is_number
from jmem.generate import apply_stop, check_prompt_ids
from jmem.lora import has_dropout_keys, without_dropout
from jmem.models.cache import ContiguousKVCache
from jmem.sampling import GREEDY_BELOW, seed_key


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """What the rounds did, summed over rows.

    rounds: target passes after the prompt's (each verifies every row still generating);
    row_passes: rows verified, summed over rounds; proposed / accepted: draft tokens the
    target checked and kept; emitted: tokens the rounds added to the output (up to
    max_new_tokens; an EOS that ends a row counts, as the token its pass produced).
    """

    rounds: int
    proposed: int
    accepted: int
    emitted: int
    row_passes: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals over proposals made."""
        return self.accepted / max(self.proposed, 1)

    @property
    def tokens_per_target_pass(self) -> float:
        """Tokens a row gets per target pass after the prompt's: `emitted / row_passes`, the same
        for one row as for many alike; 1.0 when no proposal is accepted, up to k + 1 when all are."""
        return self.emitted / max(self.row_passes, 1)


def _draw(logits_BV, key, temperature, greedy: bool):
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BV / temperature, axis=-1).astype(jnp.int32)


def accept(p_logits_BKV, q_BKV, proposals_BK, key, temperature, *, greedy: bool):
    """The verification rule: how many proposals each row keeps and the token after them.

    Args:
        p_logits_BKV: target logits f32[batch, k + 1, vocab]; place i scores the token after
            the row's last token and its first i proposals.
        q_BKV: the draft's probabilities f32[batch, k, vocab] the proposals were drawn from
            (unused when greedy).
        proposals_BK: i32[batch, k].
        key: PRNG key (unused when greedy); temperature: f32 > 0 (unused when greedy).
        greedy: keep proposals equal to the target's argmax; the next token is its argmax.

    Returns:
        (n_B i32: proposals kept, 0..k; next_B i32: the target's token at place n)
    """
    B, K = proposals_BK.shape
    if greedy:
        best_BK1 = jnp.argmax(p_logits_BKV, axis=-1).astype(jnp.int32)
        n_B = jnp.sum(jnp.cumprod(proposals_BK == best_BK1[:, :K], axis=1), axis=1)
        return n_B, jnp.take_along_axis(best_BK1, n_B[:, None], axis=1)[:, 0]
    k_accept, k_next = jax.random.split(key)
    p_BKV = jax.nn.softmax(p_logits_BKV / temperature, axis=-1)
    p_d = jnp.take_along_axis(p_BKV[:, :K], proposals_BK[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q_BKV, proposals_BK[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_accept, (B, K))
    n_B = jnp.sum(jnp.cumprod(u * q_d < p_d, axis=1), axis=1)  # keep while u < p/q
    q_pad = jnp.concatenate([q_BKV, jnp.zeros_like(q_BKV[:, :1])], axis=1)  # place k: the bonus, from p
    p_n = jnp.take_along_axis(p_BKV, n_B[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(q_pad, n_B[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(p_n - q_n, 0.0)
    resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p_n)  # p == q: any draw from p
    next_B = jax.random.categorical(k_next, jnp.log(resid), axis=-1).astype(jnp.int32)
    return n_B, next_B


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _prefill(graphdef, state, ids_BT, lengths_B, cache):
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden(ids_BT, cache=cache)
    h_last = jnp.take_along_axis(h, (lengths_B - 1)[:, None, None], axis=1)
    return model.logits_from_hidden(h_last)[:, 0], cache


@functools.partial(jax.jit, static_argnames=("t_def", "d_def", "k", "greedy"), donate_argnames=("t_cache", "d_cache"))
def _round(t_def, t_state, d_def, d_state, t_cache, d_cache, prev_B, last_B, pos_B, key, temperature, *, k, greedy):
    """One round: k draft steps, one target pass over k + 1 places, acceptance."""
    target, draft = nnx.merge(t_def, t_state), nnx.merge(d_def, d_state)
    keys = jax.random.split(key, k + 1)
    two_BT = jnp.stack([prev_B, last_B], axis=1)
    h, d_cache = draft.hidden(two_BT, positions=jnp.stack([pos_B - 1, pos_B], axis=1), cache=d_cache)
    logits_BV = draft.logits_from_hidden(h[:, -1:])[:, 0]

    def propose(carry, xs):
        logits_BV, d_cache = carry
        i, key = xs
        tok_B = _draw(logits_BV, key, temperature, greedy)
        q_BV = jax.nn.softmax(logits_BV / temperature, axis=-1)
        h, d_cache = draft.hidden(tok_B[:, None], positions=(pos_B + 1 + i)[:, None], cache=d_cache)
        return (draft.logits_from_hidden(h)[:, 0], d_cache), (tok_B, q_BV)

    (logits_BV, d_cache), (toks_KB, q_KBV) = jax.lax.scan(
        propose, (logits_BV, d_cache), (jnp.arange(k - 1), keys[:k - 1]))
    last_tok_B = _draw(logits_BV, keys[k - 1], temperature, greedy)
    proposals_BK = jnp.concatenate([toks_KB.T, last_tok_B[:, None]], axis=1)
    q_BKV = jnp.concatenate([jnp.moveaxis(q_KBV, 0, 1), jax.nn.softmax(logits_BV / temperature)[:, None]], axis=1)

    ids_BK1 = jnp.concatenate([last_B[:, None], proposals_BK], axis=1)
    positions = pos_B[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    h, t_cache = target.hidden(ids_BK1, positions=positions, cache=t_cache)
    n_B, next_B = accept(target.logits_from_hidden(h), q_BKV, proposals_BK, keys[k], temperature, greedy=greedy)

    place = jnp.arange(k + 1)[None, :]
    out_BK1 = jnp.where(place < n_B[:, None], jnp.pad(proposals_BK, ((0, 0), (0, 1))), next_B[:, None])
    new_prev_B = jnp.where(n_B > 0, jnp.take_along_axis(proposals_BK, jnp.maximum(n_B - 1, 0)[:, None], 1)[:, 0],
                           last_B)
    return out_BK1, n_B, new_prev_B, next_B, pos_B + n_B + 1, t_cache, d_cache


def _check(target, draft, prompts, max_new_tokens, k, temperature, seed, eos_id) -> tuple[np.ndarray, jax.Array]:
    """The prompts' lengths and the seed's key, once every argument is checked."""
    for name, model in (("target", target), ("draft", draft)):
        check_llama(name, model)
    tc, dc = target.config, draft.config
    if tc.vocab_size != dc.vocab_size:
        raise ValueError(f"draft vocab_size={dc.vocab_size} differs from target vocab_size={tc.vocab_size}; "
                         "accepted: models sharing one tokenizer")
    check_int("max_new_tokens", max_new_tokens, 0)
    check_int("k", k, 1)
    if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < tc.vocab_size):
        raise ValueError(f"eos_id={eos_id!r}; accepted: a token id in 0..{tc.vocab_size - 1}, or None")
    temperature = as_python_scalar(temperature)
    if not (is_number(temperature) and np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}; accepted: a finite number >= 0 (0 is greedy)")
    key = seed_key(seed)
    lengths = check_prompt_ids(prompts, tc.vocab_size)
    # As without a draft: the proposals past the last kept token are scored and dropped (rotary angles are
    # computed for any position, and the caches are sized with room for them).
    context = min(tc.max_seq_len, dc.max_seq_len)
    if int(lengths.max()) + max_new_tokens > context:
        raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"models' context of {context} tokens")
    return lengths, key


def speculative_generate(target, draft, prompts: list[list[int]], max_new_tokens: int, *, k: int = 4,
                         temperature: float = 0.0, seed: int = 0, eos_id: int | None = None, stop=None):
    """Generate with `target`, `draft` proposing `k` tokens per target pass.

    Args:
        target, draft: `jmem.models.Llama` models with the same vocabulary (any weight
            leaves: a quantized or layer-dropped draft of the target is the usual choice).
        prompts: one list of ids per row (any lengths, at least one token each).
        max_new_tokens: tokens to emit per row (fewer when a row emits `eos_id`).
        k: proposals per round (at most max_new_tokens of them are drafted).
        temperature: 0 is greedy (the target's greedy continuation, exactly in f32); > 0 samples,
            each emitted token distributed as the target's softmax(logits / temperature).
        seed: PRNG seed of the draws (an integer in [-2**63, 2**64); every bit counts).
        eos_id: a row stops after this id (the id is not returned).
        stop: optional `stop(row, ids) -> int | None`, called on the host after each round with the
            row's ids so far, returning how many to keep when a stop condition was met (as
            `jmem.generate.generate_ids` calls it; `jmem.lm.CompletionWatch.stop` stops at stop
            strings and streams the text).

    Returns:
        (new ids per row, `SpeculativeStats`)

    Example:
        >>> out, stats = speculative_generate(target, draft, [[1, 2, 3]], 32, k=4)
    """
    lengths, key = _check(target, draft, prompts, max_new_tokens, k, temperature, seed, eos_id)
    if max_new_tokens == 0:
        return [[] for _ in prompts], SpeculativeStats(0, 0, 0, 0, 0)
    k = min(k, max_new_tokens)  # a row never keeps more; a larger k would only size the caches and the scan
    B, T = len(prompts), -(-int(lengths.max()) // 16) * 16
    ids = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    max_len = -(-(T + max_new_tokens + k + 1) // 64) * 64
    greedy = float(temperature) < GREEDY_BELOW
    temp = jnp.float32(temperature if not greedy else 1.0)
    t_def, t_state = nnx.split(target)
    d_def, d_state = nnx.split(draft)
    t_state, d_state = (without_dropout(s) if has_dropout_keys(s) else s for s in (t_state, d_state))  # inference
    ids_j, len_j = jnp.asarray(ids), jnp.asarray(lengths)
    logits_BV, t_cache = _prefill(t_def, t_state, ids_j, len_j, ContiguousKVCache.create(target.config, B, max_len))
    _, d_cache = _prefill(d_def, d_state, ids_j, len_j, ContiguousKVCache.create(draft.config, B, max_len))
    key, sub = jax.random.split(key)
    last = _draw(logits_BV, sub, temp, greedy)
    prev = jnp.asarray(ids[np.arange(B), lengths - 1])
    pos = len_j
    out = [[t] for t in np.asarray(last).tolist()]
    done = [False] * B
    rounds = proposed = accepted = emitted = row_passes = 0

    def settle(i) -> int:
        """Cut row i at its EOS, at max_new_tokens and where `stop` says; returns the tokens it kept, an
        EOS that ended it counted."""
        row = out[i]
        eos_at = row.index(eos_id) if eos_id is not None and eos_id in row else None
        if eos_at is not None:
            out[i], done[i] = row[:eos_at], True
        if len(out[i]) >= max_new_tokens:
            out[i], done[i] = out[i][:max_new_tokens], True
        out[i], stopped = apply_stop(stop, i, out[i])
        done[i] = done[i] or stopped
        return len(out[i]) + (eos_at is not None and eos_at < max_new_tokens and len(out[i]) == eos_at)

    for i in range(B):
        settle(i)
    while not all(done):
        key, sub = jax.random.split(key)
        toks, n, prev, last, pos, t_cache, d_cache = _round(t_def, t_state, d_def, d_state, t_cache, d_cache, prev,
                                                            last, pos, sub, temp, k=k, greedy=greedy)
        toks, n = np.asarray(toks), np.asarray(n)
        rounds += 1
        for i in range(B):
            if done[i]:
                continue
            row_passes += 1
            proposed += k
            accepted += int(n[i])
            before = len(out[i])
            out[i].extend(toks[i, :n[i] + 1].tolist())
            emitted += settle(i) - before  # tokens past max_new_tokens were never emitted
    return out, SpeculativeStats(rounds, proposed, accepted, emitted, row_passes)
