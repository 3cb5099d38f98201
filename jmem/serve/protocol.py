"""OpenAI-compatible request bodies (pydantic) and their translation to `SamplingParams`.

Field names, defaults and ranges follow the OpenAI API, plus vLLM's extras
(top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, ...). Unknown fields
are ignored (as vLLM does; OpenAI answers them with a 400); known fields are
strictly typed (no "5" for 5, no true for 1, no 4.0 for 4; a float field takes
a JSON int) and a wrong type is a 400 naming the field. Known parameters the
server does not implement (tools, response_format other than text, suffix,
best_of > n, and `NOT_IMPLEMENTED`: vLLM's guided decoding, ...)
are a 400 rather than silently ignored.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, field_validator

from jmem.serve.request import RequestError, SamplingParams

# A float field that takes JSON numbers (ints included) but not strings or booleans.
StrictNumber = Annotated[float, Strict()]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = err_type or {400: "invalid_request_error", 401: "authentication_error",
                                 404: "not_found_error", 405: "invalid_request_error"}.get(status, "server_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _unsupported(param: str, value: Any, accepted: str) -> APIError:
    return APIError(400, f"{param}={value!r} is not supported by this server; accepted: {accepted}", param)


def check_text(text: str, param: str) -> str:
    """`text`, or a 400 naming `param` when it holds a lone surrogate (JSON allows `"\\ud800"`; no
    tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} holds {text[e.start:e.end]!r} at character {e.start}, a lone surrogate; "
                       "accepted: text that is valid Unicode", param) from None
    return text


def choice_seed(seed: int, index: int) -> int:
    """Seed of choice `index` of a request with `seed` and n > 1: choice 0 keeps `seed`; the others
    hash (seed, index) into 31 bits, so that choice i is not the same draw as a request with seed + i.

    Example:
        >>> choice_seed(10, 0), choice_seed(10, 1) != 11
        (10, True)
    """
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: with include_usage, every chunk carries its choice's usage


NOT_IMPLEMENTED = {
    # vLLM's extras that change the output
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0), "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (),
    "logits_processors": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "continue_final_message": (False,), "add_generation_prompt": (True,),
    "echo": (False,),  # chat only (a completion request declares it): vLLM's echo of the last message
    "response_format": ({"type": "text"},),  # completions (chat declares it)
    "structured_outputs": (), "guided_whitespace_pattern": (), "return_tokens_as_token_ids": (False,),
    "priority": (0,),  # scheduling is first come, first served
    "chat_template": (), "chat_template_kwargs": ({},), "documents": ([],),
    # OpenAI chat parameters for outputs this server does not produce
    "modalities": (["text"],), "audio": (), "reasoning_effort": (),
}
"""Parameters this server knows but does not implement, with the values that change nothing
(null is always accepted): any other value is a 400 rather than silently ignored."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are kept only to check NOT_IMPLEMENTED

    model: StrictStr | None = None  # None: the served base model (as vLLM)
    # vLLM's: False encodes without the model's BOS; None: completions add it as the model file
    # says, chat adds it unless the rendered template starts with it.
    add_special_tokens: StrictBool | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictNumber | None = None
    top_p: StrictNumber | None = None
    n: StrictInt = 1
    best_of: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictNumber | None = None
    frequency_penalty: StrictNumber | None = None
    logit_bias: dict | None = None  # token id (a string in JSON) -> -100..100
    user: StrictStr | None = None
    # vLLM extensions
    top_k: StrictInt | None = None
    min_p: StrictNumber | None = None
    repetition_penalty: StrictNumber | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Either value gives the same text: the tokenizer joins special tokens as they are spelled, as
    # vLLM does with a fast tokenizer (its slow-tokenizer path alone inserts the spaces).
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    min_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None

    @field_validator("n", "stream", "echo", "logprobs", mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value, info):
        """OpenAI marks these nullable: an explicit null (sent by clients generated from its spec)
        means the default, as in vLLM."""
        return cls.model_fields[info.field_name].default if value is None else value

    def check_supported(self) -> None:
        """APIError(400) for a known parameter this server accepts but does not implement."""
        if not 1 <= self.n <= 16:
            raise APIError(400, f"n={self.n} is out of range; accepted: 1..16", "n")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise _unsupported("best_of", self.best_of, f"unset, 1 or equal to n ({self.n})")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= SamplingParams.MAX_LOGPROBS:
                raise APIError(400, f"prompt_logprobs={self.prompt_logprobs} is out of range; accepted: "
                               f"0..{SamplingParams.MAX_LOGPROBS}", "prompt_logprobs")
            if self.stream:
                raise APIError(400, "prompt_logprobs is not available with stream: true (as in vLLM); accepted: "
                               "unset, or stream false", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        for name, value in (self.model_extra or {}).items():
            neutral = NOT_IMPLEMENTED.get(name)
            if neutral is not None and value is not None and value not in neutral:
                accepted = "unset" + "".join(f" or {v!r}" for v in neutral)
                raise _unsupported(name, value, accepted)

    def _checked_stop(self):
        """`stop`, or a 400 for a stop string holding a lone surrogate (no generated text can hold one)."""
        if isinstance(self.stop, list):
            return [check_text(s, f"stop[{i}]") for i, s in enumerate(self.stop)]
        return self.stop if self.stop is None else check_text(self.stop, "stop")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Validated `SamplingParams` (call `check_supported` first); APIError(400) naming the first bad field."""
        p = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=self._checked_stop(),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens or 0,
            logit_bias=_token_keys(self.logit_bias),
        )
        try:
            p.validate()
        except RequestError as e:
            raise APIError(400, str(e), e.param) from None
        return p


def _token_keys(bias: dict | None) -> dict | None:
    """OpenAI's logit_bias, whose keys are token ids written as strings, with int keys."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        # Plain decimal digits only: int() also reads "01", "1_0", " 3 " and non-ASCII digits, so two keys
        # could name one token and the last would win unseen.
        if not (key.isascii() and key.isdigit() and (key == "0" or key[0] != "0")):
            raise APIError(400, f"logit_bias key {key!r} is not a token id; accepted: token ids as strings "
                           "(e.g. '50256') mapping to numbers in -100..100", "logit_bias")
        tok = int(key)
        if isinstance(value, bool):  # JSON true would pass as 1
            raise APIError(400, f"logit_bias[{key}]={value!r}; accepted: a number in -100..100", "logit_bias")
        out[tok] = value
    return out


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None)
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise _unsupported("suffix", self.suffix, "unset or an empty string")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise APIError(400, f"logprobs={self.logprobs} is out of range; accepted: 0..20", "logprobs")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one for a string or a token-id list, several for a batch."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is an empty list; need at least one prompt", "prompt")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict] | None = None
    tool_calls: list | None = None  # an assistant's earlier calls: refused, the template cannot show them
    function_call: dict | None = None

    def text(self, index: int) -> str:
        for name in ("tool_calls", "function_call"):
            if getattr(self, name):
                raise _unsupported(f"messages[{index}].{name}", "[...]" if name == "tool_calls" else
                                   getattr(self, name), "unset: tool calling is not implemented")
        param = f"messages[{index}].content"
        if self.content is None:
            if self.role != "assistant":  # OpenAI: only an assistant's turn may leave it out
                raise APIError(400, f"{param} is missing; a {self.role} message needs content (a string or "
                               "a list of text parts)", param)
            return ""
        if isinstance(self.content, str):
            return check_text(self.content, param)
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"message content part {part!r} is not supported; accepted: "
                               "{'type': 'text', 'text': ...}", param)
            parts.append(check_text(part["text"], param))
        return "\n".join(parts)  # text parts on lines of their own, as vLLM joins them


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(messages)]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    functions: list | None = None
    function_call: StrictStr | dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise _unsupported("response_format", self.response_format, "unset or {'type': 'text'}")
        if self.tools:
            raise _unsupported("tools", "[...]", "unset or []: tool calling is not implemented")
        if self.tool_choice not in (None, "none"):
            raise _unsupported("tool_choice", self.tool_choice, "unset or 'none'")
        if self.functions:
            raise _unsupported("functions", "[...]", "unset or []: function calling is not implemented")
        if self.function_call not in (None, "none"):
            raise _unsupported("function_call", self.function_call, "unset or 'none'")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs={self.top_logprobs} is out of range; accepted: 0..20", "top_logprobs")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None  # as in completions (prompt) and chat (messages)
    return_token_strs: StrictBool = False  # vLLM's: each id's vocabulary piece beside the ids


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="ignore")

    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter (its `lora_int_id` is ignored: names identify adapters)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: StrictStr


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]
