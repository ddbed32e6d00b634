"""The pluggy hooks: calls the engine makes *with arguments*, where every implementation runs.

Extensions that add a thing by name (platforms, attention backends, models, ...) are entry
points of their own groups (plugins/kinds.py), not hooks. A hook implementation is registered
under the entry-point group `tokenmill.hooks` (a module, a class -- instantiated once -- or an
object), implements only the hooks it needs, and is refused if it implements a hook not defined
here.

    from tokenmill.plugins.hookspecs import hookimpl

    @hookimpl
    def tokenmill_request_event(event):
        if event.kind == "finished":
            print(event.request_id, event.num_output_tokens)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import pluggy

PROJECT = "tokenmill"
HOOK_API_VERSION = 1       # bumped when a hook's arguments change incompatibly

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUEST_EVENT_KINDS = ("arrived", "scheduled", "first_token", "preempted", "finished", "aborted")


@dataclass(frozen=True)
class RequestEvent:
    """One step of a request's life, as the engine emits it."""
    kind: str                          # one of REQUEST_EVENT_KINDS
    request_id: str
    time: float = field(default_factory=time.time)   # wall clock (time.time()) when it happened
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: Optional[str] = None   # "stop", "length", "abort", ... on finished / aborted


class TokenmillHookSpecs:
    @hookspec
    def tokenmill_request_event(self, event: RequestEvent) -> None:
        """A request arrived, was scheduled, produced its first token, was preempted, finished or
        was aborted. Called on the engine's thread: return quickly (hand slow work elsewhere).
        An implementation that raises is logged and the others still run."""

    @hookspec
    def tokenmill_validate_config(self, config: Any) -> list:
        """Problems with this EngineConfig, as sentences (empty list: none). The engine refuses to
        start with a ValueError listing every problem of every validator."""


HOOK_NAMES = tuple(name for name in vars(TokenmillHookSpecs) if name.startswith("tokenmill_"))
