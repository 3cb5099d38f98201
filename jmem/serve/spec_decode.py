"""N-gram (prompt-lookup) speculative decoding for the serving engine.

Host side, `jmem.serve.ngram.propose_ngram` looks in a sequence's own tokens for the latest
earlier occurrence of its last `n_max .. n_min` tokens and proposes the tokens
that followed it (vLLM's `"method": "ngram"`). Such a proposal is a point-mass
draft: q(x) = 1 for the proposed token. The scheduler feeds the sequence's
last token plus its proposals in one step, the runner takes logits at each of
those positions, and `verify_rows` decides on device, per position, whether
its proposal is kept.

Acceptance: each verified position draws its token exactly as `jmem.sampling.sample`
would at that step (the request's processed distribution p, the same (seed, step)
key and Gumbel noise) and keeps the proposal x when the draw equals it. With q a
point mass this is Leviathan et al.'s rule: x is kept with probability
min(1, p(x) / q(x)) = p(x), and a rejection emits a token distributed as
normalize(max(0, p - q)), p with x removed. The emitted tokens are therefore the
very tokens the request draws without speculation, whatever the batch, the pool
or the number of proposals (greedy rows: the argmax, token for token).
"""

from __future__ import annotations

NO_DRAFT = -1  # a sampled row without a proposal at its position


def verify_rows(tokens_S, draft_S):
    """bool[rows]: the proposal at each row is kept, i.e. it is the token `sample` drew there.

    Args:
        tokens_S: i32[rows] `jmem.sampling.sample`'s tokens at the verified positions (their
            settings and history include the proposals before them).
        draft_S: i32[rows] the proposal at the next position, or `NO_DRAFT`.
    """
    return (draft_S >= 0) & (tokens_S == draft_S)
