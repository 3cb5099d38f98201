"""Draft-model proposals for the engine's speculative decoding.

A smaller model with the target's vocabulary (a distilled or layer-dropped copy,
`jmem.distill.student_from_teacher`, or any model file sharing the tokenizer)
proposes k tokens per decode, greedily; the target verifies them in its usual
step (`jmem.serve.spec_decode`). A greedy draft is a point mass, so the
verifier's rule for n-gram proposals holds as it is: outputs keep the target's
distribution (greedy: its exact tokens) whatever the draft proposes.

The draft has its own paged KV cache addressed by the target's block tables
(same block ids and block size): the pool hands out a block for both models at
once, and the KV budget counts both per block. Each engine step the draft runs

1. once over the step's real tokens (prefill chunks, each decode's last token)
   plus the ones its cache lacks (after a round whose proposals were all kept,
   the last proposal, which the draft never fed); each decode's logits there
   give its first proposal;
2. k - 1 decode steps, each feeding the proposal before.

Each is a `ModelRunner` step of the draft model: the same shape buckets,
`precompile`, and tensor-parallel split as the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from jmem.serve.request import SamplingParams
from jmem.serve.runner import ModelRunner
from jmem.serve.scheduler import ScheduledSeq, SchedulerOutput

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class _Tail:
    """A sequence's tokens from position `offset` on, indexed by absolute position: what a one-token
    draft step reads of a request (`all_token_ids[start:start + 1]`) without copying the sequence."""

    def __init__(self, offset: int, tokens: list[int]):
        self.offset, self.tokens = offset, tokens

    def __len__(self) -> int:
        return self.offset + len(self.tokens)

    def __getitem__(self, index: slice) -> list[int]:
        if not isinstance(index, slice) or index.start is None or index.start < self.offset:
            raise IndexError(f"{index} is not a slice from position {self.offset} on")
        stop = None if index.stop is None else index.stop - self.offset
        return self.tokens[index.start - self.offset : stop]


@dataclass
class _DraftView:
    """What a `ModelRunner` step reads of a request, for the draft: the tokens so far, greedy, base weights."""

    request_id: str
    all_token_ids: list[int] | _Tail
    output_token_ids: list[int] = field(default_factory=list)
    # Shared by every view (class attributes, not fields).
    params = _GREEDY
    seed = 0
    adapter_id = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids

    def logit_biases(self, step: int) -> dict[int, float]:
        return {}  # the draft proposes greedily; the verifying step applies the request's biases

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def check_draft(target_config, draft_config, max_model_len: int) -> None:
    """ValueError naming the mismatch when `draft_config` cannot draft for `target_config`."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"the draft model's vocab_size={draft_config.vocab_size} differs from the target's "
                         f"{target_config.vocab_size}; accepted: a draft with the target's vocabulary")
    if draft_config.max_seq_len < max_model_len:
        raise ValueError(f"the draft model's context of {draft_config.max_seq_len} tokens is shorter than "
                         f"max_model_len={max_model_len}; accepted: a draft with at least that context")


def load_draft(target, model: str | None = None, layers: Sequence[int] = (), *, tokenizer=None, **load_kwargs):
    """The draft named by serving flags: `model` (a preset or model file, `jmem.load(model, **load_kwargs)`),
    or a copy of the target's `layers` (`jmem.distill.student_from_teacher`: self-speculative layer
    dropping); None when neither is given (both: refused by `check_speculative_args` before loading).
    ValueError naming the flag for bad layers, or for a `model` whose tokens differ from `tokenizer`'s
    (the target's; `jmem.io.tokenizer.check_same_tokens`)."""
    if layers:
        from jmem.distill import student_from_teacher

        try:
            return student_from_teacher(target, layers)
        except ValueError as e:
            raise ValueError(f"--speculative-layers: {str(e).replace('student layer', 'layer')}") from None
    if model is not None:
        import jmem
        from jmem.io.tokenizer import check_same_tokens

        draft = jmem.load(model, **load_kwargs)
        if tokenizer is not None:
            check_same_tokens(tokenizer, draft.tokenizer, f"--speculative-model {model!r}")
        return draft.model
    return None


class DraftProposer:
    """Greedy proposals from a draft model, with the draft's paged cache kept in step with the target's.

    Args:
        model: the draft `jmem.models.Llama`.
        num_blocks, block_size, max_num_seqs, max_model_len, kv_dtype, attention_impl, mesh: as the
            target's `ModelRunner` (the draft's cache has the same blocks).

    Example:
        >>> drafter = DraftProposer(draft, num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=512)
        >>> out = scheduler.schedule()       # decodes hold placeholder proposals
        >>> drafter.propose(out)             # now real ones
        >>> res = runner.step(out); drafter.update(out, res.accepted, scheduler.requests)
    """

    def __init__(self, model, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 kv_dtype: str = "auto", attention_impl: str = "auto", mesh=None):
        self.runner = ModelRunner(model, num_blocks, block_size, max_num_seqs, max_model_len, kv_dtype,
                                  attention_impl, mesh=mesh)
        self.num_computed: dict[str, int] = {}  # request id -> leading tokens whose K/V the draft's cache holds

    def propose(self, out: SchedulerOutput) -> None:
        """Replace each scheduled decode's placeholder proposals (`draft_token_ids`) with the draft's
        greedy tokens, as many as the scheduler reserved; feeds every scheduled token to the draft."""
        first = []
        for s in out.seqs:
            req = s.request
            end = s.start + s.num_tokens - len(s.draft_token_ids)  # the step's real tokens end here
            # A preempted request restarts lower; a prefix hit is trusted to hold the draft's K/V too
            # (a new request starts where the target's step does, after its cached blocks).
            start = min(self.num_computed.get(req.request_id, s.start), s.start)
            first.append(ScheduledSeq(_DraftView(req.request_id, req.all_token_ids), start, end - start,
                                      s.block_ids))
        res = self.runner.step(SchedulerOutput(first))
        spec = [s for s in out.seqs if s.draft_token_ids]
        proposals = {s.request.request_id: [res.tokens[s.request.request_id]] for s in spec}
        for i in range(1, max((len(s.draft_token_ids) for s in spec), default=0)):
            seqs = []
            for s in spec:
                if len(s.draft_token_ids) > i:
                    rid, pos = s.request.request_id, s.request.num_tokens - 1 + i  # feeds proposal i - 1
                    seqs.append(ScheduledSeq(_DraftView(rid, _Tail(pos, proposals[rid][i - 1 : i])), pos, 1,
                                             s.block_ids))
            res = self.runner.step(SchedulerOutput(seqs))
            for s in seqs:
                proposals[s.request.request_id].append(res.tokens[s.request.request_id])
        for s in spec:
            s.draft_token_ids = proposals[s.request.request_id]

    def update(self, out: SchedulerOutput, accepted: dict[str, tuple[list[int], list]], live) -> None:
        """Record how far the draft's cache matches each request after the target's step.

        Args:
            out: the step, after `propose`.
            accepted: request id -> (kept proposals, ...), as `StepResult.accepted`.
            live: ids of the requests still known to the scheduler; the others are forgotten.
        """
        for s in out.seqs:
            rid, k = s.request.request_id, len(s.draft_token_ids)
            end = s.start + s.num_tokens - k
            # The draft fed proposals 1..k-1 after the real tokens: those kept are valid K/V.
            kept = len(accepted.get(rid, ((),))[0])
            self.num_computed[rid] = end + min(kept, k - 1) if k else end
        for rid in [r for r in self.num_computed if r not in live]:
            del self.num_computed[rid]
