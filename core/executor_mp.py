"""One worker process per rank on this machine (`distributed_executor_backend="mp"`, the default
for tp/pp > 1 without Ray).

Each worker is a program of its own (core/worker_process.py), never a multiprocessing spawn child,
which would import the user's main module again: a script that builds an LLM at module level works
without `if __name__ == "__main__":`, as it does with vLLM. The engine process talks to each worker
over its own pipe (commands in, results from one rank out); the ranks talk to each other only
through torch.distributed (gloo on CPU, the platform's backend elsewhere), rendezvousing at
tcp://127.0.0.1:<free port>. Every wait also watches every worker's process sentinel (a pidfd), so
a worker that dies mid-step ends the step with EngineDeadError instead of a hang on a collective
that will never complete, and one that fails to start is named with its traceback, or its exit code
and the end of its stderr.
"""
from __future__ import annotations

import atexit
import logging
import pickle
import time
import weakref
from multiprocessing.connection import wait as wait_connections

from . import distributed
from .config import EngineConfig
from .executor_base import EngineDeadError, Executor
from .step import StepInputs, StepOutput
from .worker import WorkerReady, WorkerSpec
from .worker_process import WorkerProcess, describe_exit

logger = logging.getLogger("tokenmill.executor")

STARTUP_TIMEOUT_S = 600.0

# A script's LLM is rarely shut down by hand: its workers are ended politely at exit, not by their
# PR_SET_PDEATHSIG once the interpreter is gone. Weak: the set must not keep an executor alive.
_live: "weakref.WeakSet[MultiprocExecutor]" = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    for executor in list(_live):
        executor.shutdown()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.world_size = world = tp * pp
        self.result_rank = (pp - 1) * tp          # first tp rank of the last stage
        init_method = f"tcp://127.0.0.1:{distributed.free_port()}"
        self.workers: list[WorkerProcess] = []
        self._closed = False
        level = logging.getLogger().level
        try:
            for rank in range(world):
                spec = WorkerSpec(config=config, rank=rank, local_rank=rank, init_method=init_method,
                                  local_world_size=world)
                message = pickle.dumps((spec, level), protocol=pickle.HIGHEST_PROTOCOL)
                self.workers.append(WorkerProcess(rank, message))
            self.conns = [w.conn for w in self.workers]
            readies = self._wait_ready()
        except BaseException:
            self.shutdown(graceful=False)
            raise
        _live.add(self)
        self.readies: list[WorkerReady] = readies
        # The runners agreed on the pool (min over ranks) before allocating it.
        self.num_blocks = min(r.num_blocks for r in readies)
        self.bytes_per_block = readies[0].bytes_per_block
        self.kv_cache_dtype = readies[0].kv_cache_dtype
        self.kv_layout = readies[0].kv_layout
        logger.info("%d workers (tp %d x pp %d, mp): pids %s, KV %d blocks per rank", world, tp, pp,
                    [r.pid for r in readies], self.num_blocks)

    def _sentinels(self) -> list[int]:
        return [w.sentinel for w in self.workers if w.sentinel is not None]

    def _wait_ready(self) -> list[WorkerReady]:
        """Every rank's WorkerReady. The first rank that fails or exits ends the start-up."""
        readies: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(readies) < self.world_size:
            waiting = [w for w in self.workers if w.rank not in readies]
            ready = wait_connections([w.conn for w in waiting] + self._sentinels(),
                                     timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise EngineDeadError(f"worker rank(s) {[w.rank for w in waiting]} did not start within "
                                      f"{STARTUP_TIMEOUT_S:.0f} s")
            for w in waiting:
                if w.conn not in ready:
                    continue
                try:
                    kind, payload = w.conn.recv()
                except (EOFError, OSError):
                    w.pipe_closed = True        # it is exiting: its exit code is worth a wait
                    raise self._start_failed({}) from None
                if kind != "ready":
                    raise self._start_failed({w.rank: payload})
                readies[w.rank] = payload
            if any(s in ready for s in self._sentinels()):
                raise self._start_failed({})
        return [readies[rank] for rank in range(self.world_size)]

    def _start_failed(self, reported: dict[int, str]) -> Exception:
        """The error for a start-up that failed: the tracebacks the failed ranks sent, or — dead before
        they could say — their exits and the ends of their stderr. Ranks still running are left out:
        they only wait for the failed one in the rendezvous."""
        reported = dict(reported)
        for w in self.workers:
            if w.rank not in reported and (text := w.reported_failure()) is not None:
                reported[w.rank] = text
        exited = {w.rank: why for w in self.workers
                  if w.rank not in reported and (why := w.exit_failure()) is not None}
        reasons = sorted({**reported, **exited}.items())
        text = "\n".join(f"worker rank {rank}: {why}" for rank, why in reasons)
        if reported:      # the worker's own error (a bad checkpoint, an unsupported setting), not a crash
            return RuntimeError(f"worker rank(s) {sorted(reported)} failed to start:\n{text}")
        if exited:
            return EngineDeadError(f"worker rank(s) {sorted(exited)} exited while starting:\n{text}")
        return EngineDeadError("a worker exited while starting, and none says why")

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
        watched = list(self.conns) + self._sentinels()
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

    def _exit_codes(self, wait: float) -> dict[int, int]:
        """{rank: exit code} of the workers that exited, waiting up to `wait` s for the first (a pipe's
        EOF can come before its process is reaped)."""
        deadline = time.monotonic() + wait
        while True:
            codes = {w.rank: code for w in self.workers if (code := w.exitcode()) is not None}
            if codes or time.monotonic() >= deadline:
                return codes
            time.sleep(0.01)

    def _dead(self, why: str) -> EngineDeadError:
        codes = self._exit_codes(wait=1.0)
        exited = ", ".join(f"rank {rank}: {describe_exit(code)}" for rank, code in codes.items()) or "none"
        logger.error("engine workers failed: %s (exited: %s)", why, exited)
        self.shutdown(graceful=False)       # the others may be stuck in a collective: end them now
        return EngineDeadError(f"{why} (exited: {exited})")

    def check_health(self) -> None:
        if self._closed:
            return
        dead = [w.rank for w in self.workers if w.exitcode() is not None]
        if dead:
            raise self._dead(f"worker rank(s) {dead} exited")

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def shutdown(self, graceful: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        for w in self.workers if graceful else ():
            try:
                w.conn.send_bytes(pickle.dumps(("shutdown",)))
            except Exception:
                pass
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for w in self.workers:
            w.exitcode(wait=max(0.0, deadline - time.monotonic()))
        for w in self.workers:      # stuck in a collective with a dead peer: end it
            if w.exitcode() is None:
                w.kill()
                w.exitcode(wait=2.0)
        for w in self.workers:
            w.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
