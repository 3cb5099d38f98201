"""OpenAI-compatible HTTP server: a thin FastAPI shim over `Engine`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics (Prometheus text), POST /tokenize, POST /detokenize.
Errors are OpenAI-shaped; a client that disconnects has its requests aborted,
which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from jmem.serve.engine import Engine, RequestOutput
from jmem.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                 TokenizeRequest)


def _validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    field = ".".join(loc) or None
    return APIError(400, f"{field or 'body'}: {err['msg']}", field)


def create_app(engine: Engine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under the model id `model_name`.

    Example:
        >>> app = create_app(engine, "smollm2-135m")
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    app = FastAPI(title="jmem", docs_url=None, redoc_url=None)
    tok = engine.tokenizer
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_, exc: RequestValidationError):
        e = _validation_error(exc)
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return JSONResponse(APIError(401, "missing or invalid API key", code="invalid_api_key").body(),
                                    status_code=401)
        return await call_next(request)

    def check_model(name):
        if name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "model",
                           code="model_not_found")

    def submit(prompt_ids, params, n, rid):
        loop = asyncio.get_running_loop()
        streams = []
        for i in range(n):
            p = params
            if n > 1 and params.seed is not None:  # distinct but reproducible choices
                p = type(params)(**{**params.__dict__, "seed": params.seed + i})
            try:
                streams.append(engine.add_request(prompt_ids, p, f"{rid}-{i}", loop=loop))
            except ValueError as e:
                for s in streams:
                    engine.abort(s.request_id)
                raise APIError(400, str(e), "prompt" if "context" in str(e) else None) from None
        return streams

    async def collect(streams, request):
        """Every stream to its end: (texts, (token, logprob) pairs, final outputs), or None when the client left."""
        texts, lps, finals = [[] for _ in streams], [[] for _ in streams], {}
        async for i, o in merged(streams, request):
            texts[i].append(o.text)
            lps[i] += list(zip(o.token_ids, o.logprobs))
            if o.finished:
                finals[i] = o
        return (texts, lps, finals) if len(finals) == len(streams) else None


    async def merged(streams, request: Request):
        """(choice index, output) as they arrive; aborts unfinished requests when the client leaves."""
        q: asyncio.Queue = asyncio.Queue()
        pending = set(range(len(streams)))

        async def pump(i, s):
            async for o in s:
                await q.put((i, o))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            while pending:
                try:
                    i, o = await asyncio.wait_for(q.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if o.error:
                    raise APIError(500, o.error)
                if o.finished:
                    pending.discard(i)
                yield i, o
        finally:
            for t in tasks:
                t.cancel()
            for i in pending:
                engine.abort(streams[i].request_id)

    def usage(prompt_tokens, outs):
        completion = sum(o.num_output_tokens for o in outs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def tok_text(i):
        return tok.decode([i], skip_special=False) if hasattr(tok, "tokens") else tok.decode([i])

    def completion_logprobs(lps, offset0):
        tokens, token_lps, tops, offsets, off = [], [], [], [], offset0
        for tid, (lp, top) in lps:
            t = tok_text(tid)
            tokens.append(t), token_lps.append(lp), offsets.append(off)
            tops.append({tok_text(i): l for i, l in top})
            off += len(t)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(lps):
        content = []
        for tid, (lp, top) in lps:
            t = tok_text(tid)
            content.append({"token": t, "logprob": lp, "bytes": list(t.encode()),
                            "top_logprobs": [{"token": tok_text(i), "logprob": l, "bytes": list(tok_text(i).encode())}
                                             for i, l in top]})
        return {"content": content}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_response(streams, request, chunk, n_prompt, include_usage, opening, choice):
        """The SSE body of completions and chat: the `opening` choices, then one chunk per output
        for which `choice(i, output)` gives a choice, the usage chunk if asked, `[DONE]`."""
        async def events():
            finals = {}
            for c in opening:
                yield sse({**chunk, "choices": [c]})
            async for i, o in merged(streams, request):
                c = choice(i, o)
                if c is not None:
                    yield sse({**chunk, "choices": [c]})
                if o.finished:
                    finals[i] = o
            if include_usage and len(finals) == len(streams):
                yield sse({**chunk, "choices": [], "usage": usage(n_prompt * len(streams), finals.values())})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jmem", "max_model_len": engine.max_request_tokens}]}

    @app.get("/metrics")
    async def metrics():
        lines = []
        for k, v in engine.metrics().items():
            kind = "counter" if k.endswith("_total") else "gauge"
            lines += [f"# TYPE jmem_{k} {kind}", f"jmem_{k} {float(v)}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        text = body.prompt if body.prompt is not None else tok.apply_chat_template(
            [{"role": m.role, "content": m.text()} for m in body.messages], body.add_generation_prompt)
        ids = tok.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_request_tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = getattr(tok, "vocab_size", None)
        bad = [t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range; accepted: 0..{vocab - 1}", "tokens")
        return {"prompt": tok.decode(body.tokens)}

    def prompt_ids_of(prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return prompt_ids_of(prompt[0])
        elif isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
            ids = list(prompt)
            vocab = getattr(tok, "vocab_size", None)
            if any(i < 0 or (vocab is not None and i >= vocab) for i in ids):
                raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        else:
            raise APIError(400, "prompt must be a string, one list of token ids, or a list of one of those "
                           "(batched prompts: send one request each)", "prompt")
        if not ids:
            raise APIError(400, "prompt is empty; need at least one token", "prompt")
        return ids

    def resolve_max_tokens(value, n_prompt, param):
        if value is None:
            return None
        if value < 1:
            raise APIError(400, f"{param}={value} is out of range; accepted: >= 1", param)
        return value

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(400, f"logprobs={body.logprobs} is out of range; accepted: 0..20", "logprobs")
        ids = prompt_ids_of(body.prompt)
        max_tokens = resolve_max_tokens(body.max_tokens, len(ids), "max_tokens") or 16
        params = body.sampling_params(max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = submit(ids, params, body.n, rid)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        echo = tok.decode(ids) if body.echo else ""

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            offsets = [len(echo)] * body.n

            def choice(i, o):
                lp = completion_logprobs(list(zip(o.token_ids, o.logprobs)), offsets[i]) \
                    if body.logprobs is not None else None
                offsets[i] += len(o.text)
                if not (o.text or o.finished or lp):
                    return None
                return {"index": i, "text": o.text, "logprobs": lp,
                        "finish_reason": o.finish_reason if o.finished else None}

            opening = [{"index": i, "text": echo, "logprobs": None, "finish_reason": None}
                       for i in range(body.n)] if echo else []
            return stream_response(streams, request, base, len(ids), include_usage, opening, choice)

        collected = await collect(streams, request)
        if collected is None:
            return JSONResponse({}, status_code=499)  # the client has gone
        texts, lps, finals = collected
        choices = [{"index": i, "text": echo + "".join(texts[i]),
                    "logprobs": completion_logprobs(lps[i], len(echo)) if body.logprobs is not None else None,
                    "finish_reason": finals[i].finish_reason} for i in range(body.n)]
        return {**base, "choices": choices, "usage": usage(len(ids) * body.n, finals.values())}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs={body.top_logprobs} is out of range; accepted: 0..20", "top_logprobs")
        try:
            text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        ids = tok.encode(text)
        raw = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(raw, len(ids), param)
        if max_tokens is None:
            max_tokens = max(1, min(engine.max_request_tokens - len(ids), 512))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = submit(ids, params, body.n, rid)
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            def choice(i, o):
                lp = chat_logprobs(list(zip(o.token_ids, o.logprobs))) if body.logprobs else None
                if not (o.text or o.finished or lp):
                    return None
                return {"index": i, "delta": {"content": o.text} if o.text else {}, "logprobs": lp,
                        "finish_reason": o.finish_reason if o.finished else None}

            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(body.n)]
            return stream_response(streams, request, {**base, "object": "chat.completion.chunk"}, len(ids),
                                   include_usage, opening, choice)

        collected = await collect(streams, request)
        if collected is None:
            return JSONResponse({}, status_code=499)  # the client has gone
        texts, lps, finals = collected
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(texts[i])},
                    "logprobs": chat_logprobs(lps[i]) if body.logprobs else None,
                    "finish_reason": finals[i].finish_reason} for i in range(body.n)]
        return {**base, "choices": choices, "usage": usage(len(ids) * body.n, finals.values())}

    return app


__all__ = ["create_app", "RequestOutput"]
