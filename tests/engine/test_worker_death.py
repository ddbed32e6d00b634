"""A tensor-parallel worker (either rank) or the engine process killed mid-generation takes the engine
down cleanly (issue 16 item 1, issue 32 item 2): every request in flight fails with `engine_dead` — the
open stream with an error event before its [DONE], a non-streamed one with a 503 and the error body —
/health turns 503 within 5 s, the server exits, and no process is left behind."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from model_helpers import save_tiny_checkpoint
from process_helpers import children, is_alive, session_members
from tokenmill.entrypoints.openai.testing import ServerProcess

MAX_TOKENS = 240      # with max_model_len 256: both requests are still generating when the kill comes


def _workers(engine_pid: int) -> dict[int, int]:
    """{rank: pid} of the engine's workers (`python -m tokenmill.core.worker_process FD PARENT RANK`)."""
    ranks = {}
    for pid in children(engine_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")[:-1]
        except OSError:
            continue
        if "tokenmill.core.worker_process" in argv:
            ranks[int(argv[-1])] = pid
    return ranks


@pytest.mark.parametrize("victim", ["rank0", "rank1", "engine"])
def test_killed_process_fails_every_request_in_flight(tmp_path, victim):
    path = str(tmp_path / "llama")
    save_tiny_checkpoint("llama", path)
    args = [path, "-tp", "2", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", str(1 << 24),
            "--served-model-name", "tiny", "--disable-access-log"]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}) as server:
        # The engine process is the server's child with children: its two workers (besides
        # multiprocessing's resource tracker, also a child of the server).
        engine_pid = max(server.child_pids(), key=lambda pid: len(children(pid)))
        workers = _workers(engine_pid)
        assert sorted(workers) == [0, 1], (workers, server.log()[-3000:])
        body = {"model": "tiny", "prompt": "w7 w8 w9", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        events: list = []           # the stream's: "chunk", the error object, "[DONE]"
        answered: dict = {}

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        events.append("[DONE]")
                    elif line.startswith("data: "):
                        obj = json.loads(line[6:])
                        events.append(obj["error"] if "error" in obj else "chunk")

        def plain() -> None:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            answered.update(status=r.status_code, body=r.json())

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.metrics().get("num_requests_running", 0) < 2:
            time.sleep(0.02)
        assert "chunk" in events and not answered, (events, answered, server.log()[-3000:])
        os.kill(engine_pid if victim == "engine" else workers[int(victim[-1])], signal.SIGKILL)
        killed = time.monotonic()
        status = None
        while time.monotonic() - killed < 5.0:
            try:
                status = httpx.get(server.url + "/health", timeout=2).status_code
            except httpx.HTTPError as exc:    # already exiting
                status = repr(exc)
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503, server.log()[-3000:]
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        # The cut stream says so before it ends; the non-streamed request is a 503 in OpenAI's shape.
        assert events[-1] == "[DONE]" and isinstance(events[-2], dict), events
        assert events[-2]["code"] == "engine_dead" and events[-2]["type"] == "server_error", events
        assert events.count("chunk") < MAX_TOKENS
        assert answered["status"] == 503, answered
        assert answered["body"]["error"]["code"] == "engine_dead", answered
        # The surviving workers (stuck in a collective with a dead peer, or orphaned) were ended.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(is_alive, workers.values())):
            time.sleep(0.1)
        assert not [p for p in workers.values() if is_alive(p)]
        assert server.proc.wait(timeout=30) == 1      # no --restart-engine: the server exits, non-zero
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and session_members(server.proc.pid):
        time.sleep(0.1)
    assert session_members(server.proc.pid) == [], "processes of the server's session are left"
