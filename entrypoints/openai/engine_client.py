"""The server's side of the engine process (core/engine_process.py): spawn it, send it commands,
route its per-step deltas to the request that asked for them.

    event loop (handlers) ── add / abort / ping ──► send queue ──► sender thread ──► pipe
    event loop ◄── loop.add_reader(pipe): unpickle one message, hand each RequestDelta to its sink

The only table of in-flight requests in this process is `_sinks` (request id → sink). A sink is
anything with `put_nowait(item)` (an asyncio.Queue will do); it receives the request's
`RequestDelta`s, or one exception that ends it: the engine's `RequestError` (as the engine
raised it), `EngineDeadError`, or whatever `abort_all` was given. Finished, refused and aborted
requests leave the table at once, so a late delta for an aborted request finds no sink.

When the engine process dies, every sink gets an EngineDeadError, the stats are dropped (nothing
may read a dead engine's load) and `on_dead` tells the app, which exits or calls `respawn` + `attach`.

Writes go through a thread because a pipe write blocks while the engine is busy stepping and not
reading; reads happen on the event loop itself (the engine writes each message whole, so a
readable pipe never stalls the loop for long), which saves a thread hop per step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from ...core.engine_process import DEFAULT_ENGINE_FACTORY, EngineInfo, engine_main
from ...core.errors import EngineDeadError
from ...core.outputs import RequestDelta

logger = logging.getLogger("tokenmill.serve")


def _import_tokenizer_modules() -> None:
    """Import what unpickling the engine's tokenizer needs while the engine process is still
    loading the model: done after the "ready" message, it would add its import time to start-up."""
    try:
        import transformers.tokenization_utils_fast  # noqa: F401
    except ImportError:      # a factory whose tokenizer is not a transformers one
        pass


class Sink(Protocol):
    def put_nowait(self, item: Any) -> None: ...


# One request to add: (request id, prompt, SamplingParams, where its outputs go).
NewRequest = tuple[str, Any, Any, Sink]


class EngineClient:
    """Owns the engine process; routes its outputs to one sink per request."""

    def __init__(self, engine_kwargs: dict[str, Any], factory: Optional[str] = None,
                 log_level: int = logging.INFO) -> None:
        self.engine_kwargs = engine_kwargs
        self.factory = factory or DEFAULT_ENGINE_FACTORY
        self.log_level = log_level
        self.info: Optional[EngineInfo] = None
        self.tokenizer: Any = None
        self.stats: dict[str, float] = {}       # the engine's EngineStats fields, as last reported
        self.on_stats: Optional[Callable[[dict[str, float]], None]] = None
        # Called (on the event loop) once when the engine process dies other than by shutdown(), after
        # every in-flight request got its EngineDeadError: the server exits or restarts the engine.
        self.on_dead: Optional[Callable[[str], None]] = None
        self._proc: Optional[multiprocessing.process.BaseProcess] = None
        self._conn: Any = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._sinks: dict[str, Sink] = {}
        self._send_q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._sender_thread: Optional[threading.Thread] = None
        self._pings: dict[int, asyncio.Future] = {}
        self._ping_ids = itertools.count()
        self._num_sent_adds = 0
        self._num_added_seen = 0
        self._dead_reason: Optional[str] = None
        self._closing = False

    # -------------------------------------------------------------- lifecycle
    def spawn(self) -> None:
        """Start the engine process without waiting for it: `serve` calls this before importing its
        web stack, so the engine's imports and model load overlap the server's."""
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=engine_main, name="tokenmill-engine", daemon=True,
                                 args=(child_conn, self.factory, self.engine_kwargs, os.getpid(), self.log_level))
        self._proc.start()
        child_conn.close()
        self._conn = parent_conn

    def start(self, timeout: Optional[float] = None) -> EngineInfo:
        """Spawn the engine process (unless `spawn` already did) and wait (blocking) until the model
        is loaded."""
        if self._proc is None:
            self.spawn()
        parent_conn = self._conn
        _import_tokenizer_modules()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            if parent_conn.poll(wait):
                try:
                    status, payload = parent_conn.recv()
                except EOFError:
                    self._proc.join(5)
                    raise RuntimeError(
                        f"engine process exited during start-up (exit code {self._proc.exitcode})") from None
                if status == "failed":
                    self._proc.join(5)
                    raise RuntimeError("engine failed to start:\n" + payload)
                break
            if not self._proc.is_alive():
                raise RuntimeError(f"engine process exited during start-up (exit code {self._proc.exitcode})")
            if deadline is not None and time.monotonic() >= deadline:
                self.shutdown()
                raise TimeoutError("engine did not start in time")
        info: EngineInfo = payload
        self.tokenizer, info.tokenizer = info.tokenizer, None
        self.info = info
        return info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start routing engine outputs into `loop` (call from inside the running loop); after `respawn`,
        this is what makes the client alive again."""
        self._loop = loop
        self._dead_reason = None
        loop.add_reader(self._conn.fileno(), self._on_readable)
        self._sender_thread = threading.Thread(target=self._sender, name="tokenmill-engine-sender", daemon=True)
        self._sender_thread.start()

    def detach(self) -> None:
        """Stop reading the dead engine's pipe (on the event loop, before `respawn`)."""
        self._stop_reading()

    def _close_pipe(self) -> None:
        """Stop the sender thread (it owns the pipe's write side), then close the pipe."""
        self._send_q.put(None)
        if self._sender_thread is not None:
            self._sender_thread.join(3)
        try:
            self._conn.close()
        except Exception:
            pass

    def respawn(self, timeout: Optional[float] = None) -> EngineInfo:
        """After the engine process died: reap what is left of it and start a new one, blocking until its
        model is loaded (run it in a thread, then `attach` on the loop). Its counters start from zero."""
        proc = self._proc
        if proc is not None:
            if proc.is_alive():      # e.g. it reported a fatal step error and is still exiting
                proc.kill()
            proc.join(3)
        self._close_pipe()
        self._send_q = queue.SimpleQueue()
        self._sender_thread = None
        self._num_sent_adds = self._num_added_seen = 0
        self.stats = {}
        self._proc = None
        return self.start(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (politely, then by force); fail whatever is still waiting."""
        if self._closing:
            return
        self._closing = True
        self._stop_reading()
        proc = self._proc
        if proc is not None and proc.is_alive():
            if self._sender_thread is not None:      # the sender thread owns the pipe's write side
                self._send_q.put(("shutdown",))
            else:
                try:
                    self._conn.send([("shutdown",)])
                except Exception:
                    pass
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(3)
        self._close_pipe()
        self._mark_dead("server shutting down")

    # -------------------------------------------------------------- state
    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and self._proc is not None and self._proc.is_alive()

    @property
    def is_closing(self) -> bool:
        """shutdown() was called."""
        return self._closing

    @property
    def num_waiting_estimate(self) -> int:
        """Requests waiting in the engine (not scheduled) now, counting the adds it has not seen yet."""
        return self.num_waiting_after(0)

    def num_waiting_after(self, num_new: int, max_running: Optional[int] = None) -> int:
        """How many requests would wait in the engine (not scheduled) once `num_new` more are added: the
        waiting it last reported, plus the adds it has not seen yet (and the new ones) that do not fit in
        its free running slots. The engine schedules whatever fits before its next step, so a request in
        flight here is not "waiting" while a running slot is free for it."""
        if max_running is None:
            max_running = self.info.max_num_seqs if self.info is not None else 0
        waiting = int(self.stats.get("num_waiting", 0))
        free = 0 if waiting else max(0, max_running - int(self.stats.get("num_running", 0)))
        unacknowledged = max(0, self._num_sent_adds - self._num_added_seen)
        return waiting + max(0, unacknowledged + num_new - free)

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    async def ping(self, timeout: float = 10.0) -> bool:
        """True when the engine process answers within `timeout` (it answers between steps)."""
        if not self.is_alive or self._loop is None:
            return False
        pid = next(self._ping_ids)
        fut = self._loop.create_future()
        self._pings[pid] = fut
        self._send_q.put(("ping", pid))
        try:
            return bool(await asyncio.wait_for(fut, timeout))
        except asyncio.TimeoutError:
            return False
        finally:
            self._pings.pop(pid, None)

    async def call(self, op: str, *args: Any, timeout: float = 120.0) -> Any:
        """A command the engine answers once, between steps (load_lora / unload_lora): its result, or
        the engine's refusal raised as it is; EngineDeadError when the engine is gone."""
        if not self.is_alive or self._loop is None:
            raise EngineDeadError(self._dead_reason or "engine is not running")
        call_id = next(self._ping_ids)
        fut = self._loop.create_future()
        self._pings[call_id] = fut           # shares the pings' table: a death answers False to both
        self._send_q.put((op, call_id, *args))
        try:
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._pings.pop(call_id, None)
        if reply is False:
            raise EngineDeadError(self._dead_reason or "engine process exited")
        error, result = reply
        if error is not None:
            raise error
        return result

    # -------------------------------------------------------------- requests
    def add(self, requests: Sequence[NewRequest], priority: int = 0) -> None:
        """Send requests to the engine in ONE command: the engine validates them all before its next
        step, so a refused one fails before any sibling (another prompt of the same HTTP request)
        has produced output. Raises EngineDeadError when the engine is not running."""
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason or "engine is not running")
        for request_id, _, _, sink in requests:
            self._sinks[request_id] = sink
        self._num_sent_adds += len(requests)
        self._send_q.put(("add", [(rid, prompt, params, priority) for rid, prompt, params, _ in requests]))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests that have not finished (finished or unknown ids are skipped)."""
        rids = [r for r in request_ids if self._sinks.pop(r, None) is not None]
        if rids and self.is_alive:
            self._send_q.put(("abort", rids))

    def abort_all(self, exc: BaseException) -> None:
        """Abort every in-flight request; each sink receives `exc` (e.g. for a shutdown)."""
        sinks, self._sinks = self._sinks, {}
        if sinks and self.is_alive:
            self._send_q.put(("abort", list(sinks)))
        for sink in sinks.values():
            sink.put_nowait(exc)

    # -------------------------------------------------------------- pipe
    def _sender(self) -> None:
        while True:
            item = self._send_q.get()
            batch = []
            while item is not None:      # everything queued goes in one pipe message
                batch.append(item)
                try:
                    item = self._send_q.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    self._conn.send(batch)
                except Exception:
                    return
            if item is None:
                return

    def _stop_reading(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._conn.fileno())
            except (OSError, ValueError, RuntimeError):
                pass

    def _on_readable(self) -> None:
        try:
            msgs = self._conn.recv()
        except Exception:   # EOF: the engine process is gone
            self._stop_reading()
            proc = self._proc
            exited = proc is not None and not proc.is_alive()
            self._mark_dead("engine process exited" + (f" (exit code {proc.exitcode})" if exited else ""))
            return
        for msg in msgs:
            op = msg[0]
            if op == "out":
                self._route(msg[1])
                self.stats, self._num_added_seen = msg[2], msg[3]
                if self.on_stats is not None:
                    try:
                        self.on_stats(self.stats)
                    except Exception:
                        logger.exception("metrics update failed")
            elif op == "error":
                sink = self._sinks.pop(msg[1], None)
                if sink is not None:
                    sink.put_nowait(msg[2])
            elif op in ("pong", "reply"):
                fut = self._pings.get(msg[1])
                if fut is not None and not fut.done():
                    fut.set_result(True if op == "pong" else msg[2])
            elif op == "fatal":
                logger.error("engine process failed:\n%s", msg[1])
                self._mark_dead("engine step failed")

    def _route(self, deltas: list[RequestDelta]) -> None:
        sinks = self._sinks
        for d in deltas:
            sink = sinks.get(d.request_id)
            if sink is not None:
                sink.put_nowait(d if d.error is None else d.error)   # a late refusal ends it like an early one
                if d.finished:
                    del sinks[d.request_id]

    def _mark_dead(self, reason: str) -> None:
        first = self._dead_reason is None
        if first:
            self._dead_reason = reason
            if not self._closing:
                logger.error("engine is dead: %s", reason)
        self.stats = {}      # the dead engine's load is nobody's: admission and gauges must not read it
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.put_nowait(EngineDeadError(reason))
        for fut in self._pings.values():
            if not fut.done():
                fut.set_result(False)
        if first and not self._closing and self.on_dead is not None:
            try:
                self.on_dead(reason)
            except Exception:
                logger.exception("handling the engine's death failed")
