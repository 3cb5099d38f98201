"""N-gram (prompt-lookup) speculative decoding for the serving engine.

Host side, `jmem.serve.ngram.propose_ngram` looks in a sequence's own tokens for the latest
earlier occurrence of its last `n_max .. n_min` tokens and proposes the tokens
that followed it (vLLM's `"method": "ngram"`). Such a proposal is a point-mass
draft: q(x) = 1 for the proposed token. The scheduler feeds the sequence's
last token plus its proposals in one step, the runner takes logits at each of
those positions, and `verify_rows` decides on device, per position, whether
its proposal is kept.

Acceptance is Leviathan et al.'s rule with q a point mass: keep proposal x with
probability min(1, p(x) / q(x)) = p(x), where p is the request's own processed
distribution (penalties, temperature, top-k, top-p, min-p, exactly as
`jmem.sampling.sample` builds it); on rejection draw from normalize(max(0, p -
q)), which is p with x removed and renormalized. Greedy rows keep x while it is
the argmax and otherwise take the argmax. Emitted tokens therefore follow the
target distribution exactly, and greedy output is token for token the one
without speculation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmem.sampling import SamplingArrays, apply_penalties, argmax_last, masked_logits

NO_DRAFT = -1  # a sampled row without a proposal at its position


def verify_rows(logits_SV, s: SamplingArrays, greedy_S, draft_S, key_S):
    """Per sampled row, whether its proposal is accepted and the token to emit if it is not.

    Args:
        logits_SV: f32[rows, vocab] raw logits at each verified position.
        s: the rows' sampling settings (per row: history includes the proposals before it).
        greedy_S: i32[rows] argmax of the penalized logits (what `sample` returns for greedy rows).
        draft_S: i32[rows] the proposal at the next position, or `NO_DRAFT`.
        key_S: the rows' PRNG keys (one per row, as `sample` derives them).

    Returns:
        accept bool[rows] (False where no proposal), residual i32[rows] (the token drawn from p with
        the proposal removed; the argmax for greedy rows), its raw log-probability f32[rows], and the
        proposal's raw log-probability f32[rows].
    """
    logits_SV = logits_SV.astype(jnp.float32)
    logprobs_SV = jax.nn.log_softmax(logits_SV, axis=-1)
    has = draft_S >= 0
    d_S = jnp.where(has, draft_S, 0)
    sampled = s.temperature > 0

    def draw(logits_SV):
        if s.hist_ids.shape[1]:
            logits_SV = apply_penalties(logits_SV, s)
        masked_SV = masked_logits(logits_SV, s)
        p_SV = jax.nn.softmax(masked_SV, axis=-1)
        p_d = jnp.take_along_axis(p_SV, d_S[:, None], axis=-1)[:, 0]
        # Independent streams for the acceptance coin and the residual draw, apart from `sample`'s noise.
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(key_S)
        g_SV = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 2), logits_SV.shape[-1:]))(key_S)
        iota = jax.lax.broadcasted_iota(jnp.int32, masked_SV.shape, 1)
        residual = argmax_last(jnp.where(iota == d_S[:, None], -jnp.inf, masked_SV) + g_SV)
        return u < p_d, residual.astype(jnp.int32)

    none = lambda l: (jnp.zeros(l.shape[:1], bool), greedy_S)  # noqa: E731
    acc_sampled, resid_sampled = jax.lax.cond(jnp.any(has & sampled), draw, none, logits_SV)
    accept = has & jnp.where(sampled, acc_sampled, greedy_S == d_S)
    residual = jnp.where(sampled, resid_sampled, greedy_S)
    resid_lp = jnp.take_along_axis(logprobs_SV, residual[:, None], axis=-1)[:, 0]
    draft_lp = jnp.take_along_axis(logprobs_SV, d_S[:, None], axis=-1)[:, 0]
    return accept, residual, resid_lp, draft_lp

