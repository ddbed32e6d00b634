"""Cancellation: clients that go away mid-stream or mid-prefill get their requests aborted and KV freed."""
from __future__ import annotations

import asyncio
import os
import time

import httpx
import openai
import pytest

MODEL = "smol"
SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "64",
               "--max-num-batched-tokens", "128", "--kv-cache-memory", str(64 * 1024 * 1024), "--num-threads", "1",
               "--disable-access-log"]


def metrics(server) -> dict[str, float]:
    return server.metrics()


def wait_idle(server, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_50_streams_half_dropped(server):
    before = metrics(server)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    max_tokens = 24

    async def one(i: int) -> tuple[int, bool]:
        drop = i % 2 == 0
        stream = await client.completions.create(
            model=MODEL, prompt=[1000 + 37 * i + k for k in range(12)], max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        chunks = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                chunks += 1
            if drop and chunks >= 2:
                await stream.close()
                return chunks, False
        return chunks, True

    async def main() -> list[tuple[int, bool]]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), 240)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert sum(1 for _, completed in results if completed) == 25
    m = wait_idle(server)
    assert m["num_requests_running"] == 0
    assert m["num_requests_waiting"] == 0
    assert m["kv_cache_usage_perc"] == 0
    assert m["request_aborted_total"] - before["request_aborted_total"] == 25
    assert m["request_success_total[length]"] - before["request_success_total[length]"] == 25


def test_cancel_during_prefill(server):
    """A long prompt is prefilled in chunks of 128 tokens; the client leaves before the first token."""
    before = metrics(server)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            task = asyncio.create_task(c.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": [2000 + (k % 5000) for k in range(900)], "max_tokens": 50, "stream": True}))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:       # wait until the engine has scheduled it
                await asyncio.sleep(0.05)
                m = await asyncio.to_thread(metrics, server)
                if m["num_requests_running"] == 1 or m["kv_cache_usage_perc"] > 0:
                    break
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    m = wait_idle(server)
    assert m["num_requests_running"] == 0 and m["kv_cache_usage_perc"] == 0
    assert m["request_aborted_total"] - before["request_aborted_total"] == 1
    assert m["generation_tokens_total"] - before["generation_tokens_total"] <= 1


def test_non_streaming_client_disconnect(server):
    before = metrics(server)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            task = asyncio.create_task(c.post(server.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 400, "ignore_eos": True}))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                m = await asyncio.to_thread(metrics, server)
                if m["generation_tokens_total"] - before["generation_tokens_total"] >= 3:
                    break
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    m = wait_idle(server)
    assert m["num_requests_running"] == 0 and m["kv_cache_usage_perc"] == 0
    assert m["request_aborted_total"] - before["request_aborted_total"] == 1
    assert m["generation_tokens_total"] - before["generation_tokens_total"] < 400


def test_engine_death_is_503_then_the_server_exits(server):
    """Last in this module: the engine process dies; /health says 503 until the server exits, with status 1
    (no --restart-engine: a supervisor restarts it)."""
    import signal as _signal
    engines = [pid for pid in server.child_pids() if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert engines
    for pid in engines:
        os.kill(pid, _signal.SIGKILL)
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            r = httpx.get(server.url + "/health", timeout=15)
        except httpx.HTTPError:
            continue
        seen.append(r.status_code)
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "engine_dead"
        time.sleep(0.05)
    assert set(seen) <= {200, 503} and seen[-1:] in ([], [503]), seen
    assert server.proc.wait(timeout=30) == 1
