"""uvicorn's h11 protocol with what it lacks against slow and greedy clients: a deadline for the request
head and one for the body, and a connection cap that still lets the probes through.

uvicorn's only read timeout is the keep-alive one, and any byte cancels it: a client that sends its
headers one byte a second holds a connection (and a file descriptor) for as long as it likes — 120 of
them used to be held for 40 s. Here the head must be complete within --timeout-request-header seconds
of the connection opening (or of the previous response), and the body within --timeout-request-body
seconds of the head, however slowly the bytes trickle; past it the client gets a 408 and the connection
is closed. The head's size is bounded by h11 (16 KiB), the body's by --max-request-body-bytes (http.py).

uvicorn's own --limit-concurrency answers every request past the cap with a 503, /health/live
included, so an orchestrator would kill a server that is merely busy. Here past --limit-concurrency
open connections (or requests in progress) a request gets a 503 with `Connection: close` — except the
probes, which are cheap and must tell "busy" from "dead".
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
from typing import Any, Optional

PROBE_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/ping", "/metrics", "/version"})
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s")


def add_connection_args(group: Any) -> None:
    """The serve flags for the HTTP connections (docs/serving.md, "Limits and timeouts")."""
    group.add_argument("--timeout-request-header", type=float, default=10.0, metavar="S",
                       help="close a connection (408) whose request head is not complete this many seconds after "
                            "it opened or after its previous response: slow-loris clients (default 10)")
    group.add_argument("--timeout-request-body", type=float, default=60.0, metavar="S",
                       help="close a connection (408) whose request body has not fully arrived this many seconds "
                            "after its head (default 60)")
    group.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                       help="close an idle keep-alive connection after this many seconds (uvicorn's; default 5)")
    group.add_argument("--limit-concurrency", type=int, default=2048, metavar="N",
                       help="past N open connections or requests in progress, answer 503 with Connection: close "
                            "(the probes /health, /health/live, /health/ready, /metrics still answer; default 2048)")


def check_connection_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("timeout_request_header", "timeout_request_body", "timeout_keep_alive"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.limit_concurrency < 1:
        parser.error(f"--limit-concurrency must be >= 1, got {args.limit_concurrency}")


def guarded_protocol(header_timeout: float, body_timeout: float, limit: Optional[int]) -> type:
    """The protocol class to pass as uvicorn.Config(http=...), with these deadlines and this cap."""
    return type("GuardedH11Protocol", (_protocol_class(),),
                {"header_timeout": header_timeout, "body_timeout": body_timeout, "connection_limit": limit})


def _error_body(message: str, code: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


@functools.lru_cache(maxsize=None)
def _protocol_class() -> type:
    """The class, built on first use: uvicorn is imported by `serve` only, not by every CLI command."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        header_timeout = 10.0
        body_timeout = 60.0
        connection_limit: Optional[int] = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: Optional[asyncio.TimerHandle] = None
            self._waiting_for: Optional[str] = None      # "head" or "body": what the deadline is for
            self.app = self._capped(self.app)

        # --------------------------------------------------------------- deadlines
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm("head", self.header_timeout)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                if self.conn.their_state is h11.IDLE:    # the next request's head gets a fresh deadline
                    self._arm("head", self.header_timeout)
                self._follow()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _follow(self) -> None:
            """After h11 read some bytes: the head complete, the body's deadline starts; the body complete, none."""
            state = self.conn.their_state
            if state is h11.IDLE:
                return              # the head's deadline runs on, however many bytes trickle in
            if state is h11.SEND_BODY:
                if self._waiting_for != "body":
                    self._arm("body", self.body_timeout)
            else:
                self._disarm()

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._waiting_for = what
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._waiting_for = None, None

        def _expired(self) -> None:
            what, self._deadline, self._waiting_for = self._waiting_for, None, None
            if self.transport.is_closing():
                return
            started = self.cycle is not None and getattr(self.cycle, "response_started", False)
            if what == "head" and self.cycle is not None and not self.cycle.response_complete:
                return      # a response is under way (h11 reads the next head only after it)
            if not started:
                seconds = self.header_timeout if what == "head" else self.body_timeout
                body = _error_body(f"The request {what} did not arrive within {seconds:g} s.", "request_timeout",
                                   "invalid_request_error")
                self.transport.write(_REQUEST_TIMEOUT % (len(body), body))
            self.transport.close()

        # --------------------------------------------------------------- the cap
        def _capped(self, app: Any) -> Any:
            limit = self.connection_limit
            if limit is None:
                return app
            connections, tasks = self.connections, self.tasks

            async def capped(scope: Any, receive: Any, send: Any) -> None:
                over = len(connections) > limit or len(tasks) > limit
                if scope["type"] != "http" or not over or scope.get("path") in PROBE_PATHS:
                    return await app(scope, receive, send)
                body = _error_body(f"The server has more than {limit} connections open; retry shortly.",
                                   "too_many_connections", "server_error")
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"retry-after", b"1"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            return capped

    return GuardedH11Protocol
