"""Batched generation with a contiguous KV cache: one jitted prefill, then jitted decode chunks.

Decoding runs `chunk` tokens per device call under `lax.scan` (few host round trips);
the host then checks EOS and stop strings and stops early when every row is done.

On the CPU backend the blocks run as an unrolled loop over per-layer copies of the
block weights (`per_layer_weights`, made once per model) and a per-layer cache: XLA's
CPU backend copies a layer's slice out of a stacked weight array before each matmul,
which made batch-1 decoding read every weight twice. The copy costs one more set of
block weights in host memory; GPU and TPU backends scan over the stacked weights.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem import sampling
from jmem.checks import as_python_scalar, check_int, check_llama, check_seed, is_int, is_number
from jmem.lora import has_dropout_keys, without_dropout
from jmem.models.cache import ContiguousKVCache
from jmem.models.llama import unstack_layers


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("temperature", "top_k", "top_p", "seed"):  # jnp.float32(0.7) is 0.7
            object.__setattr__(self, name, as_python_scalar(getattr(self, name)))
        if not (is_number(self.temperature) and 0.0 <= self.temperature < float("inf")):  # NaN fails too
            raise ValueError(f"temperature={self.temperature!r}; accepted: a finite number >= 0 (0 is greedy)")
        if is_int(self.top_k) and self.top_k in (0, -1):  # off, as the serving params (and vLLM) read them
            object.__setattr__(self, "top_k", None)
        if self.top_k is not None and (not is_int(self.top_k) or not 1 <= self.top_k < 2**31):
            raise ValueError(f"top_k={self.top_k!r}; accepted: an integer in 1..2**31-1, or None, 0 or -1 (off)")
        if self.top_p is not None and not (is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}; accepted: a number in (0, 1], or None (off)")
        check_seed("seed", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < sampling.GREEDY_BELOW


def check_prompt_ids(prompts, vocab_size: int) -> np.ndarray:
    """Check a batch of token-id prompts (non-empty, integer ids in the vocabulary); returns their lengths."""
    if len(prompts) == 0 or any(not isinstance(p, (list, tuple, np.ndarray, jax.Array)) for p in prompts):
        raise ValueError("prompts must be a non-empty list of token-id lists (e.g. [[1, 2, 3]], not [1, 2, 3])")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} has no tokens; each prompt needs at least one")
    for i, p in enumerate(prompts):
        try:
            arr = np.asarray(p)
        except ValueError:  # ragged nesting
            arr = None
        if arr is None or arr.ndim != 1:
            raise ValueError(f"prompt {i} is not a flat list of token ids ({str(p)[:40]}); accepted: token-id "
                             "lists (e.g. [[1, 2, 3]])")
        bad = arr if not np.issubdtype(arr.dtype, np.integer) else arr[(arr < 0) | (arr >= vocab_size)]
        if bad.size:
            raise ValueError(f"prompt {i} holds {bad.ravel()[0].item()!r}; accepted: integer token ids in "
                             f"0..{vocab_size - 1}")
    return np.array([len(p) for p in prompts], np.int32)


def _bucket(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


_PER_LAYER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def per_layer_weights(model) -> list[dict]:
    """`unstack_layers(model)`, made once and reused while the model's block weights are the
    same arrays (replacing any of them, e.g. after training, makes a fresh copy)."""
    stacked = jax.tree.leaves(model.layers.weights())
    hit = _PER_LAYER.get(model)
    if hit is None or len(hit[0]) != len(stacked) or any(a is not b for a, b in zip(hit[0], stacked)):
        hit = (stacked, unstack_layers(model))
        _PER_LAYER[model] = hit
    return hit[1]


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _prefill(graphdef, state, layers, ids_BT, lengths_B, cache):
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden(ids_BT, cache=cache, layers=layers)
    h_last = jnp.take_along_axis(h, (lengths_B - 1)[:, None, None], axis=1)
    return model.logits_from_hidden(h_last)[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "greedy"), donate_argnames=("cache",))
def _decode(graphdef, state, layers, cache, logits_BV, pos_B, arrays: sampling.SamplingArrays, *, steps, greedy):
    model = nnx.merge(graphdef, state)

    def step(carry, _):
        logits, pos, cache, arrays = carry
        tok = sampling.argmax_last(logits).astype(jnp.int32) if greedy else sampling.sample(logits, arrays)[0]
        h, cache = model.hidden(tok[:, None], positions=pos[:, None], cache=cache, layers=layers)
        new_logits = model.logits_from_hidden(h)
        return (new_logits[:, 0], pos + 1, cache, arrays._replace(step=arrays.step + 1)), tok

    (logits, pos, cache, arrays), toks = jax.lax.scan(step, (logits_BV, pos_B, cache, arrays), None, length=steps)
    return toks.T, logits, pos, cache, arrays


def generate_ids(model, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 eos_id: int | None = None, stop=None, chunk: int = 16) -> list[list[int]]:
    """Generate continuations for token-id prompts; returns the new ids of each row.

    Args:
        model: a `jmem.models.Llama`.
        prompts: one list of ids per row (any lengths, at least one token each).
        max_new_tokens: upper bound on new tokens per row.
        params: sampling parameters. Row i samples from its own stream seeded by
            `(params.seed, i)`: the same rows give the same draws, so a prompt's sample
            depends on its row index as well as the seed.
        eos_id: stop a row after it emits this id (the id is not returned).
        stop: optional `stop(row, ids) -> int | None`, called on the host after each chunk,
            returning how many ids to keep when a stop condition was met.
        chunk: decode steps per device call.
    """
    check_llama("model", model)
    if stop is not None and not callable(stop):
        raise ValueError(f"stop={stop!r:.80}; accepted: None or a callable stop(row, ids) -> int | None "
                         "(how many ids to keep); for stop strings: jmem.LM.generate(..., stop=...)")
    check_int("max_new_tokens", max_new_tokens, 0)
    check_int("chunk", chunk, 1)  # 0 decode steps per call would never finish
    max_new_tokens, chunk = int(max_new_tokens), int(chunk)  # NumPy integers have no bit_length
    # Not many decode steps past the last token asked for (a power of two: few compiled chunk sizes).
    chunk = min(chunk, 1 << max(max_new_tokens - 1, 0).bit_length())
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params={params!r:.80}; accepted: a jmem.generate.SamplingParams "
                         "(e.g. SamplingParams(temperature=0.7))")
    cfg = model.config
    if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < cfg.vocab_size):
        raise ValueError(f"eos_id={eos_id!r}; accepted: a token id in 0..{cfg.vocab_size - 1}, or None")
    lengths = check_prompt_ids(prompts, cfg.vocab_size)
    total = int(lengths.max()) + max_new_tokens + chunk
    if int(lengths.max()) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {cfg.max_seq_len} tokens")
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    B, T = len(prompts), _bucket(int(lengths.max()), 16)
    ids = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    layers = per_layer_weights(model) if jax.default_backend() == "cpu" else None
    graphdef, state = nnx.split(model)
    if has_dropout_keys(state):  # inference never applies LoRA dropout
        state, layers = without_dropout(state), without_dropout(layers)
    cache = ContiguousKVCache.create(cfg, B, _bucket(total, 64), per_layer=layers is not None)
    logits, cache = _prefill(graphdef, state, layers, jnp.asarray(ids), jnp.asarray(lengths), cache)
    pos = jnp.asarray(lengths)
    # Row i draws from seed (params.seed, i), step by step: the same rows give the same draws
    # (a 64-bit sampler seed: seeds 2**32 apart draw differently).
    seeds = [(int(params.seed) * 1_000_003 + i) % 2**64 for i in range(B)]
    arrays = jax.tree.map(jnp.asarray, sampling.make_arrays([params] * B, seeds, [0] * B))
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * B
    while not all(done):
        toks, logits, pos, cache, arrays = _decode(graphdef, state, layers, cache, logits, pos, arrays,
                                                   steps=chunk, greedy=params.greedy)
        toks = np.asarray(toks)
        for i in range(B):
            if done[i]:
                continue
            row = toks[i].tolist()
            if eos_id is not None and eos_id in row:
                row, done[i] = row[: row.index(eos_id)], True
            out[i].extend(row)
            if len(out[i]) >= max_new_tokens:
                out[i], done[i] = out[i][:max_new_tokens], True
            out[i], stopped = apply_stop(stop, i, out[i])
            done[i] = done[i] or stopped
    return out


def apply_stop(stop, row: int, ids: list[int]) -> tuple[list[int], bool]:
    """(the row's ids, whether it stopped) after the host-side `stop(row, ids) -> int | None` callback (None:
    no callback); a ValueError naming what it returned when that is not None or a count of ids to keep."""
    keep = None if stop is None else stop(row, ids)
    if keep is None:
        return ids, False
    if not is_int(keep) or not 0 <= keep <= len(ids):
        raise ValueError(f"stop(row={row}, ids) returned {keep!r}; accepted: None, or how many of the row's "
                         f"{len(ids)} ids to keep (0..{len(ids)})")
    return ids[:keep], True
