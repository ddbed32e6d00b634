"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server reports, 401 and 404 included, goes through `APIError`, so a client
(the official SDK included) always sees the same shape and the right status code. What the
engine refuses (a `RequestError`, pickled unchanged across the process boundary) and what
SamplingParams refuses (a ValueError naming its `param`) become an APIError in exactly one
place, `from_exception`.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from .engine_client import EngineDeadError


class ServerShuttingDown(Exception):
    """Ends a request the shutdown grace period did not let finish."""


class APIError(Exception):
    """An error the server reports to the client. `code` is OpenAI's string code where one exists."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` (the type from the status)."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """The routes of Anthropic's Messages API, whose errors have Anthropic's shape."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400. Its code is never null: "invalid_value" unless a more precise one is given
    ("invalid_type", "missing_required_parameter", "unknown_parameter", "context_length_exceeded", ...)."""
    return APIError(400, message, "invalid_request_error", param, code or "invalid_value")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    "invalid_request_error", "model", "model_not_found")


def invalid_api_key(provided: bool) -> APIError:
    message = ("Incorrect API key provided." if provided else
               "You didn't provide an API key. Pass it in the Authorization header: "
               "`Authorization: Bearer YOUR_KEY` (or in `x-api-key: YOUR_KEY`).")
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def request_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {limit} bytes.",
                    "invalid_request_error", None, "request_too_large")


def server_overloaded(retry_after: int = 1) -> APIError:
    return APIError(503, "The server is overloaded (the waiting queue is full); retry later.",
                    "server_error", None, "server_overloaded", headers={"Retry-After": str(retry_after)})


def model_loading(failed: Optional[str] = None) -> APIError:
    if failed:
        return APIError(503, f"The model failed to load: {failed}", "server_error", None, "engine_dead")
    return APIError(503, "The model is still loading; retry shortly.", "server_error", None, "model_loading",
                    headers={"Retry-After": "1"})


def engine_dead() -> APIError:
    return APIError(503, "The engine process is not running.", "server_error", None, "engine_dead")


def internal_error(message: str = "The server had an internal error while processing the request.") -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def server_shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; the request was aborted.", "server_error", None,
                    "server_shutting_down")


def from_exception(exc: BaseException, rename: Optional[Mapping[str, str]] = None) -> APIError:
    """The one translation of a request's failure into what the client sees.

    A ValueError (the engine's RequestError, SamplingParams' own) is a 400 that keeps its
    `param` and `code` (e.g. "context_length_exceeded"); `rename` maps the engine's parameter
    names to the route's (chat calls the engine's "prompt" "messages"). A dead engine or a
    shutdown is a 503; anything else the engine raised is a 500 carrying its message.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead()
    if isinstance(exc, ServerShuttingDown):
        return server_shutting_down()
    if isinstance(exc, ValueError):
        message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        param = getattr(exc, "param", None)
        if rename and param in rename:
            param = rename[param]
        return bad_request(message, param, getattr(exc, "code", None))
    return internal_error(f"The engine refused the request: {type(exc).__name__}: {exc}")
