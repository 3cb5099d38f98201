"""Continuous-batching scheduler (no JAX): which tokens of which requests run each step.

Each step has a token budget (`max_num_batched_tokens`) and a cap on running
sequences (`max_num_seqs`). Running requests go first (decodes take one token,
unfinished prefills take a chunk), then waiting requests in arrival order (FCFS)
with chunked prefill. When the pool runs out of blocks the most recently
arrived running request is preempted: its blocks are freed and it goes back to
the front of the queue with its outputs kept, to be recomputed later
(preemption by recompute), so no request is lost or truncated.

With LoRA adapters in fewer device slots than adapters (`max_loras`), a step
runs at most `max_loras` distinct adapters. A waiting request whose adapter
would be one too many is passed over, and requests behind it are admitted. So
that it is not passed over forever, the adapter with the fewest requests among
those running before the step then admits no new ones until it has drained and
freed its slot (an adapter admitted in this step still batches its requests).

Every request's tokens are one list (prompt + outputs), and a step simply
computes the next `n` uncomputed ones; prefill, chunked prefill, decode and
recompute after preemption are the same operation.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from jmem.serve.kv_cache import KVCacheManager
from jmem.serve.ngram import check_speculative_args, propose_ngram
from jmem.serve.request import Request, Status, check_fits

PENDING_PROPOSAL = -1  # a reserved proposal place, filled by a draft model before the step runs


@dataclass
class ScheduledSeq:
    """One request's slice of a step: compute tokens [start, start + num_tokens).

    With speculation, a decode's last `len(draft_token_ids)` positions hold proposed tokens (past the
    request's own tokens), verified by the logits at each position.
    """

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this slice reaches the request's last token, so its logits give a new token."""
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass
class SchedulerConfig:
    """Limits of one step.

    Attributes:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed in one step.
        max_model_len: longest sequence (prompt + output) accepted.
        chunked_prefill: split long prompts over several steps; off means a prompt
            that does not fit the remaining budget waits for the next step.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    chunked_prefill: bool = True
    static_batching: bool = False
    """Admit new requests only when none is running (a batch waits for its longest request); for comparison."""
    num_speculative_tokens: int = 0
    """Tokens proposed per decode (0: no speculation)."""
    draft_model: bool = False
    """Proposals come from a draft model run after `schedule` (`jmem.serve.draft`): decodes get
    `num_speculative_tokens` placeholders (`PENDING_PROPOSAL`), with their blocks and budget reserved.
    False: n-gram lookup in the sequence's own tokens."""
    prompt_lookup_max: int = 3
    """Longest suffix looked up for a proposal (shorter ones down to 1 are tried next)."""
    max_loras: int | None = None
    """Most distinct LoRA adapters among running requests (None: no limit)."""


class Scheduler:
    """FCFS scheduler with a token budget, chunked prefill and preemption by recompute.

    Example:
        >>> s = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=64, block_size=16))
        >>> s.add_request(Request("a", [1, 2, 3]))
        >>> out = s.schedule()           # run the model on `out`, then:
        >>> advanced = s.update_from_output(out, {"a": 7})
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        if not config.chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} < max_model_len={config.max_model_len}: "
                "without chunked prefill a recomputed sequence must fit one step"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_loras"):
            if getattr(config, name) is not None and getattr(config, name) < 1:
                raise ValueError(f"{name}={getattr(config, name)}; need >= 1")
        check_speculative_args(config.num_speculative_tokens, config.prompt_lookup_max)
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def max_request_tokens(self) -> int:
        """Longest prompt + max_tokens one request may have: the model length and the whole pool."""
        return min(self.config.max_model_len, self.kv.capacity_tokens)

    def add_request(self, req: Request) -> None:
        """Queue a request; ValueError if it could never fit."""
        check_fits(req.num_prompt_tokens, req.params.max_tokens, self.max_request_tokens)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.status = Status.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens; allocates their blocks."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._propose(req, budget) if n == req.num_tokens - req.num_computed_tokens == 1 else []
            while True:
                blocks = self.kv.allocate_slots(req, n + len(drafts))
                if blocks is not None:
                    break
                if drafts:  # no room for the proposals: a plain decode before preempting anyone
                    drafts = []
                    continue
                victim = self.running.pop()  # latest arrival among running
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if blocks is None:
                break
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n + len(drafts), blocks, drafts))
            scheduled.append(req)
            budget -= n + len(drafts)
            i += 1

        # Admit waiting requests only when nothing was preempted this step: otherwise
        # the pool is full and admitting would just thrash.
        admitting = not (self.config.static_batching and self.running)
        adapters = Counter(r.adapter_id for r in self.running if r.adapter_id is not None)
        running_before = dict(adapters)  # adapters admitted this step still batch their requests
        draining = None  # an adapter that admits nothing while a request waits for its slot
        passed_over: list[Request] = []
        while (admitting and self.waiting and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            adapter = self.waiting[0].adapter_id
            slots_full = self.config.max_loras is not None and len(adapters) >= self.config.max_loras
            if adapter is not None and (adapter == draining or (adapter not in adapters and slots_full)):
                if draining is None and running_before:
                    draining = min(running_before, key=running_before.get)
                passed_over.append(self.waiting.popleft())
                continue
            if budget <= 0:
                if not self.config.static_batching:
                    break
                # A static batch forms at once; its prefills run from the next steps on.
                req = self.waiting.popleft()
                req.status = Status.RUNNING
                self.running.append(req)
                if req.adapter_id is not None:
                    adapters[req.adapter_id] += 1
                continue
            req = self.waiting[0]
            # Waiting requests (new or preempted) hold no blocks and have nothing computed.
            hit_blocks, n_hit = self.kv.get_computed_blocks(req)
            if not self.config.static_batching and self.kv.prefix_in_flight(req, len(hit_blocks)):
                break  # this step writes its next prefix block: admitted next step, it shares it
            req.num_computed_tokens = n_hit
            first = req.num_preemptions == 0  # a recompute's hits are mostly its own blocks: not counted
            if first:
                req.num_cached_tokens = n_hit
            n = req.num_tokens - req.num_computed_tokens
            if n > budget and not self.config.chunked_prefill:
                req.num_computed_tokens = 0
                break
            n = min(n, budget)
            blocks = self.kv.allocate_slots(req, n, hit_blocks)
            if blocks is None:
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if first:
                self.kv.count_prefix_lookup(req.num_tokens, len(hit_blocks) * self.kv.block_size)
            req.status = Status.RUNNING
            self.running.append(req)
            if req.adapter_id is not None:
                adapters[req.adapter_id] += 1
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n, blocks))
            budget -= n
        self.waiting.extendleft(reversed(passed_over))
        return out

    def _propose(self, req: Request, budget: int) -> list[int]:
        """Proposals for a decode of `req`: at most k, the budget left after its own token, and the outputs
        it may still produce after the token the step samples anyway; placeholders for a draft model."""
        k = min(self.config.num_speculative_tokens, budget - 1,
                req.params.max_tokens - len(req.output_token_ids) - 1)
        if k <= 0:
            return []
        if self.config.draft_model:
            return [PENDING_PROPOSAL] * k
        return propose_ngram(req.all_token_ids, k, self.config.prompt_lookup_max)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int], logprobs: dict | None = None,
                           accepted: dict[str, tuple[list[int], list]] | None = None) -> list[Request]:
        """Advance every scheduled request; append sampled tokens; finish stopped ones.

        Args:
            out: what `schedule` returned for this step.
            sampled: request id -> new token, for the seqs with `samples` True.
            logprobs: optional request id -> logprob record, stored beside the token.
            accepted: request id -> (accepted proposals, their logprob records), emitted before the
                sampled token; only the accepted ones count as computed (the K/V written for rejected
                proposals is overwritten later). The run is cut at the first stop token or max_tokens.

        Returns:
            Requests that got a token this step (finished ones have a finished status).
        """
        self.kv.commit_written()
        touched = []
        for seq in out.seqs:
            req = seq.request
            if req.status.finished:  # aborted while the step ran
                continue
            rid = req.request_id
            acc_toks, acc_lps = (accepted or {}).get(rid, ([], []))
            req.num_computed_tokens = seq.start + seq.num_tokens - len(seq.draft_token_ids) + len(acc_toks)
            if not seq.samples:
                continue
            new_lps = list(acc_lps) + [logprobs[rid]] if logprobs is not None and rid in logprobs else None
            for j, tok in enumerate([*acc_toks, sampled[rid]]):
                req.output_token_ids.append(tok)
                if new_lps is not None:
                    req.output_logprobs.append(new_lps[j])
                status = req.check_stop_token()
                if status is not None:
                    self.finish(rid, status)
                    break
            touched.append(req)
        return touched

    def finish(self, request_id: str, status: Status = Status.FINISHED_ABORTED) -> Request | None:
        """End a request (stop string found, client gone, ...) and free its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        return req
