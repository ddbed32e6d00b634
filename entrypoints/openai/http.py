"""HTTP plumbing shared by the routes: the key/body-size guard, JSON bodies, SSE, and racing a
request's work against the client's disconnect (so that a client that leaves gets its engine
requests aborted, streamed or not)."""
from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import errors as E

T = TypeVar("T")


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_response(err: E.APIError, anthropic: bool = False) -> JSONResponse:
    """The error as a JSON response: OpenAI's shape, or Anthropic's (the /v1/messages routes)."""
    return JSONResponse(err.anthropic_body() if anthropic else err.body(), status_code=err.status,
                        headers=err.headers)


class Guard:
    """Pure-ASGI middleware: API-key check on /v1/*, /tokenize, /detokenize, /dashboard/data
    (`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`); body-size limit (413). Errors under
    /v1/messages have Anthropic's shape.

    Pure ASGI rather than FastAPI middleware so that a refused request never reaches routing
    and an oversized chunked upload is cut off while it is being read."""

    # /dashboard/data: the page (/dashboard) holds no data and is public; what it polls is keyed.
    # /openapi.json: it describes what the key protects.
    PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/dashboard/data", "/openapi.json")

    def __init__(self, app: Any, api_keys: Sequence[str], max_body_bytes: int) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.limit = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        anthropic = E.is_anthropic_path(path)

        async def refuse(err: E.APIError) -> None:
            await error_response(err, anthropic)(scope, receive, send)

        if self.keys and (path == "/v1" or path.startswith(self.PROTECTED_PREFIXES)):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            x_api_key = headers.get(b"x-api-key", b"").strip()
            # compare_digest: no timing side channel on the key
            if not any(hmac.compare_digest(t, k) for t in (token, x_api_key) if t for k in self.keys):
                return await refuse(E.invalid_api_key(bool(auth or x_api_key)))
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            length = headers.get(b"content-length")
            try:
                if length is not None and int(length) > self.limit:
                    return await refuse(E.request_too_large(self.limit))
            except ValueError:
                return await refuse(E.bad_request("Invalid Content-Length header."))
            # Buffer the body (chunked uploads included) up to the limit, then replay it.
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.limit:
                    return await refuse(E.request_too_large(self.limit))
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()     # after the body: the disconnect the routes watch for

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


# Deeper bodies are refused: no request model nests anywhere near this (a JSON schema in
# response_format or tools included), and deep trees only exist to exhaust recursion later.
MAX_JSON_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")   # \ud800-\udfff: the only way JSON text spells one


def _bad_json(detail: str) -> E.APIError:
    return E.bad_request(f"We could not parse the JSON body of your request: {detail}", None, "invalid_json")


def check_json_tree(obj: Any, max_depth: int = MAX_JSON_DEPTH, surrogates: bool = True) -> None:
    """Refuse (400) a parsed body nested deeper than `max_depth`, or with a lone surrogate in a string
    (json.loads lets `"\\ud800"` through; it cannot be encoded later). Iterative: no recursion to exhaust."""
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if surrogates:
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    raise _bad_json("a string contains a lone surrogate (e.g. \\ud800 without its pair); "
                                    "strings must be valid Unicode.") from None
            continue
        if isinstance(node, (dict, list)):
            if depth >= max_depth:
                raise _bad_json(f"it is nested deeper than {max_depth} levels.")
            items = node.items() if isinstance(node, dict) else ((None, v) for v in node)
            for key, value in items:
                if surrogates and key is not None:
                    stack.append((key, depth + 1))
                stack.append((value, depth + 1))


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _bad_json(f"it is nested deeper than {MAX_JSON_DEPTH} levels.") from None
    except (ValueError, UnicodeDecodeError):
        raise E.bad_request("We could not parse the JSON body of your request. The body must be valid JSON.",
                            None, "invalid_json") from None
    # The walk only when it can find something: raw UTF-8 cannot carry a surrogate, only a \u escape can.
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if surrogates or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        check_json_tree(body, surrogates=surrogates)
    return body


class ClientGone(Exception):
    """The client disconnected before the work it was waiting for was done."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Await `coro`, but give up (raise ClientGone) as soon as the client disconnects."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise ClientGone()


class SSEResponse(StreamingResponse):
    """A streaming response that always runs `on_close` (abort whatever is unfinished), even when the
    client goes away before the body iterator started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
