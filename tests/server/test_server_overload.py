"""A full waiting queue answers 503 + Retry-After; a queued request can be cancelled; Ctrl-C is clean."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import openai
import pytest

MODEL = "smol"
SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "512", "--max-num-seqs", "1",
               "--max-waiting-requests", "1", "--kv-cache-memory", str(32 * 1024 * 1024), "--num-threads", "1",
               "--shutdown-timeout", "3"]


def _metric(server, name: str) -> float:
    return server.metrics()[name]


def _wait(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_queue_full_is_503_and_queued_request_cancels(server):
    body = {"model": MODEL, "prompt": [1000 + k for k in range(8)], "max_tokens": 120, "ignore_eos": True,
            "stream": True}

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            running = asyncio.create_task(c.post(server.url + "/v1/completions", json=body))
            assert await asyncio.to_thread(_wait, lambda: _metric(server, "num_requests_running") == 1)
            queued = asyncio.create_task(c.post(server.url + "/v1/completions", json=body))
            assert await asyncio.to_thread(_wait, lambda: _metric(server, "num_requests_waiting") == 1)

            sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.APIStatusError) as e:
                await sdk.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            await sdk.close()
            assert e.value.status_code == 503
            assert e.value.response.headers.get("retry-after")
            assert e.value.body["code"] == "server_overloaded"

            aborted = _metric(server, "request_aborted_total")
            queued.cancel()          # the client gives up while its request is still queued
            assert await asyncio.to_thread(_wait, lambda: _metric(server, "num_requests_waiting") == 0)
            assert await asyncio.to_thread(_wait, lambda: _metric(server, "request_aborted_total") == aborted + 1)
            running.cancel()
            assert await asyncio.to_thread(_wait, lambda: _metric(server, "num_requests_running") == 0
                                           and _metric(server, "kv_cache_usage_perc") == 0)
            for t in (running, queued):
                with pytest.raises(asyncio.CancelledError):
                    await t

    asyncio.run(main())


def test_ctrl_c_shuts_down_cleanly(server):
    children = server.child_pids()
    assert children, "the engine runs in a child process"
    got: dict[str, object] = {}

    def stream() -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400,
                                    "ignore_eos": True, "stream": True}) as r:
                got["status"] = r.status_code
                got["body"] = "".join(r.iter_text())
        except httpx.HTTPError as exc:
            got["error"] = exc

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert _wait(lambda: _metric(server, "num_requests_running") == 1)
    start = time.monotonic()
    code = server.stop(signal.SIGINT, timeout=60)
    assert code == 0, server.log()
    assert time.monotonic() - start < 30
    t.join(30)
    assert not t.is_alive()
    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"   # at most an unreaped zombie
        except FileNotFoundError:
            return True

    # The server has exited; its children (engine, multiprocessing's resource tracker) must follow
    # within a few seconds, not linger as orphans.
    assert _wait(lambda: all(gone(pid) for pid in children), timeout=10), children
    assert "Traceback" not in server.log()
