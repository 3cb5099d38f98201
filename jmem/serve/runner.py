"""Model runner: owns the device arrays (weights, paged KV cache) and runs one jitted step per batch.

A step takes whatever the scheduler picked (decodes and prefill chunks of many
requests, in any mix), lays the tokens out flat, pads the token count, the
prefill tiles and pages per tile and the decode rows and chunks to a few
bucket sizes, runs the model once over the paged cache, computes logits only
at each sequence's last token and samples them. Padding to buckets keeps the
number of compiled programs small and independent of the request mix
(`num_compilations` counts them). After `precompile`, a step never waits for
a compilation: a shape not compiled yet runs padded to a compiled one that
holds it while its own compiles on a background thread.

The step is general in "tokens per sequence", so a speculative-decoding verify
step fits the same layout by asking for logits at more positions: a decode
with proposals (`ScheduledSeq.draft_token_ids`) feeds its last token and the
proposals, gets one sampled row per position, and `jmem.serve.spec_decode`
decides on device which proposals are kept; the host keeps the accepted run and
the token after it. The proposals only change the sizes the shape buckets
already pad (tokens, tiles, sampled rows), so no acceptance pattern compiles a
program of its own.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jmem.memory.measure import device_memory_stats, memory_limit
from jmem.sampling import make_arrays, sample
from jmem.serve.lora import BASE_SLOT, AdapterInfo, MultiLoRA, with_slots
from jmem.serve.lora_slots import AdapterSlots, state_with_adapters
from jmem.serve.paged_cache import PagedKVCache, kv_bytes_per_token
from jmem.serve.paged_decode import chunk_pages
from jmem.serve.request import SamplingParams, UnknownAdapter
from jmem.serve.scheduler import SchedulerOutput
from jmem.serve.spec_decode import NO_DRAFT, verify_rows
from jmem.serve.step_layout import TILE, build_layout, decode_shape, tiles_needed

log = logging.getLogger("jmem.serve")

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


def resident_bytes(tree) -> int:
    """Bytes of `tree`'s arrays that already sit whole on the first local device (counted in its
    `bytes_in_use`)."""
    device = jax.local_devices()[0]
    return sum(x.nbytes for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and x.sharding.device_set == {device})


def kv_cache_budget(weights_bytes: int, kv_cache_memory: int | None, memory_utilization: float | None,
                    resident_weight_bytes: int = 0) -> int:
    """Bytes for the KV cache: explicit, or a fraction of device memory minus what is in use and the
    weights still to be placed there (`weights_bytes` less the `resident_weight_bytes` already in use)."""
    if kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={kv_cache_memory}; need a positive number of bytes")
        return int(kv_cache_memory)
    frac = 0.9 if memory_utilization is None else memory_utilization
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"memory_utilization={memory_utilization}; accepted: (0, 1]")
    stats = device_memory_stats()
    limit = stats.get("bytes_limit")
    if not limit:
        return DEFAULT_CPU_KV_BYTES if memory_utilization is None else int(
            frac * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.25)
    in_use = stats.get("bytes_in_use", 0)
    budget = int(frac * limit) - in_use - max(0, weights_bytes - resident_weight_bytes)
    if budget <= 0:
        raise ValueError(f"memory_utilization={frac} leaves no room for the KV cache after the weights "
                         f"({weights_bytes / 2**20:.0f} MiB) and what the device already holds "
                         f"({in_use / 2**20:.0f} MiB in use of {limit / 2**20:.0f} MiB)")
    return budget


def check_pool_fits(num_blocks: int, block_bytes: int, weights_bytes: int) -> None:
    """Refuse a KV-cache pool (`num_blocks` of `block_bytes` per device) that cannot fit next to the
    weights: asked for by num_blocks or kv_cache_memory, it would be allocated until the process dies."""
    limit, holder = memory_limit()
    need = num_blocks * block_bytes + weights_bytes
    if need > limit:
        most = max(0, (limit - weights_bytes) // block_bytes)
        raise ValueError(f"a KV cache of {num_blocks} blocks ({num_blocks * block_bytes / 2**20:.0f} MiB per device, "
                         f"with {weights_bytes / 2**20:.0f} MiB of weights) does not fit: {holder} "
                         f"{limit / 2**20:.0f} MiB; accepted: num_blocks (--num-blocks) up to {most}, or a smaller "
                         "kv_cache_memory (--kv-cache-memory)")


class StepShape(NamedTuple):
    """The padded sizes of one compiled step (see `StepLayout` for what each one pads).

    tokens: flat tokens T; tiles, pages_per_tile: prefill tiles N and their pages M;
    pages_per_seq: block-table width; decode_rows, decode_chunks: Rd, Nc; sample_rows: sequences whose
    logits are computed and sampled (the head's rows); hist_len: penalty history H; bias_len: logit
    biases per row K (`logit_bias`, and the tokens `min_tokens` bans).
    """

    tokens: int
    tiles: int
    pages_per_tile: int
    pages_per_seq: int
    decode_rows: int
    decode_chunks: int
    sample_rows: int
    hist_len: int
    bias_len: int = 0

    def holds(self, other: StepShape) -> bool:
        """Whether a step of shape `other` can run padded to this one (penalties, and biases, on in both
        or neither)."""
        return (all(a >= b for a, b in zip(self, other)) and (self.hist_len == 0) == (other.hist_len == 0)
                and (self.bias_len == 0) == (other.bias_len == 0))

    def cost(self) -> tuple:
        """Order among shapes that hold a step: fewest tokens (the dense layers) first, then sampled rows
        (the head), then attention work."""
        return (self.tokens, self.sample_rows, self.tiles * self.pages_per_tile, self.decode_rows + self.decode_chunks,
                self.hist_len, self.bias_len)


@dataclass
class StepResult:
    """Per scheduled sequence that samples: token, its logprob, top logprobs and ids (host numpy).

    With speculation, `accepted[rid]` holds the proposals kept (and their logprob records), which
    come before `tokens[rid]` (the correction or bonus token) in the output.
    """

    tokens: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    accepted: dict[str, tuple[list[int], list]] = field(default_factory=dict)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


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
        adapters: the LoRA adapters of the model's `MultiLoRA` leaves (`jmem.serve.lora.stack_adapters`); a
            request's `adapter_id` picks one, None the base model. With more adapters than slots,
            `load_adapters` moves those a step needs into slots before it runs.
        mesh: a tensor-parallel mesh (`jmem.serve.tensor_parallel.tensor_mesh`): the weights are split
            Megatron-style and the pool on its kv heads; `num_blocks` then counts blocks of all heads,
            each device holding its heads' share of every block. None: one device.

    Example:
        >>> runner = ModelRunner(model, num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=512)
        >>> result = runner.step(scheduler.schedule())
    """

    def __init__(self, model, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 kv_dtype: str = "auto", attention_impl: str = "auto", adapters: dict[str, AdapterInfo] | None = None,
                 mesh: jax.sharding.Mesh | None = None):
        self.config = model.config
        self.adapters = dict(adapters or {})
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = -(-max_model_len // block_size)
        self.kv_dtype = kv_dtype
        self.spare_page = num_blocks
        self.mesh = mesh
        self.tensor_parallel_size = 1 if mesh is None else mesh.shape.get("tensor", 1)
        self.graphdef, self.state = nnx.split(model)
        multi = [x for x in jax.tree.leaves(self.state, is_leaf=lambda x: isinstance(x, MultiLoRA))
                 if isinstance(x, MultiLoRA)]
        self.adapter_slots = AdapterSlots(self.adapters, multi[0].num_slots if multi else len(self.adapters),
                                          {n: a.slot for n, a in self.adapters.items() if a.slot is not None})
        self._adapter_lock = threading.Lock()  # slot changes vs. readers of the state on other threads
        if mesh is not None:
            from jmem.serve.tensor_parallel import check_tensor_parallel, shard_state

            check_tensor_parallel(self.config, self.tensor_parallel_size, mesh.devices.size)
            self.state = shard_state(self.state, mesh)
        self.cache = PagedKVCache.create(self.config, num_blocks + 1, block_size, kv_dtype, attention_impl, mesh)
        self._abstract_state, self._abstract_cache = _abstract(self.state), _abstract(self.cache)
        self.compiled_shapes: set[StepShape] = set()  # shapes this runner has compiled or run
        # Shapes compiled by any runner of the same model and cache (one jitted step serves them all).
        self._known_shapes = _COMPILED_SHAPES[(self.graphdef, *_flat(self._abstract_state),
                                               *_flat(self._abstract_cache))]
        self._compiling: dict[StepShape, concurrent.futures.Future] = {}
        self._compile_ahead = False  # set by `precompile`: new shapes compile in the background
        self._compile_failed: set[StepShape] = set()  # background compilations that raised (logged once)
        self.num_blocking_compilations = 0  # steps that waited for XLA to compile their shape

    @property
    def num_compilations(self) -> int:
        """Distinct padded shapes the step has been compiled for (in the foreground or the background)."""
        return len(self.compiled_shapes)

    def precompile(self, max_num_batched_tokens: int, num_speculative_tokens: int = 0) -> list[StepShape]:
        """Compile the largest decode-only step and the largest step that prefills, then serve every step
        without waiting for XLA.

        After this, a step whose exact padded shape is not compiled yet runs padded to the smallest
        compiled shape that holds it, while its own shape compiles on a background thread for the
        steps after it; a serving loop never stalls on a compilation (steps with penalties or logit
        biases, `logit_bias` and `min_tokens`, compile on first use: the history length and the bias
        width are dimensions of their own). With `num_speculative_tokens`,
        the prefilling step samples a row per verified position too, so it holds every verify step.
        Returns the shapes compiled.
        """
        S, B = self.max_num_seqs, max_num_batched_tokens
        max_chunks = S * -(-self.max_pages_per_seq // chunk_pages(self.block_size))
        rows, chunks = _bucket(min(S, B), 8), _fine_bucket(max_chunks, 8)
        prefills = min(S, B // 2)  # sequences with at least two tokens in one step
        tiles, pages = _bucket((B + (TILE - 1) * prefills) // TILE, 8), self._page_bucket(self.max_pages_per_seq)
        if self._kernel:
            rows = chunks = tiles = pages = 1
        width = self._table_width(self.max_pages_per_seq)
        # Verify steps sample a row per position (a token each, so B rows at most).
        sampled = max(S, _bucket(min(S * (1 + num_speculative_tokens), B), 1)) if num_speculative_tokens else S
        shapes = [StepShape(_fine_bucket(min(S, B), 16), 1, 1, width, rows, chunks, S, 0),
                  StepShape(_fine_bucket(B, 16), tiles, pages, width, rows, chunks, sampled, 0)]
        for shape in shapes:
            if shape not in self._known_shapes:
                self.compiled_step(shape)
                self._known_shapes.add(shape)
            self.compiled_shapes.add(shape)
        self._compile_ahead = True
        return shapes

    def _page_bucket(self, pages: int) -> int:
        return min(_bucket(pages, 8), _bucket(self.max_pages_per_seq, 1))

    @property
    def _kernel(self) -> bool:
        return self.cache.impl == "kernel"

    def _table_width(self, pages: int) -> int:
        # The block table only feeds the kernel path; the plain-jnp path keeps one width, one shape less to compile.
        return self._page_bucket(pages if self._kernel else self.max_pages_per_seq)

    def _shape_needed(self, seqs, params, biases) -> StepShape:
        """The bucketed shape of a step over `seqs` (scheduled sequences) whose sampled rows add
        `biases` (`Request.logit_biases` per row) to their logits."""
        pages = lambda group: max(-(-(s.start + s.num_tokens) // self.block_size) for s in group)
        # Prefill tiles; a step of decodes only keeps one empty tile of one page (the
        # smallest shape), not a padded bucket, since decode steps are most steps.
        tiled = [s for s in seqs if s.num_tokens > 1]
        N = _bucket(tiles_needed([s.num_tokens for s in tiled]), 8) if tiled else 1
        M = self._page_bucket(pages(tiled)) if tiled else 1
        rows, chunks = decode_shape([(s.start, s.num_tokens, None) for s in seqs], self.block_size)
        Rd, Nc = _bucket(rows, 8), _fine_bucket(chunks, 8)
        H = 0
        if any(p.uses_penalties for p in params):
            H = _bucket(max(s.request.num_tokens + len(s.draft_token_ids) for s in seqs), 64)
        K = max(map(len, biases), default=0)
        K = _bucket(K, 8) if K else 0
        if self._kernel:  # the kernel reads the block tables, not the prefill tiles and decode rows
            N = M = Rd = Nc = 1
        # Tokens take the finer buckets: the dense layers, most of a step's work, run on all T of them.
        # The head runs on the step's sequences (power-of-two rows), not on every slot: for SmolLM2-135M,
        # 31 padded rows of its 576 x 49152 head are 6.5x all of one token's matmuls.
        rows = sum(1 + len(s.draft_token_ids) for s in seqs)  # a verified position per proposal
        sample_rows = min(_bucket(rows, 1), self.max_num_seqs) if rows <= self.max_num_seqs else _bucket(rows, 1)
        return StepShape(_fine_bucket(sum(s.num_tokens for s in seqs), 16), N, M, self._table_width(pages(seqs)),
                         Rd, Nc, sample_rows, H, K)

    def _shape_to_run(self, need: StepShape) -> StepShape:
        """`need` when compiled (or when compiling it now is the only way); else, after `precompile`,
        the cheapest compiled shape that holds it, with `need` compiling in the background."""
        self._collect_compiled()
        known = self._known_shapes
        if need not in known and self._compile_ahead:
            fits = [s for s in known if s.holds(need)]
            if fits:
                if need not in self._compiling and need not in self._compile_failed:
                    self._compiling[need] = _background_compiler().submit(_compile_if_alive, weakref.ref(self),
                                                                          need)
                shape = min(fits, key=StepShape.cost)
                self.compiled_shapes.add(shape)
                return shape
        if need not in known:  # the call compiles it
            known.add(need)
            self.num_blocking_compilations += 1
        self.compiled_shapes.add(need)
        return need

    def finish_compilations(self) -> None:
        """Wait for the background compilations to finish (benchmarks and tests)."""
        concurrent.futures.wait(list(self._compiling.values()))
        self._collect_compiled()

    def cancel_compilations(self) -> None:
        """Drop the background compilations not started yet (a stopping server does not wait for them)."""
        for shape, fut in list(self._compiling.items()):
            if fut.cancel():
                del self._compiling[shape]

    def _collect_compiled(self) -> None:
        for shape, fut in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[shape]
            if fut.exception() is not None:
                # Not the running steps' fault: they ran padded to another shape, as later ones will.
                log.warning("background compilation of %s failed: %r", shape, fut.exception())
                self._compile_failed.add(shape)
                continue
            self._known_shapes.add(shape)  # only the serving thread changes the shape sets
            self.compiled_shapes.add(shape)

    def _layout(self, seqs, shape: StepShape):
        return build_layout(seqs, shape.tokens, shape.tiles, shape.pages_per_tile, self.block_size, self.spare_page,
                            max_seqs=self.max_num_seqs, pages_per_seq=shape.pages_per_seq,
                            decode_rows=shape.decode_rows, decode_chunks=shape.decode_chunks, tiled=not self._kernel)

    def compiled_step(self, shape: StepShape):
        """Compile the step for `shape` from abstract arguments; the jitted step's cache keeps the program,
        so the first real call of that shape runs it without compiling (safe on another thread: nothing
        here reads the live cache arrays). Returns the `jax.stages.Compiled` (a shape already compiled
        comes from the cache): `.as_text()` is the partitioned HLO whose collectives
        `jmem.serve.tensor_parallel.step_collectives` counts, `.memory_analysis()` one device's bytes."""
        layout = self._layout([], shape)
        sarr = make_arrays([], seeds=[], steps=[], batch=shape.sample_rows, hist_len=shape.hist_len,
                           bias_len=shape.bias_len)
        tokens = jax.ShapeDtypeStruct((shape.tokens,), jnp.int32)
        rows = jax.ShapeDtypeStruct((shape.sample_rows,), jnp.int32)
        return _step_fn.lower(self.graphdef, self._abstract_state,
                              self._abstract_cache.replace(layout=_abstract(layout)), tokens, tokens, tokens,
                              rows, _abstract(sarr), rows).compile()

    def check_adapter(self, adapter_id: str | None) -> None:
        """`UnknownAdapter` (a ValueError) if `adapter_id` is neither None (the base model) nor one of the adapters."""
        if adapter_id is not None and adapter_id not in self.adapters:
            known = ", ".join(self.adapters) or "none loaded"
            raise UnknownAdapter(f"unknown LoRA adapter {adapter_id!r}; accepted: {known}")

    def slot_of(self, adapter_id: str | None) -> int:
        """The slot serving `adapter_id` now (BASE_SLOT for None); the adapter must be resident."""
        self.check_adapter(adapter_id)
        if adapter_id is None:
            return BASE_SLOT
        slot = self.adapter_slots.slot_of(adapter_id)
        if slot is None:
            raise RuntimeError(f"LoRA adapter {adapter_id!r} is not in a device slot; load_adapters first")
        return slot

    def add_adapter(self, info: AdapterInfo) -> None:
        """Serve one more adapter (`jmem.serve.lora.read_adapter`); it waits in host memory until a step
        needs it. `adapters` is replaced, not changed, so a reader iterating the old dict is safe."""
        with self._adapter_lock:
            self.adapter_slots.add(info.name)
            self.adapters = {**self.adapters, info.name: info}

    def remove_adapter(self, name: str) -> None:
        """Stop serving `name` (no request may use it any more); its slot becomes free. LookupError if unknown."""
        with self._adapter_lock:
            if name not in self.adapters:
                raise LookupError(f"LoRA adapter {name!r} is not loaded")
            self.adapter_slots.remove(name)
            self.adapters = {n: a for n, a in self.adapters.items() if n != name}

    def load_adapters(self, names) -> None:
        """Make the adapters `names` (a step's, at most as many as slots) resident, writing those that wait
        in host memory over the least recently used slots no name here uses."""
        names = [n for n in names if n is not None]
        if not names:
            return
        with self._adapter_lock:
            loads = self.adapter_slots.assign(names)
            if loads:
                self.state = state_with_adapters(self.state, [(slot, self.adapters[n].arrays) for n, slot in loads])

    def prompt_logprobs(self, ids: list[int], k: int, adapter_id: str | None = None) -> list:
        """Log-probability of each prompt token given the ones before it, with the `k` most likely
        tokens at each position and the token's rank among all (1: the most likely):
        `[None, (lp, [(id, lp), ...], rank), ...]`, one entry per token (the first has no context).
        One forward pass over the prompt, outside the paged cache (what `echo` with `logprobs`
        scores, as for lm-eval-harness's loglikelihood requests); the length is
        padded to a bucket, and causal attention keeps the padding out of the real positions.
        """
        with self._adapter_lock:  # a consistent (state, slot) pair; the step thread may move adapters after
            self.check_adapter(adapter_id)
            state, info = self.state, self.adapters.get(adapter_id)
            slot = BASE_SLOT if adapter_id is None else self.adapter_slots.slot_of(adapter_id)
        if slot is None:  # waiting in host memory: written into slot 0 of a private copy of the stacked leaves
            state, slot = state_with_adapters(state, [(0, info.arrays)]), 0
        T = len(ids)
        padded = np.zeros(_fine_bucket(T, 16), np.int32)
        padded[:T] = ids
        slots = np.full(padded.shape, slot, np.int32)
        # The most alternatives a request may ask for, whatever this one asks: one program per length.
        top = min(SamplingParams.MAX_LOGPROBS, self.config.vocab_size)
        lp, top_lp, top_ids, rank = _prompt_logprobs_fn(self.graphdef, state, jnp.asarray(padded), top,
                                                        jnp.asarray(slots), self.mesh is not None)
        lp, top_lp, top_ids, rank = np.asarray(lp), np.asarray(top_lp), np.asarray(top_ids), np.asarray(rank)
        return [None] + [(float(lp[t]), [(int(i), float(v)) for i, v in zip(top_ids[t, :k], top_lp[t, :k])],
                          int(rank[t])) for t in range(T - 1)]

    @staticmethod
    def block_bytes(config, block_size: int, kv_dtype: str, tensor_parallel_size: int = 1) -> int:
        """Bytes of one KV-cache block on each device (`num_blocks_for_budget`'s arguments)."""
        configs = config if isinstance(config, (list, tuple)) else [config]
        # int8/fp8: scales included
        per_block = sum(kv_bytes_per_token(c, kv_dtype, block_size) for c in configs) * block_size
        return per_block // tensor_parallel_size  # the heads (values and per-head scales) split evenly

    @staticmethod
    def num_blocks_for_budget(config, budget_bytes: int, block_size: int, kv_dtype: str,
                              tensor_parallel_size: int = 1) -> int:
        """Blocks a per-device budget holds; with tensor parallelism each device stores only its
        `n_kv_heads / tensor_parallel_size` heads of a block, so the same budget holds N times the blocks.
        `config` may be a list of model configs whose caches share the block ids (a model and its draft):
        a block then costs all of them."""
        per_block = ModelRunner.block_bytes(config, block_size, kv_dtype, tensor_parallel_size)
        n = budget_bytes // per_block - 1  # one spare page
        if n < 1:
            raise ValueError(f"a KV-cache budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                             f"({per_block} bytes each per device)")
        return int(n)

    def step(self, out: SchedulerOutput) -> StepResult:
        """Run the scheduled tokens through the model; sample where a sequence reaches its last token."""
        seqs = out.seqs
        if not seqs:
            return StepResult({}, {})
        params = [s.request.params for s in seqs]
        # Each verified position's biases, at its own step (min_tokens bans end at a position).
        biases = [s.request.logit_biases(len(s.request.output_token_ids) + j) if s.samples else {}
                  for s in seqs for j in range(len(s.draft_token_ids) + 1)]
        shape = self._shape_to_run(self._shape_needed(seqs, params, biases))
        T = shape.tokens
        ids = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        slots = np.full(T, BASE_SLOT, np.int32)  # padding rows take the base path
        last = np.zeros(shape.sample_rows, np.int32)
        draft = np.full(shape.sample_rows, NO_DRAFT, np.int32)
        # One sampled row per verified position: a sequence's last real token, then each proposal. Row j
        # of a sequence sees the proposals before it as outputs (penalties) and draws at step out + j.
        row_params, seeds, steps, hists = [], [], [], []
        t = r = 0
        for s in seqs:
            d = s.draft_token_ids
            real = s.num_tokens - len(d)
            ids[t : t + s.num_tokens] = s.request.all_token_ids[s.start : s.start + real] + d
            pos[t : t + s.num_tokens] = np.arange(s.start, s.start + s.num_tokens)
            slots[t : t + s.num_tokens] = self.slot_of(s.request.adapter_id)
            out_ids = s.request.output_token_ids
            for j in range(len(d) + 1):
                last[r + j] = t + real - 1 + j
                draft[r + j] = d[j] if j < len(d) else NO_DRAFT
                row_params.append(s.request.params), seeds.append(s.request.seed)
                steps.append(len(out_ids) + j), hists.append((s.request.prompt_token_ids, out_ids + d[:j]))
            t += s.num_tokens
            r += len(d) + 1
        layout = self._layout([(s.start, s.num_tokens, s.block_ids) for s in seqs], shape)
        sarr = make_arrays(row_params, seeds=seeds, steps=steps, histories=hists, batch=shape.sample_rows,
                           hist_len=shape.hist_len, biases=biases, bias_len=shape.bias_len)
        cache = self.cache.replace(layout=layout)
        outs = _step_fn(self.graphdef, self.state, cache, ids, pos, slots, last, sarr, draft)  # numpy in: one transfer
        toks, lp, top_lp, top_ids, accept, cache = outs
        self.cache = cache.replace(layout=None)
        toks, lp = np.asarray(toks), np.asarray(lp)
        if any(s.draft_token_ids for s in seqs):
            accept = np.asarray(accept)
        want_top = any(p.logprobs for p in params)
        top_lp, top_ids = (np.asarray(top_lp), np.asarray(top_ids)) if want_top else (None, None)
        result = StepResult({}, {})

        def record(req, row, value):
            k = req.params.logprobs
            return (float(value), [(int(top_ids[row, j]), float(top_lp[row, j])) for j in range(k)] if k else [])

        r = 0
        for s in seqs:
            req, d = s.request, s.draft_token_ids
            row, r = r, r + len(d) + 1
            if not s.samples:
                continue
            rid = req.request_id
            kept, kept_lps, final = [], [], None
            for j, x in enumerate(d):  # left to right: the first rejection emits the token drawn there
                if not accept[row + j]:
                    final = (int(toks[row + j]), record(req, row + j, lp[row + j]))
                    break
                kept.append(x), kept_lps.append(record(req, row + j, lp[row + j]))
            if final is None:  # all kept (or none proposed): the bonus token at the row after them
                final = (int(toks[row + len(d)]), record(req, row + len(d), lp[row + len(d)]))
            result.tokens[rid], result.logprobs[rid] = final
            if d:
                result.accepted[rid] = (kept, kept_lps)
                result.num_draft_tokens += len(d)
                result.num_accepted_tokens += len(kept)
        return result


def _abstract(tree):
    """Shapes, dtypes and (multi-device) shardings of a tree's arrays, for ahead-of-time lowering.

    A single-device array gets no sharding, as the jitted call sees an uncommitted one: the
    program compiled from these is then the one the call finds in the jit cache.
    """
    def spec(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.SingleDeviceSharding):
            sharding = None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(spec, tree)


def _flat(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, *leaves)


_COMPILED_SHAPES: collections.defaultdict[tuple, set[StepShape]] = collections.defaultdict(set)


def _compile_if_alive(runner_ref, shape: StepShape) -> None:
    """A queued background compilation holds its runner weakly: a dropped engine's weights and KV
    cache are freed at once, and its queued shapes are skipped."""
    runner = runner_ref()
    if runner is not None:
        runner.compiled_step(shape)


@functools.cache
def _background_compiler() -> concurrent.futures.ThreadPoolExecutor:
    """One thread compiles step shapes for every runner of the process, one at a time."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jmem-step-compile")


def _split_matmuls(split: bool):
    """Quantized matmuls of a model split over devices take the XLA path (dequantize and dot), which
    GSPMD splits with the weight; a Pallas kernel call would need the whole weight on every device."""
    if not split:
        return contextlib.nullcontext()
    from jmem.quant.kernel import matmul_impl

    return matmul_impl("xla")


# One jitted function for every runner: engines over the same model share compiled steps.
@functools.partial(jax.jit, static_argnums=(0, 3, 5))
def _prompt_logprobs_fn(graphdef, state, ids_T, k: int, slots_T, split: bool):
    """Position t: log p(ids[t + 1] | ids[:t + 1]), the top `k` (log-prob, id), f32, and the rank of
    ids[t + 1] (1 + the tokens more likely), with LoRA slot
    `slots_T[t]`. The head runs over chunks of positions: the whole [T, vocab] logits never exist at once.
    `split`: the state is split over devices (`_split_matmuls`)."""
    with _split_matmuls(split):
        return _prompt_logprobs(nnx.merge(graphdef, with_slots(state, slots_T)), ids_T, k)


def _prompt_logprobs(model, ids_T, k: int):
    h_TE = model.hidden(ids_T[None], dropless=True)[0][0]  # an MoE model scores as it decodes: no token dropped
    C = 8  # T is a multiple of 8 (`_fine_bucket(T, 16)`)
    targets_T = jnp.concatenate([ids_T[1:], ids_T[:1]])  # the last position's target is padding

    def chunk(_, xs):
        h_CE, tgt_C = xs
        lsm_CV = jax.nn.log_softmax(model.logits_from_hidden(h_CE[None])[0].astype(jnp.float32), axis=-1)
        top_lp, top_ids = jax.lax.top_k(lsm_CV, k)
        lp_C = jnp.take_along_axis(lsm_CV, tgt_C[:, None], axis=-1)[:, 0]
        rank_C = 1 + jnp.sum(lsm_CV > lp_C[:, None], axis=-1, dtype=jnp.int32)
        return None, (lp_C, top_lp, top_ids, rank_C)

    T, E = h_TE.shape
    _, (lp, top_lp, top_ids, rank) = jax.lax.scan(chunk, None, (h_TE.reshape(T // C, C, E),
                                                                targets_T.reshape(T // C, C)))
    return lp.reshape(T), top_lp.reshape(T, k), top_ids.reshape(T, k), rank.reshape(T)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _step_fn(graphdef, state, cache, ids_T, pos_T, slots_T, last_S, sarr, draft_S):
    # Each token's LoRA slot reaches every MultiLoRA leaf as an argument: one program serves any
    # mix of adapters (a model without them ignores `slots_T`).
    model = nnx.merge(graphdef, with_slots(state, slots_T))
    with _split_matmuls(cache.mesh is not None):
        h_1TE, cache = model.hidden(ids_T[None], positions=pos_T[None], cache=cache)
        h_1SE = h_1TE[:, last_S]
        logits_SV = model.logits_from_hidden(h_1SE)[0]
    if cache.mesh is not None:
        # A vocabulary-parallel head: gather the few sampled rows' logits once, then sample on every
        # device alike, rather than run each sampling reduction (softmax, top-k, top-p) as collectives.
        logits_SV = jax.lax.with_sharding_constraint(logits_SV, jax.sharding.NamedSharding(cache.mesh, P()))
    toks, lp, top_lp, top_ids = sample(logits_SV, sarr)
    # Rows with a proposal at the next position keep it when it is the token drawn there.
    return toks, lp, top_lp, top_ids, verify_rows(toks, draft_S), cache
