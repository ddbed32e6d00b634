"""Batch jobs (issue 12, item 4): `tokenmill run-batch` and the online /v1/files + /v1/batches, driven by the
official openai SDK against `tokenmill serve`. 200 short greedy lines through either give the results of the
same requests sent one by one; a server killed (SIGKILL) mid-batch and restarted on the same --batch-dir
finishes the job with every custom_id exactly once; cancel; errors as the SDK's exception classes.

One server on the default model (the `server` fixture; TOKENMILL_TEST_FAKE_ENGINE=1: the fake engine); the
kill test, last, kills and restarts that same server.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import FAKE_ENGINE

KEY = "batch-key"
MODEL = "smol"
BATCH_DIR = tempfile.mkdtemp(prefix="tokenmill-batches-")
# float32: greedy tokens that do not depend on what shares the batch (bf16 rounding does: 14 of these 200
# lines differed between max_num_seqs 1 and 8 in bf16)
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL, "--max-model-len", "512",
               "--max-num-seqs", "8", "--num-threads", "1", "--kv-cache-memory", str(64 * 1024 * 1024)]
SERVER_ARGS = ENGINE_ARGS + ["--api-key", KEY, "--batch-dir", BATCH_DIR, "--disable-access-log"]
N = 200


def _line(i: int) -> dict:
    if i % 2:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": 4,
                "temperature": 0}
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    body = {"model": MODEL, "prompt": f"The number {i} is", "max_tokens": 4, "temperature": 0}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}


LINES = [_line(i) for i in range(N)]


def _text(url: str, body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if url == "/v1/chat/completions" else choice["text"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def singles(client) -> dict[str, str]:
    """Each line's request sent on its own (8 at a time: in float32 a request's greedy tokens do
    not depend on what shares its batch): custom_id → the generated text."""
    def one(line: dict) -> tuple[str, str]:
        if line["url"] == "/v1/chat/completions":
            return line["custom_id"], client.chat.completions.create(**line["body"]).choices[0].message.content
        return line["custom_id"], client.completions.create(**line["body"]).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        return dict(pool.map(one, LINES))


def _batch_file(tmp_path, lines: list, extra: list[str] = ()) -> str:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "".join(e + "\n" for e in extra))
    return str(path)


def _wait(client, batch_id: str, until=("completed", "failed", "cancelled"), timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} is still {b.status}")


def _records(client, file_id) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def test_run_batch_equals_singles(tmp_path, singles):
    bad = ["{not json", json.dumps({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings",
                                    "body": {"model": MODEL, "input": "hi"}}),
           json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/nope", "body": {}}),
           json.dumps({"custom_id": "body", "method": "POST", "url": "/v1/chat/completions", "body": {"model": MODEL}})]
    src, dst = _batch_file(tmp_path, LINES, bad), tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "run-batch", "-i", src, "-o", str(dst), *ENGINE_ARGS]
    if FAKE_ENGINE:
        cmd += ["--engine-factory", "tokenmill.entrypoints.openai.testing:FakeEngine"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run-batch" in done.stderr and "100%" in done.stderr      # the progress bar
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(out) == N + len(bad)
    for line, rec in zip(LINES, out):     # input order
        assert rec["custom_id"] == line["custom_id"] and rec["error"] is None and rec["id"].startswith("batch_req_")
        assert rec["response"]["status_code"] == 200 and rec["response"]["request_id"]
        assert _text(line["url"], rec["response"]["body"]) == singles[line["custom_id"]], line["custom_id"]
    by_id = {r["custom_id"]: r for r in out[N:]}
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["response"] is None
    # a generating model: the embeddings route refuses the line (tests/server/test_server_embeddings.py runs them)
    emb = by_id["emb"]["response"]
    assert emb["status_code"] == 400 and emb["body"]["error"]["code"] == "model_not_supported"
    assert by_id["url"]["error"]["code"] == "invalid_url"
    assert by_id["body"]["response"]["status_code"] == 400
    assert by_id["body"]["response"]["body"]["error"]["param"] == "messages"


def test_batches_api_equals_singles(tmp_path, client, singles):
    with open(_batch_file(tmp_path, LINES), "rb") as fh:
        f = client.files.create(file=fh, purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes > 0
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).text.count("\n") == N
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status in ("validating", "in_progress") and b.input_file_id == f.id
    b = _wait(client, b.id)
    assert b.status == "completed", b
    assert b.request_counts.total == N and b.request_counts.completed == N // 2
    # the completions lines do not match the batch's endpoint: each one is an error line, not a crash
    assert b.request_counts.failed == N // 2 and b.error_file_id and b.output_file_id
    assert b.completed_at and b.in_progress_at
    out = _records(client, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(x["custom_id"] for x in LINES if "messages" in x["body"])
    for rec in out:
        assert rec["response"]["status_code"] == 200
        assert rec["response"]["body"]["choices"][0]["message"]["content"] == singles[rec["custom_id"]]
    errs = _records(client, b.error_file_id)
    assert len(errs) == N // 2 and all(e["error"]["code"] == "mismatched_endpoint" for e in errs)
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    assert b.id in [x.id for x in client.batches.list(limit=100)]

    with open(_batch_file(tmp_path, [x for x in LINES if x["url"] == "/v1/completions"]), "rb") as fh:
        f2 = client.files.create(file=fh, purpose="batch")
    b2 = _wait(client, client.batches.create(input_file_id=f2.id, endpoint="/v1/completions",
                                             completion_window="24h").id)
    assert b2.status == "completed" and b2.request_counts.completed == N // 2 and b2.error_file_id is None
    for rec in _records(client, b2.output_file_id):
        assert rec["response"]["body"]["choices"][0]["text"] == singles[rec["custom_id"]]


def test_errors_are_the_sdks_exceptions(tmp_path, server, client):
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.files.delete("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch-nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch-nope")
    with pytest.raises(openai.NotFoundError) as exc:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    assert exc.value.body["param"] == "input_file_id"
    with open(_batch_file(tmp_path, LINES[:2]), "rb") as fh:
        with pytest.raises(openai.BadRequestError) as exc:
            client.files.create(file=fh, purpose="fine-tune")
    assert exc.value.body["param"] == "purpose"
    with open(_batch_file(tmp_path, LINES[:2]), "rb") as fh:
        f = client.files.create(file=fh, purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=f.id, endpoint="/v1/images", completion_window="24h")
    assert exc.value.body["param"] == "endpoint"
    # duplicate custom_ids: the batch fails, with the line named
    with open(_batch_file(tmp_path, [LINES[0], LINES[0]]), "rb") as fh:
        dup = client.files.create(file=fh, purpose="batch")
    b = _wait(client, client.batches.create(input_file_id=dup.id, endpoint="/v1/completions",
                                            completion_window="24h").id)
    assert b.status == "failed" and b.errors.data[0].code == "duplicate_custom_id" and b.errors.data[0].line == 2
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).batches.list()
    assert httpx.get(server.url + "/openapi.json").status_code == 401     # behind the key, as /v1 is
    paths = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
    for p in ("/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
              "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel"):
        assert p in paths


def test_cancel(tmp_path, client):
    with open(_batch_file(tmp_path, LINES), "rb") as fh:
        f = client.files.create(file=fh, purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    _wait(client, b.id, until=("in_progress",))
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled") and c.cancelling_at
    b = _wait(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    counts = b.request_counts
    assert counts.completed + counts.failed < N
    done = _records(client, b.output_file_id) if b.output_file_id else []
    done += _records(client, b.error_file_id) if b.error_file_id else []
    assert len(done) == counts.completed + counts.failed
    assert len({r["custom_id"] for r in done}) == len(done)


def test_kill_mid_batch_and_resume(tmp_path, server, client, singles):
    """Last: SIGKILL the server mid-batch, start it again on the same --batch-dir."""
    lines = [x for x in LINES if x["url"] == "/v1/completions"]
    with open(_batch_file(tmp_path, lines), "rb") as fh:
        f = client.files.create(file=fh, purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while client.batches.retrieve(b.id).request_counts.completed < 10:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)
    before = json.load(open(os.path.join(BATCH_DIR, "batches", b.id + ".json")))["batch"]
    assert before["status"] == "in_progress" and 10 <= before["request_counts"]["completed"] < len(lines)
    server.start()
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    b = _wait(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == len(lines) and not b.request_counts.failed
    out = _records(client, b.output_file_id)
    assert Counter(r["custom_id"] for r in out) == Counter(x["custom_id"] for x in lines)
    for rec in out:
        assert rec["response"]["body"]["choices"][0]["text"] == singles[rec["custom_id"]]
