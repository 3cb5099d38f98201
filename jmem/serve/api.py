"""OpenAI-compatible HTTP server: a thin FastAPI shim over `Engine`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text), POST /tokenize, POST /detokenize.
Errors are OpenAI-shaped (an engine error mid-stream is an SSE error event
before `data: [DONE]`); a client that disconnects, streaming or not, has its
requests aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import re
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jmem.io.tokenizer import ByteTokenizer
from jmem.serve.engine import Engine, RequestOutput
from jmem.serve import DEFAULT_MAX_REQUEST_BYTES
from jmem.serve.middleware import JSONBodies, RequireAPIKey
from jmem.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                 LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest, chat_dicts,
                                 check_text, choice_seed)
from jmem.serve.request import ContextTooLong, UnknownAdapter

log = logging.getLogger("jmem.serve")

DISCONNECT_POLL_S = 0.25  # how often a running request checks whether its client is still there


# ---------------------------------------------------------------------------- validation errors
def _is_union_tag(x) -> bool:
    """pydantic names the member of a union it tried (`str`, `list[int]`, `ChatMessage`) in the error
    location; field names here are lowercase identifiers, so anything else is a tag."""
    return isinstance(x, str) and (not x.isidentifier() or x in {"str", "int", "float", "bool", "dict", "list", "none"}
                                   or x[:1].isupper())


def _param_name(loc) -> str | None:
    """`("messages", 0, "content")` -> `"messages[0].content"` (OpenAI's spelling)."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or None


def _value_at(body, loc):
    for x in loc:
        try:
            body = body[x]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field; a union mismatch lists the accepted types."""
    errors = exc.errors()
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if err.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    loc = [x for x in err.get("loc", ()) if x != "body"]
    tag_at = next((k for k, x in enumerate(loc) if _is_union_tag(x)), None)
    if tag_at is None:
        param = _param_name(loc)
        shown = param or "body"
        if err.get("type") != "missing":
            shown += "=" + json.dumps(err.get("input"), default=repr)[:80]
        return APIError(400, f"{shown}: {err['msg']}", param)
    # Every union member failed: name the field, its value and what it accepts.
    prefix = loc[:tag_at]
    tags = []
    for e in errors:
        el = [x for x in e.get("loc", ()) if x != "body"]
        if el[:tag_at] == prefix and len(el) > tag_at and el[tag_at] not in tags:
            tags.append(el[tag_at])
    param = _param_name(prefix)
    value = json.dumps(_value_at(getattr(exc, "body", None), prefix), default=repr)
    accepted = ", ".join(t.replace("dict[any,any]", "dict") for t in tags)
    return APIError(400, f"{param}={value[:80]} has the wrong type; accepted: {accepted}", param)


# ---------------------------------------------------------------------------- token bytes
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM) spell byte b as one printable character:
    b itself where it is printable, else the next code point from 256 up. This is the inverse map."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = {}, 256
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(shifted)] = b
            shifted += 1
    return out


class TokenBytes:
    """The raw UTF-8 bytes of a token id, which may hold part of a character.

    `decode([id])` of such a token is U+FFFD; this reads the tokenizer's own pieces instead:
    byte-level BPE pieces of `tokenizer.tokens` (special tokens as their text), or ids 0..255 as
    bytes for the byte tokenizer.

    Example:
        >>> tb = TokenBytes(tok)
        >>> b"".join(tb(i) for i in tok.encode("日本")) == "日本".encode()
        True
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.alphabet = _byte_level_alphabet()
        self.special = set(getattr(tokenizer, "special_ids", ()) or ())
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self.cache.get(token_id)
        if b is None:
            b = self.cache[token_id] = self._lookup(int(token_id))
        return b

    def _lookup(self, i: int) -> bytes:
        pieces = getattr(self.tok, "tokens", None)
        if pieces is not None:
            if i >= len(pieces):  # a model's padded vocabulary rows: no text, as the tokenizer decodes them
                return b""
            piece = pieces[i]
            if i in self.special or any(c not in self.alphabet for c in piece):
                return piece.encode("utf-8")
            return bytes(self.alphabet[c] for c in piece)
        if isinstance(self.tok, ByteTokenizer):
            return bytes([i]) if i < 256 else b""
        return self.tok.decode([i], skip_special=False).encode("utf-8")

    def text(self, token_id: int) -> str:
        """The token as text; bytes of an unfinished character are escaped (`\\xe6`, where OpenAI writes
        `bytes:\\xe6`); the `bytes` field of a logprob holds them exactly."""
        return self(token_id).decode("utf-8", errors="backslashreplace")


# ---------------------------------------------------------------------------- app
def rejects_held_bytes(decoder, data: bytes) -> bool:
    """True when the bytes `decoder` holds (the start of a character) cannot go on with `data`'s
    first byte: decoding `data` then replaces them with one U+FFFD before `data`'s own text."""
    held = decoder.getstate()[0]
    if not held or not data:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(held + data[:1])
    except UnicodeDecodeError:
        return True
    return False


def create_app(engine: Engine, model_name: str, api_key: str | None = None, *,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app serving `engine` under the model id `model_name`; POST bodies are JSON of at
    most `max_request_bytes` (`jmem.serve.middleware.JSONBodies`). Browser pages of `allowed_origins`
    (`"*"`: any) may call it (CORS; none when empty).

    The engine's LoRA adapters (`Engine(..., lora_modules=)`) are models of their own, listed by
    `/v1/models` with `parent` = `model_name`; a request's `model` picks the adapter (vLLM's semantics).
    An engine with `allow_runtime_lora` also answers vLLM's `POST /v1/load_lora_adapter`
    (`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`).

    The server's startup starts the engine's background loop when it is not running yet (a request
    would otherwise wait forever), and its shutdown stops a loop it started.

    Example:
        >>> app = create_app(engine, "smollm2-135m")
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    """

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        started = engine.start()
        try:
            yield
        finally:
            if started:
                engine.stop()

    app = FastAPI(title="jmem", docs_url=None, redoc_url=None, lifespan=lifespan)
    tok = engine.tokenizer
    token_bytes = TokenBytes(tok)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_, exc: RequestValidationError):
        e = validation_error(exc)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's own errors (no route, wrong method, a body that is not JSON) in OpenAI's shape."""
        where = f"{request.method} {request.url.path}"
        message = {404: f"no route {where}; see GET /v1/models, POST /v1/completions, POST /v1/chat/completions",
                   405: f"method not allowed: {where}"}.get(exc.status_code, f"{exc.detail} ({where})")
        if exc.status_code == 400:
            message = f"request body could not be read as JSON: {exc.detail}"
        e = APIError(exc.status_code, message)
        return JSONResponse(e.body(), status_code=e.status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(_, exc: Exception):
        """A bug's 500 in OpenAI's shape (Starlette re-raises it after this answer: the server log has it)."""
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    adapters = lambda: getattr(engine, "adapters", {})  # noqa: E731 - name -> AdapterInfo, as served now
    lora = lambda adapter: {} if adapter is None else {"adapter": adapter}  # noqa: E731 - engines without LoRA

    def check_model(name) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for an unknown one."""
        if name is None or name == model_name:
            return None
        if name in adapters():
            return name
        served = ", ".join(repr(m) for m in [model_name, *adapters()])
        raise APIError(404, f"model {name!r} does not exist; this server serves {served}", "model",
                       code="model_not_found")

    def submit(prompts: list[list[int]], params, n, rid, adapter=None, *, prompt_param="prompt",
               max_tokens_param="max_tokens"):
        """One request per (prompt, choice), prompt-major: choice index = prompt_index * n + j, after the
        caller's `check_requests`. The `*_param` names are the body's (chat: messages, max_completion_tokens)
        for the errors."""
        loop = asyncio.get_running_loop()
        streams = []
        try:
            for pi, ids in enumerate(prompts):
                for j in range(n):
                    p = params
                    if n > 1 and params.seed is not None:  # distinct but reproducible choices
                        p = type(params)(**{**params.__dict__, "seed": choice_seed(params.seed, j)})
                    streams.append(engine.add_request(ids, p, f"{rid}-{pi * n + j}", loop=loop, **lora(adapter)))
        except ValueError as e:  # an adapter unloaded since the check
            for s in streams:
                engine.abort(s.request_id)
            raise request_error(e, prompts, pi, prompt_param, max_tokens_param) from None
        return streams

    def check_requests(prompts, params, adapter=None, *, prompt_param="prompt", max_tokens_param="max_tokens"):
        """Every prompt of a batch checked before any is queued or scored: a refused batch runs nothing."""
        for pi, ids in enumerate(prompts):
            try:
                engine.check_request(ids, params, adapter)
            except ValueError as e:
                raise request_error(e, prompts, pi, prompt_param, max_tokens_param) from None

    def request_error(e: ValueError, prompts, pi, prompt_param, max_tokens_param) -> APIError:
        if isinstance(e, UnknownAdapter):
            return APIError(404, str(e), "model", code="model_not_found")
        message = e.describe(max_tokens_param) if isinstance(e, ContextTooLong) else str(e)
        param = getattr(e, "param", None)
        param = {"prompt": prompt_param, "max_tokens": max_tokens_param}.get(param, param)
        return APIError(400, message if len(prompts) == 1 else f"prompt {pi}: {message}", param)

    async def merged(streams, request: Request):
        """(choice index, output) as they arrive. Stops when the client leaves (watched all along, not
        only between outputs) and aborts every unfinished request then, or on an error."""
        q: asyncio.Queue = asyncio.Queue()
        pending = set(range(len(streams)))

        async def pump(i, s):
            async for o in s:
                await q.put((i, o))

        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            await q.put((None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        tasks.append(asyncio.create_task(watch()))
        try:
            while pending:
                i, o = await q.get()
                if i is None:
                    return
                if o.finished:
                    pending.discard(i)
                if o.error:
                    if o.error_param == "model":  # its adapter was unloaded before it started
                        raise APIError(404, o.error, "model", code="model_not_found")
                    raise APIError(500 if o.error_param is None else 400, o.error, o.error_param)
                yield i, o
        finally:
            for t in tasks:
                t.cancel()
            for i in pending:
                engine.abort(streams[i].request_id)

    async def collect(streams, request):
        """Every stream to its end: (texts, (token, logprob) pairs, final outputs), or None when the client left."""
        texts, lps, finals = [[] for _ in streams], [[] for _ in streams], {}
        async for i, o in merged(streams, request):
            texts[i].append(o.text)
            lps[i] += list(zip(o.token_ids, o.logprobs))
            if o.finished:
                finals[i] = o
        return (texts, lps, finals) if len(finals) == len(streams) else None

    def usage(prompt_tokens, outs):
        """OpenAI's usage: each prompt counted once however many choices it has."""
        completion = sum(o.num_output_tokens for o in outs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def text_position(start: int = 0) -> list:
        """`[characters so far, UTF-8 decoder]`: where the next token's text starts."""
        return [start, codecs.getincrementaldecoder("utf-8")(errors="replace")]

    def completion_logprobs(lps, at=None, hidden=()):
        """OpenAI's completions logprobs of `(token id, (logprob, top) | None)` pairs (None: a prompt's
        first token, which has no context). Offsets count characters of the decoded bytes: from 0, or
        continuing `at`, a stream's `[offset, UTF-8 decoder]` (a character split over two chunks has
        the offsets it has in one response). Ids in `hidden` (special tokens the text skips) add
        nothing to the text, so the offsets keep indexing it."""
        tokens, token_lps, tops, offsets = [], [], [], []
        at = text_position() if at is None else at
        for tid, entry in lps:
            shown = tid not in hidden
            # Bytes held from earlier tokens that this token's first byte shows to be no character
            # become a U+FFFD before this token's text: that character is theirs.
            offsets.append(at[0] + (shown and rejects_held_bytes(at[1], token_bytes(tid))))
            tokens.append(token_bytes.text(tid))
            if shown:
                at[0] += len(at[1].decode(token_bytes(tid)))
            lp, top = entry[:2] if entry is not None else (None, None)
            token_lps.append(lp)
            # The k most likely, and always the token itself (OpenAI: up to logprobs + 1 entries).
            tops.append(None if top is None else {token_bytes.text(i): l for i, l in [*top, (tid, lp)]})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def vllm_prompt_logprobs(scored, k):
        """vLLM's `prompt_logprobs` of one scored prompt: None for the first token, then per token
        `{id: {"logprob", "rank", "decoded_token"}}` for the token itself and the `k` most likely."""
        out = []
        for tid, entry in scored:
            if entry is None:
                out.append(None)
                continue
            lp, top, rank = entry
            ranked = {tid: (lp, rank), **{i: (l, r) for r, (i, l) in enumerate(top[:k], 1) if i != tid}}
            out.append({str(i): {"logprob": l, "rank": r, "decoded_token": token_bytes.text(i)}
                        for i, (l, r) in ranked.items()})
        return out

    async def prompt_logprobs(prompts, k, adapter=None, param="prompt"):
        """Per prompt, its tokens paired with their log-probabilities (echo with logprobs, prompt_logprobs)."""
        out = []
        for ids in prompts:
            try:
                out.append(list(zip(ids, await asyncio.to_thread(engine.prompt_logprobs, ids, k, **lora(adapter)))))
            except UnknownAdapter as e:
                raise APIError(404, str(e), "model", code="model_not_found") from None
            except ValueError as e:
                raise APIError(400, str(e), param) from None
        return out

    def chat_logprobs(lps):
        def entry(i, l):
            return {"token": token_bytes.text(i), "logprob": l, "bytes": list(token_bytes(i))}
        return {"content": [{**entry(tid, lp), "top_logprobs": [entry(i, l) for i, l in top]}
                            for tid, (lp, top) in lps]}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_response(streams, request, chunk, n_prompt, prompt_of, options, opening, choice):
        """The SSE body of completions and chat: the `opening` choices, then one chunk per output
        for which `choice(i, output)` gives a choice, the usage chunk if asked, `[DONE]`. An error
        after the headers went out is an `{"error": ...}` event, still followed by `[DONE]`.
        `n_prompt`: the request's prompt tokens (each prompt once); `prompt_of[i]`: stream i's. With
        `options.continuous_usage_stats` (and `include_usage`) every chunk carries its choice's usage
        so far, as in vLLM."""
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats

        def event(c, i, outs=()):
            return sse({**chunk, "choices": [c], **({"usage": usage(prompt_of[i], outs)} if continuous else {})})

        async def events():
            finals = {}
            try:
                for c in opening:
                    yield event(c, c["index"])
                async for i, o in merged(streams, request):
                    c = choice(i, o)
                    if c is not None:
                        yield event(c, i, [o])
                    if o.finished:
                        finals[i] = o
            except APIError as e:
                yield sse(e.body())
            except Exception as e:  # noqa: BLE001 - the stream must end with an error event, not a cut
                log.exception("error while streaming %s", chunk.get("id"))
                yield sse(APIError(500, f"internal error: {e}").body())
            else:
                if include_usage and len(finals) == len(streams):
                    yield sse({**chunk, "choices": [], "usage": usage(n_prompt, finals.values())})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    def model_cards() -> list[dict]:
        card = {"object": "model", "created": created, "owned_by": "jmem", "max_model_len": engine.max_request_tokens}
        data = [{"id": model_name, **card, "root": model_name, "parent": None}]
        return data + [{"id": name, **card, "root": a.path, "parent": model_name} for name, a in adapters().items()]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model)
        return next(c for c in model_cards() if c["id"] == model)

    def check_runtime_lora(request: Request):
        if not getattr(getattr(engine, "config", None), "allow_runtime_lora", False):
            raise APIError(404, f"{request.url.path} is off on this server; accepted: a server started with "
                           "--allow-runtime-lora")

    # The route's check runs before the body's: a server without the flag says so whatever the body.
    @app.post("/v1/load_lora_adapter", dependencies=[Depends(check_runtime_lora)])
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name = body.lora_name
        if name == model_name:  # the engine knows its adapters' names, not the served model's
            raise APIError(400, f"lora_name {name!r} is the base model's name; accepted: a new name", "lora_name")
        try:  # reading the file takes a while: off the event loop
            await asyncio.to_thread(engine.load_adapter, name, body.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), getattr(e, "param", None) or "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(check_runtime_lora)])
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        try:
            await asyncio.to_thread(engine.unload_adapter, body.lora_name)
        except LookupError as e:
            raise APIError(404, str(e), "lora_name", code="model_not_found") from None
        except ValueError as e:
            raise APIError(400, str(e), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/metrics")
    async def metrics():
        lines = []
        helps = getattr(engine, "METRICS_HELP", {})
        for k, v in engine.metrics().items():
            kind = "counter" if k.endswith("_total") else "gauge"
            lines += [f"# HELP jmem_{k} {helps[k]}"] if k in helps else []
            lines += [f"# TYPE jmem_{k} {kind}", f"jmem_{k} {float(v)}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def check_ids(ids, param):
        vocab = getattr(tok, "vocab_size", None)
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range; accepted: 0..{vocab - 1}", param)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if body.prompt is not None:
            ids = encode(check_text(body.prompt, "prompt"), body.add_special_tokens)
        else:  # a rendered chat is encoded as the chat route encodes it
            try:
                text = tok.apply_chat_template(chat_dicts(body.messages), body.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, str(e), "messages") from None
            ids = encode(text, body.add_special_tokens, chat=True)
        strs = [token_str(i) for i in ids] if body.return_token_strs else None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_request_tokens, "token_strs": strs}

    def token_str(i: int) -> str:
        """The vocabulary's piece for id `i` (byte-level BPE spelling, as transformers'
        convert_ids_to_tokens gives it); the token's text for a tokenizer without pieces."""
        pieces = getattr(tok, "tokens", None)
        return pieces[i] if pieces is not None and i < len(pieces) else token_bytes.text(i)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        check_ids(body.tokens, "tokens")
        return {"prompt": tok.decode(body.tokens, skip_special=False)}  # special tokens kept, as vLLM

    def encode(text: str, add_special_tokens: bool | None, chat: bool = False) -> list[int]:
        """`text`'s ids: with the model's BOS (True), without (False), or by default (None): as the
        model file says, and for a rendered chat only where the template did not write it."""
        if add_special_tokens is None and chat:
            return tok.encode_chat(text)
        return tok.encode(text, add_bos=False if add_special_tokens is False else None)

    def prompt_ids_of(prompt, param, add_special_tokens=None) -> list[int]:
        if isinstance(prompt, str):
            ids = encode(check_text(prompt, param), add_special_tokens)
        else:
            ids = list(prompt)
            check_ids(ids, param)
        if not ids:
            raise APIError(400, f"{param} is empty; need at least one token", param)
        return ids

    def resolve_max_tokens(value, param, echo_note=""):
        if value is not None and value < 1:
            raise APIError(400, f"{param}={value} is out of range; accepted: >= 1{echo_note}", param)
        return value

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = check_model(body.model)
        body.model = body.model or model_name  # the name the response carries
        body.check_supported()
        raw = body.prompts()
        prompts = [prompt_ids_of(p, "prompt" if len(raw) == 1 else f"prompt[{k}]", body.add_special_tokens)
                   for k, p in enumerate(raw)]
        echo_only = body.echo and body.max_tokens == 0  # the prompt alone, scored: nothing to generate
        max_tokens = 1 if echo_only else \
            resolve_max_tokens(body.max_tokens, "max_tokens", " (0 only with echo)") or 16
        params = body.sampling_params(max_tokens, body.logprobs)  # validated in every case
        for k, ids in enumerate(prompts if echo_only else ()):  # nothing to generate: the prompt alone must fit
            try:
                engine.check_prompt(ids)
            except ValueError as e:
                raise APIError(400, str(e) if len(prompts) == 1 else f"prompt {k}: {e}", "prompt") from None
        if not echo_only:  # before the prompts are scored (echo, prompt_logprobs)
            check_requests(prompts, params, adapter)
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = body.n
        # echo with logprobs scores the prompt too (lm-eval-harness's loglikelihood requests); so does
        # vLLM's prompt_logprobs. One pass for both, with the larger top-k.
        echo_k = body.logprobs if body.echo and body.logprobs is not None else None
        want = [k for k in (echo_k, body.prompt_logprobs) if k is not None]
        scored = await prompt_logprobs(prompts, max(want), adapter) if want else [[] for _ in prompts]
        # Only an echoed prompt's tokens lead `logprobs`; prompt_logprobs alone has a field of its own.
        echo_scored = [[(t, e if e is None else (e[0], e[1][:echo_k])) for t, e in sc] if body.echo else []
                       for sc in scored]
        extra = [{"prompt_logprobs": vllm_prompt_logprobs(sc, body.prompt_logprobs)}
                 if body.prompt_logprobs is not None else {} for sc in scored]
        if echo_only:
            choices = [{"index": k * n + j, "text": tok.decode(ids, skip_special=False), "finish_reason": "length",
                        "stop_reason": None,
                        "logprobs": completion_logprobs(echo_scored[k]) if body.logprobs is not None else None,
                        **extra[k]}
                       for k, ids in enumerate(prompts) for j in range(n)]
            base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": body.model}
            prompt_usage = usage(sum(len(ids) for ids in prompts), [])
            if not body.stream:
                return {**base, "choices": choices, "usage": prompt_usage}
            opts = body.stream_options
            include_usage = bool(opts and opts.include_usage)
            each = [{"usage": usage(len(prompts[c["index"] // n]), [])} if include_usage and opts.continuous_usage_stats
                    else {} for c in choices]
            events = [sse({**base, "choices": [c], **u}) for c, u in zip(choices, each)]
            events += [sse({**base, "choices": [], "usage": prompt_usage})] if include_usage else []
            return StreamingResponse(iter(events + ["data: [DONE]\n\n"]), media_type="text/event-stream")
        streams = submit(prompts, params, n, rid, adapter)
        n_prompt = sum(len(ids) for ids in prompts)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": body.model}
        echoes = [tok.decode(ids, skip_special=False) if body.echo else "" for ids in prompts]
        echo_of = [echoes[k // n] for k in range(len(streams))]
        hidden = token_bytes.special if body.skip_special_tokens else frozenset()  # tokens the text leaves out

        if body.stream:
            offsets = [text_position(len(e)) for e in echo_of]

            def choice(i, o):
                lp = completion_logprobs(list(zip(o.token_ids, o.logprobs)), offsets[i], hidden) \
                    if body.logprobs is not None else None
                if not (o.text or o.finished or lp):
                    return None
                return {"index": i, "text": o.text, "logprobs": lp,
                        "finish_reason": o.finish_reason if o.finished else None,
                        "stop_reason": o.stop_reason if o.finished else None}

            opening = [{"index": i, "text": e, "finish_reason": None, "stop_reason": None,
                        "logprobs": completion_logprobs(echo_scored[i // n]) if body.logprobs is not None else None}
                       for i, e in enumerate(echo_of)] if body.echo else []
            prompt_of = [len(prompts[i // n]) for i in range(len(streams))]
            return stream_response(streams, request, base, n_prompt, prompt_of, body.stream_options, opening, choice)

        collected = await collect(streams, request)
        if collected is None:
            return Response(status_code=499)  # the client has gone
        texts, lps, finals = collected
        def all_logprobs(i):  # the echoed prompt's (its text as given), then the output's, as streamed
            head = completion_logprobs(echo_scored[i // n])
            tail = completion_logprobs(lps[i], text_position(len(echo_of[i])), hidden)
            return {k: head[k] + tail[k] for k in head}

        choices = [{"index": i, "text": echo_of[i] + "".join(texts[i]),
                    "logprobs": all_logprobs(i) if body.logprobs is not None else None,
                    "finish_reason": finals[i].finish_reason, "stop_reason": finals[i].stop_reason, **extra[i // n]}
                   for i in range(len(streams))]
        return {**base, "choices": choices, "usage": usage(n_prompt, finals.values())}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        adapter = check_model(body.model)
        body.model = body.model or model_name  # the name the response carries
        body.check_supported()
        try:
            text = tok.apply_chat_template(chat_dicts(body.messages))
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        ids = encode(text, body.add_special_tokens, chat=True)  # by default no second BOS after the template's
        raw = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(raw, param)
        if max_tokens is None:
            if len(ids) >= engine.max_request_tokens:
                raise APIError(400, f"the chat prompt is {len(ids)} tokens; the maximum context is "
                               f"{engine.max_request_tokens} tokens, prompt and at least one generated token",
                               "messages")
            max_tokens = engine.max_request_tokens - len(ids)  # the rest of the context, as in vLLM
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        check_requests([ids], params, adapter, prompt_param="messages", max_tokens_param=param)  # before scoring
        extra = {} if body.prompt_logprobs is None else {
            "prompt_logprobs": vllm_prompt_logprobs(
                (await prompt_logprobs([ids], body.prompt_logprobs, adapter, param="messages"))[0], body.prompt_logprobs)}
        streams = submit([ids], params, body.n, rid, adapter, prompt_param="messages", max_tokens_param=param)
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": body.model}

        if body.stream:
            def choice(i, o):
                lp = chat_logprobs(list(zip(o.token_ids, o.logprobs))) if body.logprobs else None
                if not (o.text or o.finished or lp):
                    return None
                return {"index": i, "delta": {"content": o.text} if o.text else {}, "logprobs": lp,
                        "finish_reason": o.finish_reason if o.finished else None,
                        "stop_reason": o.stop_reason if o.finished else None}

            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None, "stop_reason": None} for i in range(body.n)]
            return stream_response(streams, request, {**base, "object": "chat.completion.chunk"}, len(ids),
                                   [len(ids)] * body.n, body.stream_options, opening, choice)

        collected = await collect(streams, request)
        if collected is None:
            return Response(status_code=499)  # the client has gone
        texts, lps, finals = collected
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(texts[i])},
                    "logprobs": chat_logprobs(lps[i]) if body.logprobs else None,
                    "finish_reason": finals[i].finish_reason, "stop_reason": finals[i].stop_reason}
                   for i in range(body.n)]
        return {**base, "choices": choices, "usage": usage(len(ids), finals.values()), **extra}

    posts = frozenset(r.path for r in app.routes if "POST" in (getattr(r, "methods", None) or ()))
    app.add_middleware(JSONBodies, max_bytes=max_request_bytes, paths=posts)
    if api_key:  # added last: runs first, so a request without the key is refused before its body is read
        app.add_middleware(RequireAPIKey, api_key=api_key)
    if allowed_origins:  # outermost: a browser's preflight carries no API key and is answered here
        app.add_middleware(CORSMiddleware, allow_origins=list(check_origins(allowed_origins)),
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    return app


def check_origins(origins) -> tuple[str, ...]:
    """The CORS origins, each `*` or `scheme://host[:port]` as a browser sends it: else a ValueError
    naming the value (a trailing slash or path never matches a browser's Origin header)."""
    for o in origins:
        if not (o == "*" or (isinstance(o, str) and re.fullmatch(r"https?://[^/\s]+", o))):
            raise ValueError(f"--allowed-origins entry {o!r}; accepted: * or scheme://host[:port] as a browser "
                             "sends it, e.g. http://localhost:3000 (no path or trailing slash)")
    return tuple(origins)


__all__ = ["create_app", "check_origins", "validation_error", "RequireAPIKey", "TokenBytes", "RequestOutput"]
