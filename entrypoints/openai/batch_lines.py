"""One line of an OpenAI batch file, run through the app's own routes (in process, over ASGI), so that a
batch line's result is exactly what the same request sent over HTTP gets. Shared by `tokenmill run-batch`
and the online /v1/batches jobs.

Input line:  {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Output line: {"id": "batch_req_…", "custom_id": ..., "response": {"status_code", "request_id", "body"},
              "error": null}
A request the route refused (400, 404, …) is still a `response` (its body the route's error); a line that
could not be run at all (invalid JSON, no custom_id, an unknown url, an endpoint this server does not
serve) has `"response": null` and an `error` {"code", "message"}.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# A 503 that says "this server cannot answer now" rather than anything about the request: not a result.
TRANSIENT_CODES = ("server_shutting_down", "engine_dead", "model_loading", "server_overloaded")


@dataclass
class BatchLine:
    index: int                     # the line's number in the file (0-based, blank lines not counted)
    custom_id: Optional[str]
    url: Optional[str] = None
    body: Optional[dict[str, Any]] = None
    error: Optional[dict[str, str]] = None    # set: the line is not run; its output is this error


def _line_error(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def parse_line(index: int, raw: str, endpoint: Optional[str] = None) -> BatchLine:
    """A batch file's line; anything wrong with it is the line's own error, never an exception.
    `endpoint`: the url every line must have (a /v1/batches job's endpoint)."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return BatchLine(index, None, error=_line_error("invalid_json", f"Line {index + 1} is not valid JSON: {exc}"))
    if not isinstance(obj, dict):
        return BatchLine(index, None, error=_line_error("invalid_request", f"Line {index + 1} is not a JSON object."))
    custom_id = obj.get("custom_id")
    line = BatchLine(index, custom_id if isinstance(custom_id, str) else None)
    url, method, body = obj.get("url"), obj.get("method", "POST"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        line.error = _line_error("missing_required_parameter", f"Line {index + 1}: custom_id must be a non-empty "
                                 "string.")
    elif not isinstance(method, str) or method.upper() != "POST":
        line.error = _line_error("invalid_method", f"method must be POST, got {method!r}.")
    elif url not in ENDPOINTS:
        line.error = _line_error("invalid_url", f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}.")
    elif endpoint is not None and url != endpoint:
        line.error = _line_error("mismatched_endpoint", f"url {url!r} differs from the batch's endpoint "
                                 f"{endpoint!r}.")
    elif not isinstance(body, dict):
        line.error = _line_error("invalid_request", "body must be a JSON object.")
    elif body.get("stream"):
        line.error = _line_error("unsupported_parameter", "stream is not supported in batch requests.")
    else:
        line.url, line.body = url, body
    return line


async def call_app(app: Any, path: str, body: bytes) -> tuple[int, Any]:
    """POST `body` to `path` on the ASGI `app` in this process; (status, JSON body). The 'client' never
    disconnects; cancelling this aborts the request (the route closes its engine requests)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("batch", 0)}
    delivered = False
    never = asyncio.Event()
    status = [500]
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:      # Starlette re-raises after its 500 response has been sent
        if not chunks:
            raise
    raw = b"".join(chunks)
    try:
        return status[0], json.loads(raw) if raw else None
    except ValueError:
        return status[0], {"error": {"message": raw.decode("utf-8", "replace"), "type": "server_error",
                                     "param": None, "code": None}}


def is_transient(status: int, body: Any) -> bool:
    """A refusal that says nothing about the request (shutdown, dead engine, full queue): retry or resume,
    never record it as the line's result."""
    if status != 503 or not isinstance(body, dict):
        return False
    return (body.get("error") or {}).get("code") in TRANSIENT_CODES


async def run_line(app: Any, line: BatchLine, priority: Optional[int] = None) -> tuple[int, Any]:
    """Run a parsed (error-free) line through the app's route: (status, body). `priority` is the engine
    priority the line gets unless its body sets one (a larger number is served later)."""
    assert line.url is not None and line.body is not None
    body = dict(line.body)
    if priority is not None and body.get("priority") in (None, 0):
        body["priority"] = priority
    return await call_app(app, line.url, json.dumps(body).encode())


def output_record(line: BatchLine, status: Optional[int] = None, body: Any = None) -> dict[str, Any]:
    """The output line for `line`: its response (status, body), or its own error when it was not run."""
    error = line.error
    if error is None and status == 404 and isinstance(body, dict) and \
            (body.get("error") or {}).get("code") == "not_found":
        # the app has no such route: e.g. /v1/embeddings on a server without an embeddings endpoint
        error = _line_error("unsupported_endpoint", f"{line.url} is not served by this model/server.")
    record: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                              "response": None, "error": error}
    if error is None:
        request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
        record["response"] = {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}",
                              "body": body}
    return record


def succeeded(record: dict[str, Any]) -> bool:
    """An output line OpenAI would put in the output file (the rest go to the error file)."""
    response = record.get("response")
    return record.get("error") is None and response is not None and 200 <= response["status_code"] < 300


def dumps_line(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
