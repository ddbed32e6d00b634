"""A request-lifecycle subscriber: one INFO line per finished or aborted request.

Registered only when TOKENMILL_LOG_REQUESTS=1 (plugins/hooks.py), so it costs nothing otherwise.
"""
from __future__ import annotations

import logging

from .hookspecs import RequestEvent, hookimpl

logger = logging.getLogger("tokenmill.requests")


class RequestLog:
    def __init__(self) -> None:
        self._arrived: dict[str, float] = {}    # request id -> arrival time, until it ends

    @hookimpl
    def tokenmill_request_event(self, event: RequestEvent) -> None:
        if event.kind == "arrived":
            self._arrived[event.request_id] = event.time
        elif event.kind in ("finished", "aborted"):
            start = self._arrived.pop(event.request_id, None)
            latency = f"{event.time - start:.3f}s" if start is not None else "?"
            logger.info("request %s %s: %d prompt tokens, %d output tokens, finish reason %s, e2e %s",
                        event.request_id, event.kind, event.num_prompt_tokens, event.num_output_tokens,
                        event.finish_reason, latency)
