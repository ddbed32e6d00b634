"""Client-supplied chat templates (`--trust-request-chat-template`), rendered in a child process that
is killed when it runs past its time.

Why a process: a Jinja template is Python code running on Python objects. jinja2's sandbox stops it
from reaching Python internals, but not from running forever (`{% for i in range(10**5) %}{% for j in
range(10**5) %}` makes no call the sandbox could intercept) or from building a 200 MB string in one
expression, and a thread running it can be neither interrupted nor killed: only a process can. The
child renders with transformers' own `render_jinja_template` (the same sandboxed environment, globals
and `{% generation %}` tag as `tokenizer.apply_chat_template`), under an address-space limit, and
sends back the text only when it is within the byte bound. One child serves one render at a time;
a render that times out kills it and the next render starts a fresh one.
"""
from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any, Optional

# Address space the child may grow by beyond what it holds once loaded: room for any sane prompt,
# a MemoryError (not the host's OOM killer) for `'a' * 10**10`.
_CHILD_HEADROOM_BYTES = 1 << 30
_STARTUP_TIMEOUT_S = 120.0


class TemplateError(Exception):
    """The template could not render these inputs within the bounds; the message says why."""


def _child(conn: Any) -> None:
    """The child: load the renderer, cap the address space, then render jobs until the pipe closes."""
    import resource

    from transformers.utils.chat_template_utils import render_jinja_template
    try:
        with open("/proc/self/statm") as f:
            vm_bytes = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + _CHILD_HEADROOM_BYTES, resource.RLIM_INFINITY))
    except (OSError, ValueError):      # no /proc or no RLIMIT_AS: the time bound still holds
        pass
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        template, messages, tools, add_generation_prompt, continue_final_message, kwargs, max_bytes = job
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages], tools=tools, chat_template=template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **kwargs)
            text = rendered[0]
            if len(text) > max_bytes or len(text.encode("utf-8", "surrogatepass")) > max_bytes:
                conn.send(("error", f"the chat template rendered more than {max_bytes} bytes"))
            else:
                conn.send(("ok", text))
        except MemoryError:
            conn.send(("error", "the chat template used too much memory"))
        except Exception as exc:   # jinja's errors, raise_exception(), a TypeError in the template...
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class TemplateSandbox:
    """Renders templates in a killable child process. `render` blocks: call it from a worker thread."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()        # one render at a time per child
        self._proc: Any = None
        self._conn: Any = None
        self._ready = False

    def start(self) -> None:
        """Start the child now (it takes seconds to import transformers), so the first render is quick."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child,), name="tokenmill-template-sandbox", daemon=True)
        self._proc.start()
        child.close()
        self._conn, self._ready = parent, False

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None
        self._ready = False

    def render(self, template: str, messages: list[dict], tools: Optional[list], add_generation_prompt: bool,
               continue_final_message: bool, kwargs: dict[str, Any], max_bytes: int,
               deadline: Optional[float] = None) -> str:
        """The rendered text; TemplateError when the template fails, runs past `timeout` seconds (the
        child is killed), uses too much memory or renders more than `max_bytes`. `deadline` (monotonic):
        when the request started waiting for a render, if earlier than now (time queued counts)."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TemplateError(f"the chat template did not render within {self.timeout:g} s (other templates "
                                "are rendering)")
        try:
            status, value = self._exchange((template, messages, tools, add_generation_prompt, continue_final_message,
                                            kwargs, max_bytes), deadline)
        except (OSError, EOFError, ValueError, AttributeError):
            # The child died (the OS killed it for its memory, say) or was killed by close(): a fresh one next time.
            self._kill()
            raise TemplateError("the chat template renderer died while rendering") from None
        finally:
            self._lock.release()
        if status != "ok":
            raise TemplateError(value)
        return value

    def _exchange(self, job: tuple, deadline: float) -> tuple[str, Any]:
        """Send one job to the child (started if need be) and wait for its answer until `deadline`."""
        self._ensure_started()
        if not self._ready:      # the child's start-up is not the template's time
            if not self._conn.poll(_STARTUP_TIMEOUT_S):
                self._kill()
                raise TemplateError("the chat template renderer did not start")
            self._conn.recv()
            self._ready = True
            deadline = time.monotonic() + self.timeout
        if time.monotonic() >= deadline:     # its time went waiting for other templates: the child is fine
            raise TemplateError(f"the chat template did not render within {self.timeout:g} s (other "
                                "templates were rendering)")
        self._conn.send(job)
        if not self._conn.poll(max(0.0, deadline - time.monotonic())):
            self._kill()
            raise TemplateError(f"the chat template did not render within {self.timeout:g} s")
        return self._conn.recv()

    def close(self) -> None:
        """Kill the child (at shutdown: without waiting for a render in progress, which then fails)."""
        self._kill()
