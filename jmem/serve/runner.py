"""Model runner: owns the device arrays (weights, paged KV cache) and runs one jitted step per batch.

A step takes whatever the scheduler picked (decodes and prefill chunks of many
requests, in any mix), lays the tokens out flat, pads the token count, the
prefill tiles and pages per tile and the decode rows and chunks to a few
bucket sizes, runs the model once over the paged cache, computes logits only
at each sequence's last token and samples them. Padding to buckets keeps the
number of compiled programs small and independent of the request mix
(`num_compilations` counts them).

The step is general in "tokens per sequence", so a speculative-decoding verify
step (several proposed tokens per sequence, logits at each) fits the same
layout by asking for logits at more positions.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem.serve.paged_cache import PagedKVCache, build_layout, decode_shape, kv_bytes_per_token, tiles_needed
from jmem.sampling import make_arrays, sample
from jmem.serve.scheduler import SchedulerOutput

DEFAULT_CPU_KV_BYTES = 256 << 20  # CPU backends report no memory: a fixed default budget


def _bucket(n: int, smallest: int) -> int:
    """Next power of two >= n (at least `smallest`)."""
    b = smallest
    while b < n:
        b *= 2
    return b


def _fine_bucket(n: int, smallest: int) -> int:
    """Next of smallest * (1, 1.5, 2, 3, 4, 6, ...) >= n (`smallest` even): a third of padding at most."""
    b = smallest
    while b < n:
        if b * 3 // 2 >= n:
            return b * 3 // 2
        b *= 2
    return b


def kv_cache_budget(weights_bytes: int, kv_cache_memory: int | None, memory_utilization: float | None) -> int:
    """Bytes for the KV cache: explicit, or a fraction of device memory minus the weights."""
    if kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={kv_cache_memory}; need a positive number of bytes")
        return int(kv_cache_memory)
    frac = 0.9 if memory_utilization is None else memory_utilization
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"memory_utilization={memory_utilization}; accepted: (0, 1]")
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return DEFAULT_CPU_KV_BYTES if memory_utilization is None else int(
            frac * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.25)
    budget = int(frac * limit) - stats.get("bytes_in_use", 0) - weights_bytes
    if budget <= 0:
        raise ValueError(f"memory_utilization={frac} leaves no room for the KV cache after the weights "
                         f"({weights_bytes / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB)")
    return budget


@dataclass
class StepResult:
    """Per scheduled sequence that samples: token, its logprob, top logprobs and ids (host numpy)."""

    tokens: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]


class ModelRunner:
    """Paged KV cache + jitted mixed prefill/decode step for one model.

    Args:
        model: a `jmem.models.Llama` (weights may be quantized leaves).
        num_blocks: blocks in the scheduler's pool; the cache holds one more (a spare page for padding).
        block_size: tokens per page.
        max_num_seqs: most sequences per step (the sampling batch).
        max_model_len: longest sequence, bounds the pages per sequence.
        kv_dtype: auto | bf16 | fp8_e4m3 | int8.
        attention_impl: auto | tiled | kernel (see `PagedKVCache.create`).

    Example:
        >>> runner = ModelRunner(model, num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=512)
        >>> result = runner.step(scheduler.schedule())
    """

    def __init__(self, model, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 kv_dtype: str = "auto", attention_impl: str = "auto"):
        self.config = model.config
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = -(-max_model_len // block_size)
        self.kv_dtype = kv_dtype
        self.spare_page = num_blocks
        self.cache = PagedKVCache.create(self.config, num_blocks + 1, block_size, kv_dtype, attention_impl)
        self.graphdef, self.state = nnx.split(model)
        self.compiled_keys: set[tuple] = set()

    @property
    def num_compilations(self) -> int:
        """Distinct padded shapes the step has been traced for."""
        return len(self.compiled_keys)

    @staticmethod
    def num_blocks_for_budget(config, budget_bytes: int, block_size: int, kv_dtype: str) -> int:
        per_block = kv_bytes_per_token(config, kv_dtype, block_size) * block_size  # int8/fp8: scales included
        n = budget_bytes // per_block - 1  # one spare page
        if n < 1:
            raise ValueError(f"a KV-cache budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                             f"({per_block} bytes each)")
        return int(n)

    def step(self, out: SchedulerOutput) -> StepResult:
        """Run the scheduled tokens through the model; sample where a sequence reaches its last token."""
        seqs = out.seqs
        if not seqs:
            return StepResult({}, {})
        n_tok = out.num_tokens
        T = _bucket(n_tok, 16)
        pages = lambda group: max(-(-(s.start + s.num_tokens) // self.block_size) for s in group)
        page_bucket = lambda n: min(_bucket(n, 8), _bucket(self.max_pages_per_seq, 1))
        # The block table only feeds the kernel path; the plain-jnp path keeps one width, one shape less to compile.
        M_all = page_bucket(pages(seqs) if self.cache.impl == "kernel" else self.max_pages_per_seq)
        # Prefill tiles; a step of decodes only keeps one empty tile of one page (the
        # smallest shape), not a padded bucket, since decode steps are most steps.
        tiled = [s for s in seqs if s.num_tokens > 1]
        N = _bucket(tiles_needed([s.num_tokens for s in tiled]), 8) if tiled else 1
        M = page_bucket(pages(tiled)) if tiled else 1
        rows, chunks = decode_shape([(s.start, s.num_tokens, None) for s in seqs], self.block_size)
        Rd, Nc = _bucket(rows, 8), _fine_bucket(chunks, 8)
        S = self.max_num_seqs
        ids = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        last = np.zeros(S, np.int32)
        t = 0
        for i, s in enumerate(seqs):
            toks = s.request.all_token_ids[s.start : s.start + s.num_tokens]
            ids[t : t + s.num_tokens] = toks
            pos[t : t + s.num_tokens] = np.arange(s.start, s.start + s.num_tokens)
            last[i] = t + s.num_tokens - 1
            t += s.num_tokens
        layout = build_layout([(s.start, s.num_tokens, s.block_ids) for s in seqs], T, N, M, self.block_size,
                              self.spare_page, max_seqs=S, pages_per_seq=M_all, decode_rows=Rd, decode_chunks=Nc)
        reqs = [s.request for s in seqs]
        params = [r.params for r in reqs]
        H = 0
        if any(p.uses_penalties for p in params):
            H = _bucket(max(r.num_tokens for r in reqs), 64)
        sarr = make_arrays(params, seeds=[r.seed for r in reqs], steps=[len(r.output_token_ids) for r in reqs],
                           histories=[(r.prompt_token_ids, r.output_token_ids) for r in reqs], batch=S, hist_len=H)
        self.compiled_keys.add((T, N, M, M_all, Rd, Nc, H))
        cache = self.cache.replace(layout=layout)
        toks, lp, top_lp, top_ids, cache = _step_fn(self.graphdef, self.state, cache, jnp.asarray(ids), jnp.asarray(pos),
                                                      jnp.asarray(last), sarr)
        self.cache = cache.replace(layout=None)
        toks, lp = np.asarray(toks), np.asarray(lp)
        want_top = any(p.logprobs for p in params)
        top_lp, top_ids = (np.asarray(top_lp), np.asarray(top_ids)) if want_top else (None, None)
        tokens, logprobs = {}, {}
        for i, s in enumerate(seqs):
            if not s.samples:
                continue
            rid = s.request.request_id
            tokens[rid] = int(toks[i])
            k = s.request.params.logprobs
            tops = [(int(top_ids[i, j]), float(top_lp[i, j])) for j in range(k)] if k else []
            logprobs[rid] = (float(lp[i]), tops)
        return StepResult(tokens, logprobs)


# One jitted function for every runner: engines over the same model share compiled steps.
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _step_fn(graphdef, state, cache, ids_T, pos_T, last_S, sarr):
    model = nnx.merge(graphdef, state)
    h_1TE, cache = model.hidden(ids_T[None], positions=pos_T[None], cache=cache)
    h_1SE = h_1TE[:, last_S]
    logits_SV = model.logits_from_hidden(h_1SE)[0]
    toks, lp, top_lp, top_ids = sample(logits_SV, sarr)
    return toks, lp, top_lp, top_ids, cache
