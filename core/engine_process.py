"""The engine core in its own process: the server's `EngineClient` spawns `engine_main`.

    client (server process)                      engine process (this module)
    ───────────────────────                      ─────────────────────────────────────────
    [("add", [(id, prompt, params, prio), …]),   loop:
     ("abort", [id, …]), ("ping", n),              drain every command that is waiting
     ("shutdown",)]  ─────────── pipe ──────►      step() if anything is unfinished
                     ◄────────── pipe ───────      send ONE message per step:
    [("error", id, RequestError), …,                 the engine's RequestDeltas as they are,
     ("out", [RequestDelta, …], stats, n_added),     its stats, and how many adds it has seen
     ("pong", n), ("fatal", traceback)]

Data flows one way: the engine already emits per-step deltas, so this loop forwards them
untouched and keeps no table of its own (the engine's request dict is the only one in this
process). A refused request's RequestError travels pickled, unchanged, to the client.

The process never outlives the server: it exits on a shutdown command, on EOF of its pipe,
when its parent pid changes, and (Linux) by PR_SET_PDEATHSIG when the parent dies. It ignores
SIGINT: Ctrl-C is the server's to handle (it finishes or aborts in-flight requests, then shuts
the engine down). Nothing here imports torch at module level, so the server process can import
the message types cheaply.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .errors import RequestError

DEFAULT_ENGINE_FACTORY = "tokenmill.core.engine:LLMEngine"


@dataclass
class EngineInfo:
    """What the engine process reports once the model is loaded (its "ready" message)."""
    model_name: str
    max_model_len: int
    max_num_seqs: int
    block_size: int
    platform: str
    attention_backend: str
    num_kv_blocks: int
    vocab_size: int
    model_path: Optional[str]
    tokenizer: Any = dataclasses.field(default=None, repr=False)   # the engine's own, pickled across
    runner: str = "generate"          # "pooling": an embedding model (only /v1/embeddings serves it)
    lora_adapters: dict = dataclasses.field(default_factory=dict)   # LoRA adapter name -> path (--lora-modules)

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens the KV pool holds at once."""
        if not self.max_model_len:
            return 0.0
        return self.num_kv_blocks * self.block_size / self.max_model_len


def resolve_factory(path: str) -> Callable[..., Any]:
    """`module:attr` or `path/to/file.py:attr` (the server's hidden --engine-factory, for tests)."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"engine factory must be 'module:attr', got {path!r}")
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_tokenmill_engine_factory", module_name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, attr)


def stats_dict(engine: Any) -> dict[str, float]:
    """The engine's EngineStats (core/outputs.py) as a plain dict, the form the server's metrics read."""
    try:
        stats = engine.stats()
    except Exception:   # an engine without stats still serves
        return {}
    # Field by field, not dataclasses.asdict: stats() builds every value afresh and the dict is pickled at
    # once, so asdict's deep copy (7 ms a step for a 48-layer, 128-expert model's per-expert counts) buys nothing.
    if dataclasses.is_dataclass(stats):
        return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    return dict(vars(stats))


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
        except Exception:
            pass


def _engine_info(engine: Any) -> EngineInfo:
    cfg = engine.config
    tokenizer = engine.tokenizer
    try:
        pickle.dumps(tokenizer)
    except Exception as exc:   # the server tokenizes prompts itself: it cannot serve without it
        raise RuntimeError(f"the engine's tokenizer cannot be sent to the server process: {exc}") from exc
    return EngineInfo(
        model_name=str(engine.model_name),
        max_model_len=int(cfg.model.max_model_len),
        max_num_seqs=int(cfg.scheduler.max_num_seqs),
        block_size=int(cfg.cache.block_size),
        platform=str(getattr(getattr(engine, "platform", None), "name", "?")),
        attention_backend=str(getattr(engine, "attention_backend_name", "?")),
        num_kv_blocks=int(getattr(engine, "num_kv_blocks", 0) or 0),
        vocab_size=int(getattr(engine, "vocab_size", 0) or len(tokenizer)),
        model_path=cfg.model.model,
        tokenizer=tokenizer,
        runner="pooling" if getattr(engine, "pooler_config", None) is not None else "generate",
        lora_adapters=_lora_adapters(engine),
    )


def _lora_adapters(engine: Any) -> dict[str, str]:
    return {r.lora_name: r.lora_path for r in (engine.list_loras() if hasattr(engine, "list_loras") else [])}


def lora_command(engine: Any, op: str, name: str, path: Optional[str] = None) -> tuple[Optional[Exception], Any]:
    """("load_lora", name, path) / ("unload_lora", name): (None, the adapters now) or (the refusal, None).
    A load reads and validates the adapter here, so a bad one is refused before any request names it."""
    from .lora.manager import enabled
    from .lora.request import LoRARequest
    try:
        manager = enabled(getattr(engine, "lora", None))
        if op == "load_lora":
            if name in manager.registry:
                raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name", "invalid_value")
            engine.add_lora(LoRARequest(name, manager.next_id(), path or ""))
        elif not engine.remove_lora(name):
            raise RequestError(f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        return None, _lora_adapters(engine)
    except ValueError as exc:    # LoRAAdapterError names its param; sent as a RequestError (it pickles)
        return RequestError(str(exc), getattr(exc, "param", "lora_path"),
                            getattr(exc, "code", None) or "invalid_value"), None


def engine_main(conn: Any, factory_path: str, engine_kwargs: dict[str, Any], parent_pid: int,
                log_level: int) -> None:
    """The spawn target: build the engine, report ("ready", EngineInfo) or ("failed", traceback),
    then serve commands until told to stop or the server goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    log = logging.getLogger("tokenmill.engine_process")
    try:
        from .config import EngineConfig
        factory = resolve_factory(factory_path)
        engine = factory(EngineConfig.from_kwargs(**engine_kwargs))
        info = _engine_info(engine)
    except BaseException:
        try:
            conn.send(("failed", traceback.format_exc()))
        except Exception:
            pass
        return
    conn.send(("ready", info))
    try:
        run_engine_loop(engine, conn, parent_pid, log)
    except (EOFError, OSError):
        pass   # the server went away (BrokenPipeError is an OSError)
    except BaseException:
        tb = traceback.format_exc()
        log.error("engine loop failed:\n%s", tb)
        try:
            conn.send([("fatal", tb)])
        except Exception:
            pass
    finally:
        try:
            conn.close()
        except Exception:
            pass
        executor = getattr(engine, "executor", None)
        if executor is not None:      # tp/pp workers end with the engine, never left behind
            executor.shutdown()


def _refusal(exc: Exception, log: logging.Logger, request_id: str) -> Exception:
    """The exception to send back for a refused add: a RequestError as it is; anything else is
    an engine bug, logged here and sent as a RuntimeError if it cannot be pickled."""
    if isinstance(exc, RequestError):
        return exc
    if not isinstance(exc, ValueError):
        log.exception("add_request(%s) failed", request_id)
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def run_engine_loop(engine: Any, conn: Any, parent_pid: int, log: logging.Logger) -> None:
    """Drain commands, step, send; returns on a shutdown command or when the parent is gone."""
    num_added = 0           # adds processed, so the client can tell which ones the stats include
    last_parent_check = time.monotonic()
    while True:
        got_commands = False
        if conn.poll(0 if engine.has_unfinished_requests() else 0.5):
            got_commands = True
            commands: list[tuple] = []
            while True:       # everything waiting, so a burst of adds is scheduled in one step
                commands.extend(conn.recv())     # EOFError when the server is gone
                if not conn.poll(0):
                    break
            replies: list[tuple] = []
            for cmd in commands:
                op = cmd[0]
                if op == "add":
                    # One add command is one HTTP request (all its prompts): one group for fair scheduling.
                    group_id = cmd[1][0][0] if cmd[1] else None
                    for request_id, prompt, params, priority in cmd[1]:
                        num_added += 1
                        # The server names a request's LoRA adapter in its prompt dict (served_names.py).
                        lora = prompt.pop("lora_request", None) if isinstance(prompt, dict) else None
                        try:
                            # OpenAI refuses a max_tokens that cannot fit; offline callers get it capped.
                            engine.add_request(request_id, prompt, params, priority=priority,
                                               max_tokens_must_fit=True, group_id=group_id,
                                               **({"lora_request": lora} if lora is not None else {}))
                        except Exception as exc:
                            replies.append(("error", request_id, _refusal(exc, log, request_id)))
                elif op == "abort":
                    engine.abort_request(cmd[1])    # unknown (already finished) ids are ignored
                elif op == "ping":
                    replies.append(("pong", cmd[1]))
                elif op in ("load_lora", "unload_lora"):     # answered once: ("reply", call id, (error, result))
                    replies.append(("reply", cmd[1], lora_command(engine, op, *cmd[2:])))
                elif op == "shutdown":
                    return
            if replies:   # before this step's outputs: a refused request fails before its siblings stream
                conn.send(replies)
        now = time.monotonic()
        if now - last_parent_check > 1.0:
            last_parent_check = now
            if os.getppid() != parent_pid:
                log.warning("server process is gone; engine process exits")
                return
            executor = getattr(engine, "executor", None)
            if executor is not None:     # a worker that died while idle ends the engine too (EngineDeadError)
                executor.check_health()
        if engine.has_unfinished_requests():
            deltas = engine.step()
            conn.send([("out", deltas, stats_dict(engine), num_added)])
        elif got_commands:   # e.g. after an abort: let the server's gauges see the engine idle
            conn.send([("out", [], stats_dict(engine), num_added)])
