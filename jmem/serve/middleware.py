"""Pure ASGI middlewares of the HTTP server: API-key check, and JSON bodies of bounded size.

Pure ASGI, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware wraps `receive`, and a
request behind it never sees its client disconnect (which aborts its generation).

Example:
    >>> app.add_middleware(JSONBodies, paths=frozenset({"/v1/completions"}), max_bytes=32 * 2**20)
    >>> app.add_middleware(RequireAPIKey, api_key="sk-...")
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from jmem.serve import DEFAULT_MAX_REQUEST_BYTES
from jmem.serve.protocol import APIError


async def _answer(error: APIError, scope, receive, send) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


class RequireAPIKey:
    """401 on /v1 routes without `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            # The scheme is case-insensitive (RFC 9110 section 11.1): "bearer" is "Bearer".
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.expected):
                return await _answer(APIError(401, "missing or invalid API key", code="invalid_api_key"),
                                     scope, receive, send)
        await self.app(scope, receive, send)


class JSONBodies:
    """A POST body to one of `paths` must be JSON (`Content-Type: application/json`, `application/*+json`
    or none) of at most
    `max_bytes`: else one 400 or 413 in OpenAI's shape before any of it is parsed. The body is read
    here, then handed to the app whole; later `receive` calls (a client's disconnect) pass through."""

    def __init__(self, app, paths: frozenset[str], max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.app, self.paths, self.max_bytes = app, paths, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if not kind:  # read as JSON, as vLLM does (`requests.post(url, data=json.dumps(...))` sends none)
            scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        elif kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
            return await _answer(APIError(400, f"Content-Type {kind or '(none)'!r}; accepted: application/json "
                                               f"(a JSON request body)"), scope, receive, send)
        too_big = APIError(413, f"request body over --max-request-bytes={self.max_bytes}; accepted: a smaller body "
                                f"(fewer or shorter prompts)", err_type="invalid_request_error")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _answer(too_big, scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body arrived
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _answer(too_big, scope, receive, send)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        await self.app(scope, replay, send)
