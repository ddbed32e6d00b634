"""The one error type a request can be refused with, from the library and the server alike.

The engine validates a request once (prompt, length, sampling parameters); what it refuses
travels unchanged to the caller: `LLM` raises it, the server turns it into one OpenAI-shaped
400 (`param` and `code` are OpenAI's fields). It is a ValueError so plain `except ValueError`
callers keep working.
"""
from __future__ import annotations

from typing import Optional


class RequestError(ValueError):
    """A request the engine refuses. `param` names the offending parameter; `code` is an
    OpenAI error code where one fits ("context_length_exceeded", "invalid_value", ...)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self):   # crosses the engine-process pipe intact
        return (type(self), (self.message, self.param, self.code))


class EngineDeadError(RuntimeError):
    """The engine cannot continue: a worker or the engine-core process died or failed."""


class PathNotFoundError(FileNotFoundError, ValueError):
    """A model or tokenizer path that does not exist: a bad argument (ValueError, as every other
    bad engine argument is) and a missing file (FileNotFoundError) at once."""
