"""Engine: scheduler + runner + detokenizer, stepped inline or by a background thread.

Callers add requests and read a `RequestStream` of `RequestOutput`s (new text,
new token ids, finish reason). Everything that touches the scheduler or the
device runs on one thread (the loop thread when started, the caller's thread
when stepping inline); other threads only enqueue commands, so no lock guards
the scheduler.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from flax import nnx

from jmem.checks import check_bool, check_int, is_int, is_number
from jmem.memory import bytes_per_device
from jmem.io.tokenizer import IncrementalDecoder
from jmem.models import LlamaConfig
from jmem.serve.draft import DraftProposer, check_draft
from jmem.serve.kv_cache import KVCacheManager
from jmem.serve.lora import IMPLS, adapter_bytes, read_adapter, stack_adapters
from jmem.serve.ngram import check_speculative_args
from jmem.serve.request import Request, RequestError, SamplingParams, Status, UnknownAdapter, check_fits
from jmem.serve.runner import ModelRunner, check_pool_fits, kv_cache_budget, resident_bytes
from jmem.serve.scheduler import Scheduler, SchedulerConfig
from jmem.serve.tensor_parallel import state_shardings

log = logging.getLogger("jmem.serve")


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits and KV-cache sizing.

    Attributes:
        block_size: tokens per KV block.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed per step.
        max_model_len: longest prompt + output (a KV cache that cannot hold it is an error); None: the
            model's `max_seq_len`, or as many tokens as the KV cache holds when that is fewer (a warning).
        kv_cache_dtype: auto | bf16 | fp8_e4m3 | int8.
        kv_cache_memory: KV-cache budget in bytes (wins over memory_utilization).
        memory_utilization: fraction of device memory for weights + KV cache.
        num_blocks: exact pool size in blocks (tests); wins over both budgets.
        enable_prefix_caching: share cached prompt blocks between requests.
        static_batching: admit a new batch only when the previous one has finished (benchmark baseline).
        attention_impl: paged attention: auto | tiled | kernel (see `PagedKVCache.create`).
        max_loras: LoRA adapter slots on the device, the most adapters one step uses (None: one per
            adapter given to the engine, at least one). Fewer slots than adapters: the others wait in host
            memory and move into a slot when a step needs them (`jmem.serve.lora_slots`).
        max_lora_rank: the largest adapter rank accepted (slots are padded to the largest one loaded, or to
            this rank with allow_runtime_lora).
        allow_runtime_lora: adapters may be loaded and unloaded while serving (`Engine.load_adapter`,
            `Engine.unload_adapter`); the slots then hold every target (linears, experts) at max_lora_rank.
        lora_impl: batched adapter matmul: onehot | ragged (see `jmem.serve.lora`).
        tensor_parallel_size: local devices to split the model over (Megatron tensor parallelism,
            `jmem.serve.tensor_parallel`); the KV budgets are per device, so the pool holds this
            many times the tokens.
        num_speculative_tokens: speculative decoding: tokens proposed per decode and verified in the same
            step (0: off), by the engine's draft model when it has one, else by n-gram (prompt-lookup)
            matches in the sequence's own earlier tokens. Outputs keep the distribution (greedy: the
            exact tokens) of decoding without it.
        prompt_lookup_max: longest suffix of a sequence looked up for a proposal (down to 1).
    """

    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None
    memory_utilization: float | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    static_batching: bool = False
    attention_impl: str = "auto"
    max_loras: int | None = None
    max_lora_rank: int = 16
    lora_impl: str = "onehot"
    allow_runtime_lora: bool = False
    tensor_parallel_size: int = 1
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 3

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            check_int(name, getattr(self, name), 1)
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1)
        if self.max_model_len is not None and not is_int(self.max_model_len):  # its range: the model's (Engine)
            raise ValueError(f"max_model_len={self.max_model_len!r}; accepted: an integer in 1..the model's "
                             "max_seq_len, or None")
        mu, kv = self.memory_utilization, self.kv_cache_memory
        if mu is not None and not (is_number(mu) and 0 < mu <= 1):  # True counted as 1.0
            raise ValueError(f"memory_utilization={mu!r}; accepted: a fraction in (0, 1], or None")
        if kv is not None and not (is_number(kv) and 0 < kv < float("inf")):
            raise ValueError(f"kv_cache_memory={kv!r}; accepted: a number of bytes > 0, or None")
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        check_int("prompt_lookup_max", self.prompt_lookup_max, 0)  # >= 1 with speculation (Engine checks)
        # The adapter settings are checked with or without adapters: a typo would otherwise wait for the first one.
        if self.max_loras is not None:
            check_int("max_loras", self.max_loras, 1)
        check_int("max_lora_rank", self.max_lora_rank, 1)
        if self.lora_impl not in IMPLS:
            raise ValueError(f"lora_impl={self.lora_impl!r}; accepted: {', '.join(IMPLS)}")
        for name in ("enable_prefix_caching", "static_batching", "allow_runtime_lora"):
            check_bool(name, getattr(self, name))


@dataclass
class RequestOutput:
    """One update of one request: the text and tokens added since the previous update."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # per new token: (logprob, [(id, logprob), ...])
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None  # the request field at fault (None: the engine failed, not the request)
    stop_reason: str | int | None = None  # as vLLM: the stop string or stop token id that ended it (EOS: None)


class RequestStream:
    """Outputs of one request, readable synchronously (`get`) or with `async for`."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._loop = loop
        self._q: queue.Queue | asyncio.Queue = asyncio.Queue() if loop else queue.Queue()

    def put(self, item: RequestOutput) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._q.put_nowait, item)
            except RuntimeError:  # the loop is closed (the server shut down): no one reads the stream
                pass
        else:
            self._q.put(item)

    def get(self, timeout: float | None = None) -> RequestOutput:
        return self._q.get(timeout=timeout)

    def get_nowait(self) -> RequestOutput | None:
        try:
            return self._q.get_nowait()
        except (queue.Empty, asyncio.QueueEmpty):
            return None

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if getattr(self, "_done", False):
            raise StopAsyncIteration
        item = await self._q.get()
        self._done = item.finished
        return item


def _stop_reason(req: Request, detok: "_Detok"):
    """vLLM's `stop_reason` of a finished request: the stop string matched, else the stop token id that
    ended it, else None (EOS, the length limit, an abort)."""
    if detok.matched is not None:
        return detok.matched
    ids = req.output_token_ids
    if req.status is not Status.FINISHED_STOPPED or not ids:
        return None
    if ids[-1] in req.eos_token_ids and not req.params.ignore_eos:
        return None
    return ids[-1] if ids[-1] in req.params.stop_token_ids else None


class _Detok:
    """Incremental text of one request (`IncrementalDecoder`: each update decodes only a short tail),
    with stop strings and held-back partial characters."""

    def __init__(self, tokenizer, params: SamplingParams):
        self._text = IncrementalDecoder(tokenizer, params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0
        self.num_ids = 0  # output tokens already emitted
        self.unchecked = 0  # characters no stop string may end within (those before min_tokens)
        self.matched: str | None = None  # the stop string that ended the output

    def update(self, ids: list[int], finished: bool, check_stop: bool = True) -> tuple[str, bool]:
        """New text to emit and whether a stop string ended the output (looked for only when
        `check_stop`, and then only strings that end past the text of the updates without it: as
        vLLM's `min_tokens`)."""
        text = self._text(ids)
        if not finished:  # an unfinished UTF-8 sequence at the end is no text yet (nor part of a stop string)
            end = len(text)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            text = text[:end]
        if not check_stop:
            self.unchecked = len(text)
        hits = [(i, len(s), s) for s in (self.stop if check_stop else ())
                if (i := text.find(s, max(0, self.sent - len(s), self.unchecked - len(s) + 1))) >= 0]
        if hits:  # the output ends at the earliest stop string (the shortest of those starting there)
            at, length, self.matched = min(hits)
            text = text[: at + length if self.include_stop else at]
            out = text[self.sent :]
            self.sent = len(text)
            return out, True
        end = len(text) - (0 if finished else self.hold)
        out = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out, False


class Engine:
    """Continuous-batching engine for one model.

    Args:
        model: a `jmem.models.Llama`.
        tokenizer: with `encode`, `decode`, `eos_id` (as `jmem.load(...).tokenizer`).
        config: limits and KV sizing.
        lora_modules: LoRA adapter name -> file written by `jmem.lora.save_adapters` (or PEFT directory), all
            served at once (`add_request(..., adapter=name)`); stacked on the device at startup.
        draft_model: a smaller `jmem.models.Llama` with the model's vocabulary that proposes
            `config.num_speculative_tokens` tokens per decode (`jmem.serve.draft`); its weights and
            its KV cache (same blocks as the model's) count against the memory budgets.

    Example:
        >>> lm = jmem.load("tiny")
        >>> engine = Engine(lm.model, lm.tokenizer, EngineConfig(num_blocks=64), lora_modules={"sql": "sql.npz"})
        >>> engine.generate([lm.tokenizer.encode("hello")], SamplingParams(max_tokens=4, temperature=0),
        ...                 adapters=["sql"])
    """

    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), lora_modules: dict | None = None,
                 draft_model=None):
        if draft_model is not None and not isinstance(getattr(draft_model, "config", None), LlamaConfig):
            raise ValueError(f"draft_model={draft_model!r:.80}; accepted: a model (jmem.load(...).model; "
                             "jmem.serve.draft.load_draft takes a name or path)")
        if lora_modules is not None and not isinstance(lora_modules, dict):
            raise ValueError(f"lora_modules={lora_modules!r:.80}; accepted: a dict of adapter name -> .npz path")
        bad = next((n for n, p in (lora_modules or {}).items() if not isinstance(p, (str, os.PathLike))), None)
        if bad is not None:
            raise ValueError(f"LoRA module {bad!r} path {lora_modules[bad]!r:.80}; accepted: a path to an .npz "
                             "written by jmem.lora.save_adapters")
        check_speculative_args(config.num_speculative_tokens, config.prompt_lookup_max, draft_model=draft_model)
        self.config = config
        self.tokenizer = tokenizer
        mcfg = model.config
        max_len = mcfg.max_seq_len if config.max_model_len is None else config.max_model_len
        if not 1 <= max_len <= mcfg.max_seq_len:
            raise ValueError(f"max_model_len={max_len} is out of range; accepted: 1..{mcfg.max_seq_len} "
                             f"(the model's context length)")
        tp = config.tensor_parallel_size
        mesh = None
        # Refusals before the weights move: sizes here (True equals 1 but is no size), unsplittable leaves below.
        if tp != 1 or not is_int(tp):
            from jmem.serve.tensor_parallel import check_tensor_parallel, tensor_mesh

            check_tensor_parallel(mcfg, tp)
            if draft_model is not None:
                try:
                    check_tensor_parallel(draft_model.config, tp)
                except ValueError as e:
                    raise type(e)(f"draft model: {e}") from None
            mesh = tensor_mesh(tp)
        if draft_model is not None:
            check_draft(mcfg, draft_model.config, max_len)
        adapters, num_slots = {}, None  # name -> jmem.serve.lora.AdapterInfo
        if lora_modules or config.allow_runtime_lora:  # stacked before sizing the KV cache: adapters are weights
            model, adapters = stack_adapters(model, dict(lora_modules or {}), max_loras=config.max_loras,
                                             max_lora_rank=config.max_lora_rank, impl=config.lora_impl,
                                             runtime_loading=config.allow_runtime_lora)
            num_slots = max(len(adapters), 1) if config.max_loras is None else config.max_loras
        self.adapter_bytes = adapter_bytes(model)
        models = [model] if draft_model is None else [model, draft_model]
        # What one device holds of the weights (adapters and draft included) once they are split.
        self.weight_bytes = sum(bytes_per_device(state, None if mesh is None else state_shardings(state, mesh))
                                for state in map(nnx.state, models))
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            # On one device the runner serves the weights where they are: those already on it are in
            # its bytes in use. Split across devices, each one's part is a new copy.
            resident = 0 if mesh is not None else sum(resident_bytes(nnx.state(m)) for m in models)
            budget = kv_cache_budget(self.weight_bytes, config.kv_cache_memory, config.memory_utilization,
                                     resident_weight_bytes=resident)
            num_blocks = ModelRunner.num_blocks_for_budget([m.config for m in models], budget, config.block_size,
                                                           config.kv_cache_dtype, tp)
        check_pool_fits(num_blocks, ModelRunner.block_bytes([m.config for m in models], config.block_size,
                                                            config.kv_cache_dtype, tp), self.weight_bytes)
        capacity = num_blocks * config.block_size
        if capacity < max_len:
            if config.max_model_len is not None:  # asked for: refuse rather than serve a shorter context
                raise ValueError(f"max_model_len={max_len} does not fit the KV cache, which holds {capacity} tokens "
                                 f"({num_blocks} blocks of {config.block_size}); accepted: max_model_len <= "
                                 f"{capacity}, or more KV-cache memory (kv_cache_memory, memory_utilization, "
                                 f"num_blocks)")
            log.warning("the KV cache holds %d tokens, fewer than the model's context of %d: a request's prompt "
                        "+ max_tokens is limited to %d", capacity, max_len, capacity)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                    static_batching=config.static_batching,
                                    num_speculative_tokens=config.num_speculative_tokens,
                                    draft_model=draft_model is not None,
                                    prompt_lookup_max=config.prompt_lookup_max,
                                    max_loras=num_slots)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.max_num_seqs, max_len,
                                  config.kv_cache_dtype, config.attention_impl,
                                  adapters, mesh=mesh)
        self.drafter = None if draft_model is None else DraftProposer(
            draft_model, num_blocks, config.block_size, config.max_num_seqs, max_len, config.kv_cache_dtype,
            config.attention_impl, mesh)
        self.eos_ids = tuple(i for i in [getattr(tokenizer, "eos_id", None)] if i is not None)
        self.num_kv_tokens = num_blocks * config.block_size
        if tp > 1:
            log.info("tensor parallel over %d devices: each holds %d of %d kv heads of every block, so the KV "
                     "cache holds %d tokens (about %d times what the same per-device memory holds on one device)",
                     tp, mcfg.n_kv_heads // tp, mcfg.n_kv_heads, self.num_kv_tokens, tp)
        self._streams: dict[str, RequestStream] = {}
        self._detok: dict[str, _Detok] = {}
        self._commands: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._adapter_versions = itertools.count(1)  # of adapters loaded while serving
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the stats read by `metrics` from other threads
        self.stats = collections.Counter()
        self._token_times: collections.deque = collections.deque()
        self.started = time.monotonic()

    def precompile(self) -> None:
        """Compile the largest step shapes now, so that no step waits for XLA while serving
        (`ModelRunner.precompile`: smaller shapes then compile on a background thread)."""
        start = time.monotonic()
        shapes = self.runner.precompile(self.config.max_num_batched_tokens, self.config.num_speculative_tokens)
        if self.drafter is not None:
            # The draft's first pass of a step may feed one token more per sequence than the budget
            # (the last proposal of a fully kept round, which it never fed).
            shapes += self.drafter.runner.precompile(self.config.max_num_batched_tokens + self.config.max_num_seqs)
        log.info("compiled %d step shapes in %.1f s; others compile in the background", len(shapes),
                 time.monotonic() - start)

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def adapters(self) -> dict:
        """The LoRA adapters served now: name -> `jmem.serve.lora.AdapterInfo` (a snapshot)."""
        return self.runner.adapters

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter file `path` (written by `jmem.lora.save_adapters`) as `name` from now on,
        without a restart or a new compilation (thread-safe; needs `allow_runtime_lora`). It waits in
        host memory until a request uses it. ValueError: loading is off, the name is taken, or the file
        does not fit the slots (its rank, targets or shapes)."""
        self._check_runtime_lora()
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise RequestError(f"LoRA adapter name {name!r}; accepted: a non-empty string without surrounding "
                               "spaces", "lora_name")
        if name in self.adapters:
            raise RequestError(f"LoRA adapter {name!r} is already loaded; accepted: a new name, or unload it first",
                               "lora_name")
        info = read_adapter(name, path, self.runner.state, self.config.max_lora_rank, next(self._adapter_versions))
        try:
            self.runner.add_adapter(info)
        except ValueError as e:  # the same name loaded by another thread meanwhile
            raise RequestError(str(e), "lora_name") from None
        log.info("LoRA adapter %s (rank %d, %s) loaded", name, info.rank, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving the adapter `name` (thread-safe; needs `allow_runtime_lora`); its device slot is
        free again. LookupError: no adapter of that name. ValueError: requests that use it have not finished
        (nothing is cut short: unload it after they end)."""
        self._check_runtime_lora()
        if name not in self.adapters:
            raise LookupError(f"LoRA adapter {name!r} is not loaded; loaded: {', '.join(self.adapters) or 'none'}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("unload_adapter", name, done))  # in order with the requests queued before it
        if self._thread is None:
            self._drain_commands(block=False)
        done.result()
        log.info("LoRA adapter %s unloaded", name)

    def _check_runtime_lora(self) -> None:
        if not self.config.allow_runtime_lora:
            raise ValueError("loading and unloading LoRA adapters while serving is off; accepted: an engine "
                             "started with allow_runtime_lora=True (jmem serve --allow-runtime-lora)")

    def _unload(self, name: str, done: concurrent.futures.Future) -> None:
        """The step thread's side of `unload_adapter`: the scheduler's requests are all known here."""
        users = [r for r in self.scheduler.requests.values() if r.adapter_id == name]
        try:
            if users:
                raise ValueError(f"LoRA adapter {name!r} serves {len(users)} unfinished request(s); accepted: "
                                 "unload it once they have finished")
            self.runner.remove_adapter(name)
        except (LookupError, ValueError) as e:
            done.set_exception(e)
        else:
            done.set_result(None)

    # ------------------------------------------------------------------ requests
    @property
    def max_request_tokens(self) -> int:
        return self.scheduler.max_request_tokens

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    loop: asyncio.AbstractEventLoop | None = None, adapter: str | None = None) -> RequestStream:
        """Queue a request (thread-safe); ValueError for bad parameters, an unknown adapter or a prompt
        that cannot fit (`check_request`). `adapter`: a LoRA adapter name given to the engine, None for the
        base model."""
        prompt_ids = self.check_request(prompt_ids, params, adapter)
        rid = request_id or f"req-{next(self._ids)}"
        # Unseeded: 63 fresh bits from the OS (a program's random.seed() does not make requests repeat).
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(rid, list(prompt_ids), params, eos_token_ids=self.eos_ids, adapter_id=adapter,
                      adapter_version=0 if adapter is None else getattr(self.adapters.get(adapter), "version", -1),
                      seed=seed % (1 << 64))  # validate() bounds it to 64 bits: one word per seed
        stream = RequestStream(rid, loop)
        self._commands.put(("add", req, stream))
        return stream

    def check_request(self, prompt_ids, params: SamplingParams, adapter: str | None = None) -> list[int]:
        """The prompt's ids as a list when `add_request` would queue the request, else its ValueError
        (nothing is queued: a batch checks every prompt before queuing any)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params of type {type(params).__name__}; accepted: a jmem.serve.request.SamplingParams",
                               "params")
        if hasattr(prompt_ids, "__array__"):  # a NumPy or JAX array of ids
            prompt_ids = np.asarray(prompt_ids).tolist()
        if not isinstance(prompt_ids, (list, tuple)):
            raise RequestError(f"prompt of type {type(prompt_ids).__name__}; accepted: a list of integer token ids",
                               "prompt")
        params.validate()
        self.runner.check_adapter(adapter)
        check_fits(len(prompt_ids), params.max_tokens, self.max_request_tokens)
        self._check_ids("prompt", prompt_ids)
        self._check_ids("stop_token_ids", params.stop_token_ids)
        self._check_ids("logit_bias", list(params.logit_bias or ()))
        return list(prompt_ids)

    def _check_ids(self, what: str, ids) -> None:
        """Token ids must be integers of the model's vocabulary (the embedding would clamp others)."""
        vocab = self.runner.config.vocab_size
        if not all(is_int(t) for t in ids):
            bad = next(t for t in ids if not is_int(t))
            raise RequestError(f"{what} holds {bad!r}; accepted: integer token ids 0..{vocab - 1}", what)
        if len(ids) and not 0 <= min(ids) <= max(ids) < vocab:
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise RequestError(f"{what} holds token id {bad}; accepted: 0..{vocab - 1}", what)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """RequestError unless `prompt_ids` is a non-empty list of vocabulary ids that fits the context."""
        if len(prompt_ids) == 0:
            raise RequestError("the prompt is empty; accepted: at least one token", "prompt")
        self._check_ids("prompt", prompt_ids)
        if len(prompt_ids) > self.max_request_tokens:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; accepted: at most {self.max_request_tokens}",
                               "prompt")

    def prompt_logprobs(self, prompt_ids: list[int], k: int = 0, adapter: str | None = None) -> list:
        """Each prompt token's log-probability given the tokens before it, with the top `k`
        (0..20) and its rank: `[None, (lp, [(id, lp), ...], rank), ...]` (see `ModelRunner.prompt_logprobs`).
        Safe to call from any thread; it does not touch the paged cache or the schedule."""
        self.check_prompt(prompt_ids)
        if not 0 <= k <= SamplingParams.MAX_LOGPROBS:
            raise RequestError(f"logprobs={k} is out of range; accepted: 0..{SamplingParams.MAX_LOGPROBS}", "logprobs")
        return self.runner.prompt_logprobs(list(prompt_ids), k, adapter)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (thread-safe; unknown ids are ignored)."""
        self._commands.put(("abort", request_id, None))

    def abort_all(self) -> None:
        """Stop every queued or running request, as `abort` each (thread-safe)."""
        self._commands.put(("abort_all", None, None))

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                cmd, a, b = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd == "unload_adapter":
                self._unload(a, b)
            elif cmd == "add":
                info = self.adapters.get(a.adapter_id)
                try:
                    if a.adapter_id is not None and (info is None or info.version != a.adapter_version):
                        raise UnknownAdapter(f"LoRA adapter {a.adapter_id!r} was unloaded before the request started")
                    self.scheduler.add_request(a)
                except ValueError as e:
                    b.put(RequestOutput(a.request_id, "", [], finished=True, finish_reason="error", error=str(e),
                                        error_param=getattr(e, "param", None)))
                    continue
                self._streams[a.request_id] = b
                self._detok[a.request_id] = _Detok(self.tokenizer, a.params)
            elif cmd == "abort_all":
                for rid in list(self._streams):
                    self._commands.put(("abort", rid, None))
            elif cmd == "abort":
                req = self.scheduler.finish(a, Status.FINISHED_ABORTED)
                stream = self._streams.pop(a, None)
                detok = self._detok.pop(a, None)
                if req is not None and stream is not None:
                    with self._lock:
                        self.stats["requests_aborted"] += 1
                    # The text held back (a partial character, a possible stop string's start) goes out, and
                    # usage counts the tokens generated (0 before: an aborted request was billed none).
                    ids = req.output_token_ids
                    first = detok.num_ids if detok is not None else len(ids)
                    text = detok.update(ids, True, check_stop=False)[0] if detok is not None else ""
                    lp = req.output_logprobs[first:] if req.params.logprobs is not None else []
                    stream.put(RequestOutput(a, text, ids[first:], lp, True, "abort", req.num_prompt_tokens, len(ids),
                                             req.num_cached_tokens))

    # ------------------------------------------------------------------ stepping
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or not self._commands.empty()

    def step(self) -> None:
        """Admit queued commands, run one scheduled batch, emit outputs."""
        self._drain_commands(block=False)
        if not self.scheduler.has_unfinished():
            return
        out = self.scheduler.schedule()
        try:
            self.runner.load_adapters({s.request.adapter_id for s in out.seqs})
            if self.drafter is not None:
                self.drafter.propose(out)
            res = self.runner.step(out)
        except Exception as e:  # a failed step fails its requests, not the server
            log.exception("engine step failed")
            self.kv.discard_unwritten()  # its blocks were not written: no prefix hits on them
            for seq in out.seqs:
                self._fail(seq.request.request_id, f"internal error: {e}")
            return
        now = time.monotonic()
        before = {s.request.request_id: len(s.request.output_token_ids) for s in out.seqs}
        touched = self.scheduler.update_from_output(out, res.tokens, res.logprobs, res.accepted)
        if self.drafter is not None:
            self.drafter.update(out, res.accepted, self.scheduler.requests)
        ready = []  # (stream, output): put once the stats count this step, so a reader of both agrees
        for req in touched:
            try:
                ready.append(self._output(req))
            except Exception as e:  # e.g. the tokenizer failing: the request ends, its stream hears of it
                log.exception("engine output of request %r failed", req.request_id)
                self._fail(req.request_id, f"internal error: {type(e).__name__}: {e}")
        # What the outputs grew by, once a stop has cut kept proposals after it (they were never output).
        generated = sum(len(req.output_token_ids) - before.get(req.request_id, 0) for req in touched)
        with self._lock:
            self.stats["steps"] += 1
            self.stats["tokens_computed"] += out.num_tokens
            self.stats["tokens_generated"] += generated
            self.stats["spec_draft_tokens"] += res.num_draft_tokens
            self.stats["spec_accepted_tokens"] += res.num_accepted_tokens
            self.stats["preemptions"] = self.scheduler.num_preemptions
            self._token_times.append((now, generated))
            while self._token_times and now - self._token_times[0][0] > 10.0:
                self._token_times.popleft()
        for stream, output in filter(None, ready):
            stream.put(output)

    def _output(self, req: Request) -> tuple[RequestStream, RequestOutput] | None:
        """The request's stream and its new output (text, ids, logprobs) since the last; a stop cuts
        `req.output_token_ids` after the token that completes it. None without a stream."""
        rid = req.request_id
        stream, detok = self._streams.get(rid), self._detok.get(rid)
        if stream is None:
            return None
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        done = req.status.finished
        ids = req.output_token_ids
        # A step may add several tokens (accepted proposals): the text grows one token at a time, as
        # without speculation, so a stop string cuts the output at the token that completes it.
        first, deltas, hit_stop, finished = detok.num_ids, [], False, done
        for m in range(first + 1, len(ids) + 1):
            finished = done and m == len(ids)
            # A stop token id (or EOS, unless ignored) ends the output without appearing in the text
            # (unless include_stop_str_in_output: then its text is there when it has one).
            stopped_by_token = (finished and req.status is Status.FINISHED_STOPPED
                                and not req.params.include_stop_str_in_output) and (
                ids[-1] in req.params.stop_token_ids or (ids[-1] in req.eos_token_ids and not req.params.ignore_eos))
            delta, hit_stop = detok.update(ids[: m - 1] if stopped_by_token else ids[:m], finished,
                                           check_stop=m >= req.params.min_tokens)
            deltas.append(delta)
            if hit_stop:
                if m < len(ids):  # the tokens after the stop were never part of the output
                    del ids[m:], req.output_logprobs[m:]
                if not done:
                    self.scheduler.finish(rid, Status.FINISHED_STOPPED)
                finished = True
                break
        detok.num_ids = len(ids)
        lp = req.output_logprobs[first:] if req.params.logprobs is not None else []
        reason = ("stop" if hit_stop else req.status.value) if finished else None
        out = RequestOutput(rid, "".join(deltas), ids[first:], lp, finished, reason,
                            req.num_prompt_tokens, len(ids), req.num_cached_tokens,
                            stop_reason=_stop_reason(req, detok) if finished else None)
        if finished:
            self._streams.pop(rid, None)
            self._detok.pop(rid, None)
            with self._lock:
                self.stats["requests_finished"] += 1
        return stream, out

    def _fail(self, rid: str, message: str) -> None:
        self.scheduler.finish(rid, Status.FINISHED_ABORTED)
        stream = self._streams.pop(rid, None)
        self._detok.pop(rid, None)
        if stream is not None:
            with self._lock:
                self.stats["requests_failed"] += 1
            stream.put(RequestOutput(rid, "", [], finished=True, finish_reason="error", error=message))

    def run_until_idle(self) -> None:
        """Step inline until every queued request has finished (no background thread)."""
        while self.has_unfinished():
            self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 adapters: list[str | None] | None = None) -> list[RequestOutput]:
        """Blocking batch helper: all prompts at once, one merged output per prompt (text, all token ids);
        `adapters`: one LoRA adapter name (or None) per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts; accepted: one, or one "
                             "per prompt")
        adapters = [None] * len(prompts) if adapters is None else adapters
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts; accepted: one per prompt")
        streams = []
        try:
            for p, sp, a in zip(prompts, params_list, adapters):
                streams.append(self.add_request(p, sp, adapter=a))
        except ValueError:  # a bad prompt, parameter or adapter: none of the batch runs
            for s in streams:
                self.abort(s.request_id)
            if self._thread is None:
                self._drain_commands(block=False)
            raise
        if self._thread is None:
            self.run_until_idle()
        results = []
        for s in streams:
            text, ids, lps = [], [], []
            while True:
                o = s.get()
                text.append(o.text), ids.extend(o.token_ids), lps.extend(o.logprobs)
                if o.finished:
                    break
            results.append(RequestOutput(s.request_id, "".join(text), ids, lps, True, o.finish_reason,
                                         o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens, o.error,
                                         o.error_param, o.stop_reason))
        return results

    # ------------------------------------------------------------------ background loop
    def start(self) -> bool:
        """Run the step loop on a daemon thread; False when it was running already."""
        if self._thread is not None:
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="jmem-engine", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop the background loop; requests still queued or running end with finish_reason "abort"
        and their blocks are freed (their streams get a final output, nothing waits forever); step
        shapes queued for background compilation are dropped."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        for runner in [self.runner] + ([] if self.drafter is None else [self.drafter.runner]):
            runner.cancel_compilations()  # after the loop: only its thread reads the compilations otherwise
        self.abort_all()
        self._drain_commands(block=False)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.scheduler.has_unfinished():
                    self._drain_commands(block=True)
                    continue
                self.step()
            except Exception:  # keep serving: fail what was running, go on
                log.exception("engine loop error")
                self.kv.discard_unwritten()
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._fail(req.request_id, "internal error in the engine loop")

    # ------------------------------------------------------------------ metrics
    METRICS_HELP = {
        "num_requests_running": "Requests scheduled in the running batch.",
        "num_requests_waiting": "Requests waiting to be scheduled (new or preempted).",
        "kv_cache_blocks": "KV-cache blocks in the pool.",
        "kv_cache_blocks_in_use": "KV-cache blocks held by requests.",
        "kv_cache_usage": "Fraction of the KV-cache blocks held by requests.",
        "kv_cache_token_utilization": "Token slots of the blocks in use that hold computed tokens (0..1).",
        "kv_cache_capacity_tokens": "Tokens the KV cache holds.",
        "prefix_cache_hit_rate": "Prompt tokens found in the prefix cache over those looked up.",
        "prefix_cache_hit_tokens_total": "Prompt tokens found in the prefix cache.",
        "prefix_cache_query_tokens_total": "Prompt tokens looked up in the prefix cache.",
        "generation_tokens_per_second": "Generated tokens per second over the last 10 seconds.",
        "generation_tokens_total": "Tokens generated.",
        "computed_tokens_total": "Tokens computed by the model (prefill and decode).",
        "preemptions_total": "Requests preempted (their KV blocks freed, recomputed later).",
        "requests_finished_total": "Requests finished by a stop condition or their length limit.",
        "requests_aborted_total": "Requests aborted (client gone, or shutdown).",
        "requests_failed_total": "Requests ended by an error in the engine.",
        "engine_steps_total": "Model steps run.",
        "spec_decode_num_draft_tokens_total": "Speculative tokens proposed.",
        "spec_decode_num_accepted_tokens_total": "Speculative tokens accepted.",
        "step_compilations": "Step shapes compiled so far.",
        "step_compilations_blocking_total": "Steps that waited for a compilation.",
        "lora_adapter_loads_total": "LoRA adapters written into device slots.",
        "lora_adapters": "LoRA adapters served.",
    }
    """One line per `metrics` key: the HELP text of `/metrics`."""

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for `/metrics` (safe to call from any thread; `METRICS_HELP` says what each is)."""
        kv, sched = self.kv, self.scheduler
        runners = [self.runner] + ([] if self.drafter is None else [self.drafter.runner])  # compiled steps of both
        used_blocks = kv.pool.num_used
        running = list(sched.running)
        filled: dict[int, int] = {}  # block id -> its slots holding computed tokens (shared prefix blocks once)
        bs = kv.block_size
        for r in running:
            for k, block in enumerate(kv.blocks_of(r.request_id)):
                filled[block] = max(filled.get(block, 0), min(bs, max(0, r.num_computed_tokens - k * bs)))
        slots_used = sum(filled.values())
        with self._lock:
            now = time.monotonic()
            window = [n for t, n in self._token_times if now - t <= 10.0]
            span = min(10.0, max(now - self.started, 1e-6))
            return {
                "num_requests_running": len(running),
                "num_requests_waiting": len(sched.waiting),
                "kv_cache_blocks": kv.pool.num_blocks,
                "kv_cache_blocks_in_use": used_blocks,
                "kv_cache_usage": kv.usage,
                "kv_cache_token_utilization": slots_used / (used_blocks * kv.block_size) if used_blocks else 0.0,
                "kv_cache_capacity_tokens": self.num_kv_tokens,
                "prefix_cache_hit_rate": kv.prefix_hit_rate,
                "prefix_cache_hit_tokens_total": kv.prefix_hits,
                "prefix_cache_query_tokens_total": kv.prefix_queries,
                "generation_tokens_per_second": sum(window) / span,
                "generation_tokens_total": self.stats["tokens_generated"],
                "computed_tokens_total": self.stats["tokens_computed"],
                "preemptions_total": sched.num_preemptions,
                "requests_finished_total": self.stats["requests_finished"],
                "requests_aborted_total": self.stats["requests_aborted"],
                "requests_failed_total": self.stats["requests_failed"],
                "engine_steps_total": self.stats["steps"],
                "spec_decode_num_draft_tokens_total": self.stats["spec_draft_tokens"],
                "spec_decode_num_accepted_tokens_total": self.stats["spec_accepted_tokens"],
                "step_compilations": sum(r.num_compilations for r in runners),
                "step_compilations_blocking_total": sum(r.num_blocking_compilations for r in runners),
                "lora_adapter_loads_total": self.runner.adapter_slots.num_loads,
                "lora_adapters": len(self.adapters),
            }

