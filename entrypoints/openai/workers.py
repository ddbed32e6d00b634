"""Off the event loop: tokenizing, detokenizing and rendering chat templates run in worker threads, so
that one big prompt or a slow template never stalls /health or another client's stream.

Threads are enough for the tokenizer: a Hugging Face fast tokenizer encodes and decodes in Rust with
the GIL released, so the event loop keeps running while a worker tokenizes. ONE thread tokenizes (as
vLLM's API server does): the Rust tokenizer keeps its truncation/padding settings as mutable state that
every encode call sets, so two threads encoding at once can see each other's settings ("Already
borrowed", or a silently truncated prompt). A long text (over LONG_TEXT_CHARS) is encoded by a second
thread with a copy of the tokenizer of its own, so that a 300 KB prompt (seconds of tokenizing) never
holds up another client's short one. A chat template is Python (Jinja): the server's own template
(the model's, or --chat-template) is the operator's code and is rendered in a thread of its own pool
under a deadline the request waits on; a client's template is untrusted code and is rendered in a
process that is killed at its deadline (template_sandbox.py).
"""
from __future__ import annotations

import asyncio
import copy
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

from .limits import RequestLimits
from .template_sandbox import TemplateError, TemplateSandbox

T = TypeVar("T")

LONG_TEXT_CHARS = 32 * 1024     # a text this long takes a noticeable time to tokenize (tens of ms and up)

__all__ = ["TemplateError", "Workers"]


class Workers:
    """The worker threads (and, with --trust-request-chat-template, the template sandbox) of one server."""

    def __init__(self, limits: RequestLimits, tokenizer: Any = None, template_threads: Optional[int] = None) -> None:
        self.template_timeout = limits.chat_template_timeout
        self.tokenizer = tokenizer
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenizer")
        self._long_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenizer-long")
        self._long_tokenizer: Any = None       # the copy the long-text thread encodes with (made on first use)
        self._template_pool = ThreadPoolExecutor(max_workers=template_threads or min(4, os.cpu_count() or 1),
                                                 thread_name_prefix="tokenmill-template")
        self.sandbox = TemplateSandbox(self.template_timeout) if limits.trust_request_chat_template else None
        # Clients' templates wait for the sandbox on a thread of their own: a flood of them (each up to the
        # timeout) must not hold the threads everybody else's tokenizing needs.
        self._sandbox_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-sandbox")
        if self.sandbox is not None:     # its child imports transformers: seconds, better spent before a request
            self._sandbox_pool.submit(self.sandbox.start)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the tokenizer's thread: whatever encodes or decodes."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of `text`, in the tokenizer's thread, or (a long text) in the long-text thread."""
        if len(text) <= LONG_TEXT_CHARS:
            return await self.run(lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))
        return await asyncio.get_running_loop().run_in_executor(self._long_pool, self._encode_long, text,
                                                                add_special_tokens)

    def _encode_long(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._long_tokenizer is None:      # only this thread ever uses the copy
            self._long_tokenizer = copy.deepcopy(self.tokenizer)
        return list(self._long_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def render_in_sandbox(self, *args: Any) -> str:
        """A client's template: TemplateSandbox.render(*args) (TemplateError past its bounds)."""
        assert self.sandbox is not None, "only with --trust-request-chat-template"
        deadline = time.monotonic() + self.template_timeout      # waiting behind other templates counts
        return await asyncio.get_running_loop().run_in_executor(
            self._sandbox_pool, functools.partial(self.sandbox.render, *args, deadline=deadline))

    async def run_bounded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a template thread, given up after the template timeout (TemplateError). The
        thread itself finishes its work in the background: only the server's own templates go here (trusted
        code; rendering reads the tokenizer, never encodes)."""
        work = asyncio.get_running_loop().run_in_executor(self._template_pool, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(work, self.template_timeout)
        except asyncio.TimeoutError:
            raise TemplateError(f"the chat template did not render within {self.template_timeout:g} s") from None

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._long_pool.shutdown(wait=False, cancel_futures=True)
        self._template_pool.shutdown(wait=False, cancel_futures=True)
        self._sandbox_pool.shutdown(wait=False, cancel_futures=True)
