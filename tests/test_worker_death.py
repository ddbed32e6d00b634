"""A tensor-parallel worker killed mid-stream takes the engine down cleanly (issue 16 item 1): the
stream ends with an error event, /health turns 503 within 5 s, and no process is left behind."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from model_helpers import save_tiny_checkpoint
from process_helpers import children, session_members
from tokenmill.entrypoints.openai.testing import ServerProcess


def test_killed_worker_ends_stream_with_error_and_health_503(tmp_path):
    path = str(tmp_path / "llama")
    save_tiny_checkpoint("llama", path)
    args = [path, "-tp", "2", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", str(1 << 24),
            "--served-model-name", "tiny", "--disable-access-log"]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}) as server:
        # The engine process is the server's child with children: its two workers (besides
        # multiprocessing's resource tracker, also a child of the server).
        engines = {pid: children(pid) for pid in server.child_pids()}
        engine_pid, workers = max(engines.items(), key=lambda item: len(item[1]))
        workers = [p for p in workers if "tokenmill" in open(f"/proc/{p}/cmdline").read()
                   or "multiprocessing" in open(f"/proc/{p}/cmdline").read()]
        assert len(workers) >= 2, engines
        seen = {"chunks": 0, "error": None, "done": False}
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "w7 w8 w9", "max_tokens": 240, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        seen["done"] = True
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        seen["error"] = obj["error"]
                    elif obj.get("choices"):
                        seen["chunks"] += 1
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60), (seen, server.log()[-3000:])
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        status = None
        while time.monotonic() - killed < 5.0:
            status = httpx.get(server.url + "/health", timeout=2).status_code
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503, server.log()[-3000:]
        reader.join(30)
        assert not reader.is_alive()
        assert seen["error"] is not None and seen["chunks"] < 240, seen
        # The surviving worker (stuck in a collective with its dead peer) was ended, not left behind.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and p in children(engine_pid)
                                                  for p in workers):
            time.sleep(0.1)
        assert not [p for p in workers if p in children(engine_pid)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and session_members(server.proc.pid):
        time.sleep(0.1)
    assert session_members(server.proc.pid) == [], "processes of the server's session are left"
