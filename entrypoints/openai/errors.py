"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server reports, 401 and 404 included, goes through `APIError`, so a client
(the official SDK included) always sees the same shape and the right status code.
"""
from __future__ import annotations

import json
from typing import Any, Optional


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

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(message: str, param: Optional[str] = "messages") -> APIError:
    return APIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    "invalid_request_error", "model", "model_not_found")


def invalid_api_key(provided: bool) -> APIError:
    message = ("Incorrect API key provided." if provided else
               "You didn't provide an API key. Pass it in the Authorization header: "
               "`Authorization: Bearer YOUR_KEY`.")
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def request_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {limit} bytes.",
                    "invalid_request_error", None, "request_too_large")


def server_overloaded(retry_after: int = 1) -> APIError:
    return APIError(503, "The server is overloaded (the waiting queue is full); retry later.",
                    "server_error", None, "server_overloaded", headers={"Retry-After": str(retry_after)})


def engine_dead() -> APIError:
    return APIError(503, "The engine process is not running.", "server_error", None, "engine_dead")


def internal_error(message: str = "The server had an internal error while processing the request.") -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def from_engine_value_error(exc: BaseException, default_param: Optional[str] = None) -> APIError:
    """Map an engine ValueError (bad input) to a 400; context-length errors get their OpenAI code."""
    message = str(exc) or exc.__class__.__name__
    param = getattr(exc, "param", None) or default_param
    if "maximum context length" in message:
        return context_length_exceeded(message, param or "messages")
    return bad_request(message, param)
