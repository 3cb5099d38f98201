"""A request as the scheduler sees it: tokens, progress, sampling settings, status."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from jmem.checks import as_python_scalar, is_int, is_number, stop_strings


class RequestError(ValueError):
    """A request the engine refuses; `param` names the request field at fault (None when none is),
    so a caller that spells the fields differently (the HTTP API) can name its own."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownAdapter(RequestError):
    """A request for a LoRA adapter the engine does not serve (any more); its field is the model."""

    def __init__(self, message: str):
        super().__init__(message, "model")


class ContextTooLong(RequestError):
    """prompt + max_tokens beyond the most tokens one request may hold."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int):
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit
        # The prompt when it alone leaves no room for a token, else the requested output length.
        super().__init__(self.describe(), "prompt" if prompt_tokens >= limit else "max_tokens")

    def describe(self, max_tokens_name: str = "max_tokens") -> str:
        total = self.prompt_tokens + self.max_tokens
        return (f"prompt ({self.prompt_tokens} tokens) + {max_tokens_name} ({self.max_tokens}) = {total} "
                f"exceeds the maximum context of {self.limit} tokens")


def check_fits(prompt_tokens: int, max_tokens: int, limit: int) -> None:
    """RequestError for an empty prompt, ContextTooLong for a request that could never be scheduled."""
    if not prompt_tokens:
        raise RequestError("prompt is empty; need at least one token", "prompt")
    if prompt_tokens + max_tokens > limit:
        raise ContextTooLong(prompt_tokens, max_tokens, limit)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, Status.FINISHED_ABORTED)


@dataclass
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM names and ranges).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; accepted 0..2.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        min_p: drop tokens whose probability is below min_p * the top one; 0..1.
        seed: per-request seed; a fresh one is drawn when None.
        repetition_penalty: > 0; 1 disables (divides positive logits of seen tokens).
        presence_penalty, frequency_penalty: -2..2, OpenAI's additive penalties on output tokens.
        stop: strings that end the output (not included in it).
        stop_token_ids: token ids that end the output (besides the model's EOS).
        ignore_eos: keep going past EOS.
        logprobs: number of top log-probabilities to return per token (None: none), at most 20.
        skip_special_tokens: leave control tokens (`<|im_end|>` ...) out of the text.
        include_stop_str_in_output: end the text after the stop string (or the stop token's text)
            rather than before it.
        min_tokens: tokens to generate before EOS, a stop token id or a stop string may end the
            output (vLLM's; EOS and stop token ids are banned until then); 0..max_tokens.
        logit_bias: token id -> value in -100..100 added to its logit before sampling (OpenAI's;
            -100 in effect bans a token, 100 forces it).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0

    def validate(self) -> None:
        """Raise RequestError (a ValueError) naming the first bad field and its accepted range or type.

        `stop` and `stop_token_ids` are normalised in place: None is none, and one string is
        one stop string (as OpenAI's `stop`), not its characters; a 0-d array number
        (`jnp.float32(0.7)`) becomes its Python number."""
        for name in ("max_tokens", "top_k", "seed", "logprobs", "min_tokens"):
            v = as_python_scalar(getattr(self, name))
            setattr(self, name, v)
            if (v is not None or name in ("max_tokens", "min_tokens")) and not is_int(v):
                raise RequestError(f"{name}={v!r}; accepted: an integer", name)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise RequestError(f"seed={self.seed}; accepted: an integer in [-2**63, 2**63)", "seed")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name}={getattr(self, name)!r}; accepted: true or false", name)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = as_python_scalar(getattr(self, name))
            setattr(self, name, v)
            if not is_number(v) or not math.isfinite(v):
                raise RequestError(f"{name}={v!r}; accepted: a finite number", name)
        try:
            self.stop = stop_strings(self.stop)
        except ValueError as e:
            raise RequestError(str(e), "stop") from None
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):  # "12" is no ['1', '2']
            raise RequestError(f"stop_token_ids={ids!r}; accepted: a list of integer token ids", "stop_token_ids")
        self.stop_token_ids = list(ids)
        self._check_logit_bias()
        checks = [
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"0..max_tokens ({self.max_tokens})"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "0..2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "(0, 1]"),
            ("top_k", -1 <= self.top_k < 1 << 31, "-1, 0 (all) or a positive count below 2**31"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "0..1"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "> 0"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "-2..2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "-2..2"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, f"0..{self.MAX_LOGPROBS}"),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise RequestError(f"{name}={getattr(self, name)!r} is out of range; accepted: {accepted}", name)

    def _check_logit_bias(self) -> None:
        bias = {} if self.logit_bias is None else self.logit_bias
        if not isinstance(bias, dict):
            raise RequestError(f"logit_bias={bias!r}; accepted: a map of token ids to numbers", "logit_bias")
        for tok, value in bias.items():
            if not is_int(tok):
                raise RequestError(f"logit_bias key {tok!r} is not a token id; accepted: integer token ids",
                                   "logit_bias")
            if not is_number(value) or not -self.MAX_LOGIT_BIAS <= value <= self.MAX_LOGIT_BIAS:
                what = "is out of range" if is_number(value) else f"is a {type(value).__name__}"
                raise RequestError(f"logit_bias[{tok}]={value!r} {what}; accepted: a number in "
                                   f"-{self.MAX_LOGIT_BIAS:g}..{self.MAX_LOGIT_BIAS:g}", "logit_bias")
        self.logit_bias = {int(t): float(v) for t, v in bias.items()}

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    `num_computed_tokens` counts tokens whose K/V are in the cache. Preemption
    resets it to 0 and keeps `output_token_ids`, so recompute resumes exactly
    where the request stopped.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    adapter_id: str | None = None
    adapter_version: int = 0  # `AdapterInfo.version` of the adapter when the request arrived
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: Status = Status.WAITING
    seed: int = 0
    first_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    def logit_biases(self, step: int) -> dict[int, float]:
        """Token id -> value added to its logit when sampling output token `step` (0-based):
        `logit_bias`, and -inf on EOS and the stop token ids while `step < min_tokens`."""
        p = self.params
        biases = dict(p.logit_bias or {})
        if step < p.min_tokens:
            banned = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
            biases.update(dict.fromkeys(banned, -math.inf))
        return biases

    def check_stop_token(self) -> Status | None:
        """Status to finish with after the latest output token, or None to go on."""
        tok = self.output_token_ids[-1]
        stops = len(self.output_token_ids) >= self.params.min_tokens and (
            tok in self.params.stop_token_ids or (not self.params.ignore_eos and tok in self.eos_token_ids))
        if stops:
            return Status.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.params.max_tokens:
            return Status.FINISHED_LENGTH
        return None
