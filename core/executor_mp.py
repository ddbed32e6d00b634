"""One spawned process per rank on this machine (`distributed_executor_backend="mp"`, the default
for tp/pp > 1 without Ray).

The engine process talks to each worker over its own multiprocessing pipe (commands in, results
from one rank out); the ranks talk to each other only through torch.distributed (gloo on CPU,
the platform's backend elsewhere), rendezvousing at tcp://127.0.0.1:<free port>. Every wait
also watches every worker's process sentinel, so a worker that dies mid-step ends the step with
EngineDeadError instead of a hang on a collective that will never complete.
"""
from __future__ import annotations

import logging
import multiprocessing
import pickle
import time
from multiprocessing.connection import wait as wait_connections
from typing import Any

from . import distributed
from .config import EngineConfig
from .executor_base import EngineDeadError, Executor
from .step_inputs import StepInputs, StepOutput
from .worker import WorkerReady, WorkerSpec, worker_main

logger = logging.getLogger("tokenmill.executor")

STARTUP_TIMEOUT_S = 600.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.world_size = world = tp * pp
        self.result_rank = (pp - 1) * tp          # first tp rank of the last stage
        init_method = f"tcp://127.0.0.1:{distributed.free_port()}"
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._closed = False
        me = multiprocessing.current_process()
        # The server's engine process is itself a daemonic child; multiprocessing refuses children
        # of a daemon only to avoid orphans, which PR_SET_PDEATHSIG (worker_main) already prevents.
        was_daemon = me._config.get("daemon", False)
        me._config["daemon"] = False
        try:
            for rank in range(world):
                parent_conn, child_conn = ctx.Pipe()
                spec = WorkerSpec(config=config, rank=rank, local_rank=rank, init_method=init_method,
                                  local_world_size=world)
                proc = ctx.Process(target=worker_main, args=(child_conn, spec, logging.getLogger().level),
                                   name=f"tokenmill-worker-{rank}", daemon=True)
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
        finally:
            me._config["daemon"] = was_daemon
        try:
            readies = [self._wait_ready(rank) for rank in range(world)]
        except BaseException:
            self.shutdown()
            raise
        self.readies: list[WorkerReady] = readies
        # The runners agreed on the pool (min over ranks) before allocating it.
        self.num_blocks = min(r.num_blocks for r in readies)
        self.bytes_per_block = readies[0].bytes_per_block
        self.kv_cache_dtype = readies[0].kv_cache_dtype
        logger.info("%d workers (tp %d x pp %d, mp): pids %s, KV %d blocks per rank", world, tp, pp,
                    [r.pid for r in readies], self.num_blocks)

    def _wait_ready(self, rank: int) -> WorkerReady:
        conn = self.conns[rank]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            ready = wait_connections([conn] + [p.sentinel for p in self.procs],
                                     timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise EngineDeadError(f"worker rank {rank} did not start within {STARTUP_TIMEOUT_S:.0f} s")
            if conn in ready:
                kind, payload = conn.recv()
                if kind == "failed":
                    raise RuntimeError(f"worker rank {rank} failed to start:\n{payload}")
                return payload
            dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
            raise EngineDeadError(f"worker rank(s) {dead} exited while starting "
                                  f"(exit codes {[self.procs[i].exitcode for i in dead]})")

    def execute_inputs(self, inputs: StepInputs) -> StepOutput:
        if self._closed:
            raise EngineDeadError("the engine's workers are shut down")
        message = pickle.dumps(("execute", inputs), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(message)
        except OSError as exc:
            raise self._dead(f"cannot reach a worker ({exc})") from None
        result_conn = self.conns[self.result_rank]
        watched = list(self.conns) + [p.sentinel for p in self.procs]
        while True:
            ready = wait_connections(watched)
            if result_conn in ready:
                try:
                    kind, payload = result_conn.recv()
                except (EOFError, OSError):
                    raise self._dead(f"worker rank {self.result_rank} closed its pipe") from None
                if kind == "out":
                    return payload
                raise self._dead(f"worker rank {self.result_rank} failed:\n{payload}")
            for rank, conn in enumerate(self.conns):
                if conn in ready:           # only the result rank speaks during a step: a failure
                    try:
                        _, payload = conn.recv()
                    except (EOFError, OSError):
                        payload = "its pipe closed"
                    raise self._dead(f"worker rank {rank} failed: {payload}")
            raise self._dead("a worker process exited")

    def _dead(self, why: str) -> EngineDeadError:
        codes = {i: p.exitcode for i, p in enumerate(self.procs) if p.exitcode is not None}
        logger.error("engine workers failed: %s (exited: %s)", why, codes or "none")
        self.shutdown(graceful=False)       # the others may be stuck in a collective: end them now
        return EngineDeadError(f"{why} (worker exit codes {codes})")

    def check_health(self) -> None:
        if self._closed:
            return
        dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            raise self._dead(f"worker rank(s) {dead} exited")

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self, graceful: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self.conns if graceful else ():
            try:
                conn.send_bytes(pickle.dumps(("shutdown",)))
            except Exception:
                pass
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:      # stuck in a collective with a dead peer: end it
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            try:
                conn.close()
            except Exception:
                pass

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
