"""Several base models behind one port (`tokenmill serve --models models.yaml`, issue 14 item 4): the default
model (SmolLM2 GGUF) and a tiny random llama, each in its own engine process, routed by `model`, through the
official `openai` SDK; POST /v1/models/load and /unload at run time; killing one model's engine process makes
only that model's requests fail (503) while the other keeps serving."""
from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from model_helpers import save_tiny_checkpoint
from tokenmill.core.loaders.model_source import default_model_path
from tokenmill.entrypoints.openai.testing import ServerProcess

KEY = "multi-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dir):
    config = tmp_path_factory.mktemp("config") / "models.yaml"
    config.write_text(f"""
models:
  - name: smol
    model: {default_model_path()}
    kv_cache_share: 3
    max_model_len: 512
  - name: tiny
    path: {tiny_dir}
    max_model_len: 128
    max_num_seqs: 4
""")
    args = ["--models", str(config), "--kv-cache-memory", str(16 * 2**20), "--api-key", KEY, "--disable-access-log"]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}, startup_timeout=180) as srv:
        yield srv


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def engine_pids(server: ServerProcess) -> list[int]:
    """The engine processes (spawned children, not multiprocessing's resource tracker), oldest first."""
    pids = []
    for pid in server.child_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return sorted(pids)


def test_both_models_listed_and_served_through_the_sdk(server):
    c = client(server)
    assert [m.id for m in c.models.list()] == ["smol", "tiny"]
    assert c.models.retrieve("tiny").id == "tiny"
    chat = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4,
                                     temperature=0)
    assert chat.model == "smol" and chat.usage.completion_tokens > 0
    tiny = c.completions.create(model="tiny", prompt="w10 w11 w12", max_tokens=5, temperature=0)
    assert tiny.model == "tiny" and tiny.usage.completion_tokens == 5 and tiny.usage.prompt_tokens == 3
    # Each model answers with its own tokenizer: the tiny one's word-level vocabulary is w0..w999.
    assert all(w.startswith("w") for w in tiny.choices[0].text.split())
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="nope", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    stream = c.completions.create(model="tiny", prompt="w20 w21", max_tokens=3, stream=True, temperature=0)
    assert sum(len(chunk.choices[0].text.split()) for chunk in stream if chunk.choices) == 3
    text = httpx.get(server.url + "/metrics").text     # one registry, every model labelled
    assert 'tokenmill:request_success_total{finished_reason="length",model_name="tiny"} 2.0' in text
    assert 'model_name="smol"' in text
    assert "ready" in server.log() and "--num-threads" in server.log()


def kv_blocks(log: str, model: str) -> int:
    """The KV pool the log reports for `model` (at start-up, or when loaded at run time)."""
    import re
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if f"(served as {model})" in line or f"model {model!r} loaded" in line)
    return next(int(re.search(r"KV cache: (\d+) blocks", line).group(1))
                for line in lines[start:] if "KV cache:" in line)


def test_tokenize_routes_by_model_too(server):
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "w7 w8"}, headers=AUTH)
    assert r.json()["tokens"] == [7, 8] and r.json()["max_model_len"] == 128
    r = httpx.post(server.url + "/tokenize", json={"model": "smol", "prompt": "w7 w8"}, headers=AUTH)
    assert r.json()["tokens"] != [7, 8] and r.json()["max_model_len"] == 512


def test_load_and_unload_at_run_time(server, tiny_dir):
    c = client(server)
    r = httpx.post(server.url + "/v1/models/load", json={"name": "tiny2", "path": tiny_dir, "max_model_len": 64})
    assert r.status_code == 401                        # behind the API key
    r = httpx.post(server.url + "/v1/models/load", headers=AUTH, timeout=120,
                   json={"name": "tiny2", "path": tiny_dir, "max_model_len": 64, "kv_cache_memory": "2MiB"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "tiny2" and r.json()["max_model_len"] == 64
    assert [m.id for m in c.models.list()] == ["smol", "tiny", "tiny2"]
    assert c.completions.create(model="tiny2", prompt=[7, 8, 9], max_tokens=2).usage.completion_tokens == 2
    # --kv-cache-memory 16 MiB split 3:1 gave tiny 4 MiB; tiny2 (the same model) asked for 2 MiB.
    assert kv_blocks(server.log(), "tiny") == 2 * kv_blocks(server.log(), "tiny2") > 0
    r = httpx.post(server.url + "/v1/models/load", headers=AUTH, json={"name": "tiny", "path": tiny_dir})
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_exists"
    r = httpx.post(server.url + "/v1/models/load", headers=AUTH, json={"name": "x", "path": tiny_dir, "colour": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "colour" and "colour" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/models/load", headers=AUTH, json={"name": "x", "model": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(server.url + "/v1/models/load", headers=AUTH, timeout=60,
                   json={"name": "x", "path": "/no/such/model"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_load_failed"
    engines = len(engine_pids(server))
    r = httpx.post(server.url + "/v1/models/unload", headers=AUTH, json={"name": "tiny2"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"id": "tiny2", "object": "model", "deleted": True}
    assert [m.id for m in c.models.list()] == ["smol", "tiny"]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="tiny2", prompt=[7], max_tokens=1)
    deadline = time.monotonic() + 10
    while len(engine_pids(server)) != engines - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(engine_pids(server)) == engines - 1     # its engine process is gone
    r = httpx.post(server.url + "/v1/models/unload", headers=AUTH, json={"name": "tiny2"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_one_engine_dying_leaves_the_other_serving(server):
    c = client(server)
    smol_pid, tiny_pid = engine_pids(server)[:2]       # spawned in the file's order
    os.kill(tiny_pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while True:
        health = httpx.get(server.url + "/health", timeout=10)
        if health.json()["models"]["tiny"] == "down" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert health.status_code == 200                   # one model still serves
    assert health.json() == {"status": "degraded", "models": {"smol": "ready", "tiny": "down"}}
    with pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model="tiny", prompt="w10", max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "engine_dead"
    out = c.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    assert server.proc.poll() is None                  # the server did not exit
    assert os.path.exists(f"/proc/{smol_pid}")
