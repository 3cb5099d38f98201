"""N-gram (prompt-lookup) proposals for speculative decoding, on the host (no JAX).

A sequence that repeats itself (code, quoted passages, lists, chat turns that echo the
prompt) often continues as it did the last time its latest tokens appeared; proposing
those continuations costs no model at all. The runner verifies them
(`jmem.serve.spec_decode`).
"""

from __future__ import annotations

import numpy as np


def check_speculative_args(num_speculative_tokens: int, prompt_lookup_max: int = 1, *, flags: bool = False,
                           draft_model=None, draft_layers=()) -> None:
    """ValueError naming the bad setting: k >= 0 (0: off); with a draft (`draft_model`, a name, path or
    model, or `draft_layers`) k >= 1 and not both; with k > 0 a lookup length >= 1.
    `flags=True` names the settings as command-line flags (`--num-speculative-tokens`)."""

    def name(setting: str) -> str:
        return "--" + setting.replace("_", "-") if flags else setting

    k = num_speculative_tokens
    if k < 0:
        raise ValueError(f"{name('num_speculative_tokens')}={k}; accepted: >= 0 (0: off)")
    if draft_model is not None and draft_layers:
        raise ValueError(f"{name('speculative_model')}={draft_model!r} and {name('speculative_layers')}="
                         f"{list(draft_layers)} both given; accepted: one of them")
    if (draft_model is not None or draft_layers) and k < 1:
        raise ValueError(f"{name('num_speculative_tokens')}={k}; accepted: >= 1 with a draft model "
                         "(the tokens it proposes per decode)")
    if k > 0 and prompt_lookup_max < 1:
        raise ValueError(f"{name('prompt_lookup_max')}={prompt_lookup_max}; accepted: >= 1 when "
                         f"{name('num_speculative_tokens')} > 0")


def propose_ngram(tokens, k: int, n_max: int, n_min: int = 1) -> list[int]:
    """Up to `k` tokens following the latest earlier occurrence of the sequence's last n tokens.

    Tries n = n_max down to n_min; the first n with a match wins. The match must start before
    the suffix itself and be followed by at least one token.

    Args:
        tokens: the sequence so far (prompt + outputs), ints.
        k: most tokens to propose.
        n_max, n_min: longest and shortest suffix looked up.

    Returns:
        The proposal (possibly shorter than k), or [] when no suffix occurs earlier.

    Example:
        >>> propose_ngram([1, 2, 3, 9, 1, 2], k=2, n_max=3)
        [3, 9]
    """
    L = len(tokens)
    if k <= 0 or L < 2:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # Candidate starts i in [0, L - n - 1]: the match ends before the last token.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            i = int(hits[-1])
            return [int(t) for t in arr[i + n : i + n + k]]
    return []
