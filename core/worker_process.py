"""One rank's process for the mp executor (core/executor_mp.py), both ends: `WorkerProcess` starts it
and holds it; `main` is the program it runs: `python -m tokenmill.core.worker_process FD PARENT_PID RANK`.

Why a program of its own rather than multiprocessing's spawn: spawn starts each child by importing the
parent's main module again (as __mp_main__), so a plain script that builds `LLM(..., tensor_parallel_size=2)`
at module level, without `if __name__ == "__main__":`, built another LLM in every worker. Here the child
runs this module and nothing else; the parent's sys.path comes over the pipe, as spawn would send it.

    engine process (WorkerProcess)                        worker (main, then worker.worker_main)
    socketpair end ──── sys.path, then (WorkerSpec, log level) ────►  the other end, fd FD
                   ◄─── ("ready", WorkerReady) | ("failed", traceback), then worker_main's protocol
    pidfd: readable once the worker exited (the sentinel the executor waits on beside the pipes)
    the worker's stderr: copied to ours line by line; its tail kept for the error when the worker
    dies before it could say why (an import that fails, a crash in native code)

Nothing here imports torch at module level: the child sets up sys.path and PR_SET_PDEATHSIG first.
"""
from __future__ import annotations

import collections
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Optional

STDERR_TAIL_LINES = 20


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def worker_command(fd: int, rank: int) -> list[str]:
    """This module as a program, with the interpreter flags (-X, -W, -I...) multiprocessing would pass on;
    the rank is there for `ps`, `main` does not read it."""
    return [sys.executable, *subprocess._args_from_interpreter_flags(), "-m", __name__,
            str(fd), str(os.getpid()), str(rank)]


class WorkerProcess:
    """One started worker: `conn` (its pipe), `sentinel` (its pidfd, or None where the OS has none: the
    pipe's EOF then tells its exit), its exit code once it exited, and why it failed to start."""

    def __init__(self, rank: int, spec_message: bytes) -> None:
        self.rank = rank
        ours, theirs = socket.socketpair()
        with theirs:
            try:
                self.proc = subprocess.Popen(worker_command(theirs.fileno(), rank), pass_fds=(theirs.fileno(),),
                                             stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
            except BaseException:
                ours.close()
                raise
        self.pid = self.proc.pid
        self.conn = Connection(ours.detach())
        self.pipe_closed = False
        # Opened before anything reaps it, so it is this child's (a zombie at worst), never a reused pid.
        self.sentinel: Optional[int] = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        self._tail: collections.deque[bytes] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._copier = threading.Thread(target=self._copy_stderr, name=f"tokenmill-worker-{rank}-stderr",
                                        daemon=True)
        self._copier.start()
        try:
            self.conn.send(sys.path)
            self.conn.send_bytes(spec_message)
        except OSError:
            pass     # it exited already: its sentinel (or its pipe's EOF) says so

    def _copy_stderr(self) -> None:
        # To fd 2 itself, where the worker's log went when it inherited our stderr: no Python-level
        # stream lock, so this thread can never stall our interpreter's exit.
        stream = self.proc.stderr
        assert stream is not None
        for line in iter(stream.readline, b""):
            self._tail.append(line)
            try:
                os.write(2, line)
            except OSError:
                pass
        stream.close()

    def exitcode(self, wait: float = 0.0) -> Optional[int]:
        """Its exit code (negative: the signal that ended it), or None while it runs (after `wait` s)."""
        try:
            return self.proc.wait(wait) if wait > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def reported_failure(self) -> Optional[str]:
        """The traceback it sent in place of "ready", if one waits on its pipe."""
        try:
            if self.conn.poll(0):
                kind, payload = self.conn.recv()
                if kind == "failed":
                    return str(payload)
        except (EOFError, OSError):
            self.pipe_closed = True     # it is exiting, if not gone already
        return None

    def exit_failure(self) -> Optional[str]:
        """Its exit and the end of its stderr, once it exited (None while it runs): why it failed to
        start when it could not say (an import that failed, a crash in native code)."""
        code = self.exitcode(wait=2.0 if self.pipe_closed or self.sentinel is None else 0.2)
        if code is None:
            return "its pipe closed" if self.pipe_closed else None
        self._copier.join(1.0)        # the rest of its stderr
        tail = b"".join(self._tail).decode(errors="replace").rstrip()
        return describe_exit(code) + (f"; the end of its stderr:\n{tail}" if tail else "; nothing on its stderr")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        for close in (self.conn.close, lambda: self.sentinel is not None and os.close(self.sentinel)):
            try:
                close()
            except OSError:
                pass
        self.sentinel = None
        self._copier.join(0.5)        # done once the worker (and whatever it started) closed its stderr


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[0]), int(argv[1])
    from .engine_process import _die_with_parent
    _die_with_parent()
    if os.getppid() != parent_pid:     # the engine died before PR_SET_PDEATHSIG was set
        return 1
    conn = Connection(fd)
    try:
        sys.path[:] = conn.recv()      # the parent's, as spawn would set it: its plugins, its script's folder
        from .worker import worker_main
        spec, log_level = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return 1         # the engine is gone
    except BaseException:
        _report(conn, traceback.format_exc())
        return 1
    return worker_main(conn, spec, log_level)


def _report(conn: Any, text: str) -> None:
    try:
        conn.send_bytes(pickle.dumps(("failed", text)))
    except OSError:
        pass


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # As multiprocessing's children end: no interpreter teardown (torch's takes seconds), nothing left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
