"""Probes that mean what they say, and vLLM's command line (issue 12, items 5 and 6).

One `tokenmill serve` on the fake engine, whose "model load" takes a few seconds
(TOKENMILL_FAKE_LOAD_S), started the way a vLLM user types it: `serve --model X` with
--enable-chunked-prefill, --chat-template FILE, --generation-config FOLDER, --trust-remote-code and
-tp 1. /health/live answers at once; /health/ready is 503 while the model loads, 200 once it can
serve, 503 again after the engine process is killed, and then the server exits non-zero (the last
test). The tests run in file order.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tokenmill.core.loaders.model_source import resolve_model_source
from tokenmill.entrypoints.openai.serving import default_served_name
from tokenmill.entrypoints.openai.testing import ServerProcess

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
MODEL_PATH = resolve_model_source(None).path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-flags")
    (tmp / "template.jinja").write_text(TEMPLATE)
    (tmp / "gen").mkdir()
    (tmp / "gen" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    args = ["--model", MODEL_PATH, "--device", "cpu", "--max-model-len", "1024", "--enable-chunked-prefill",
            "--chat-template", str(tmp / "template.jinja"), "--generation-config", str(tmp / "gen"),
            "--trust-remote-code", "-tp", "1", "--disable-access-log"]
    with ServerProcess(args, env={"TOKENMILL_FAKE_LOAD_S": "6", "TOKENMILL_FAKE_STEP_S": "0.001"},
                       fake_engine=True, wait_for="/health/live") as srv:
        yield srv


def _wait_ready(server, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/health/ready", timeout=10).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError("never ready:\n" + server.log())


# ---------------------------------------------------------------- probes
def test_ready_is_503_while_the_model_loads(server):
    assert httpx.get(server.url + "/health/live").json() == {"status": "alive"}
    r = httpx.get(server.url + "/health/ready")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "model_loading"
    # the routes that need the engine say the same, in the error contract
    with pytest.raises(openai.InternalServerError) as e:
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).models.list()
    assert e.value.status_code == 503 and e.value.body["code"] == "model_loading"
    _wait_ready(server)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health/live").status_code == 200


def test_models_list_names_and_max_model_len(server):
    _wait_ready(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    models = client.models.list().data
    # the default served name drops the GGUF quantization suffix (SmolLM2-135M-Instruct.Q4_1.gguf)
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].model_extra["max_model_len"] == 1024
    assert client.models.retrieve("SmolLM2-135M-Instruct").model_extra["max_model_len"] == 1024


def test_chat_template_file_and_generation_config_folder(server):
    _wait_ready(server)
    messages = [{"role": "user", "content": "Hi there"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "return_token_strs": True})
    assert r.status_code == 200
    from transformers import AutoTokenizer   # the text the --chat-template FILE renders
    tok = AutoTokenizer.from_pretrained(os.path.dirname(MODEL_PATH), gguf_file=os.path.basename(MODEL_PATH))
    assert r.json()["tokens"] == tok.encode("<<user>>Hi there\n<<assistant>>", add_special_tokens=False)
    # max_new_tokens from the folder's generation_config.json: the default for a request that sets none
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time")
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"   # not the default 16
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=5)
    assert out.usage.completion_tokens == 5


def test_openapi_lists_every_route(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for route in ("/health/live", "/health/ready", "/v1/models", "/v1/chat/completions", "/v1/messages",
                  "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{response_id}"):
        assert route in paths, route


def test_ready_is_503_once_the_engine_process_is_dead_then_the_server_exits(server):
    _wait_ready(server)
    for pid in server.child_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():      # the engine process (not multiprocessing's resource tracker)
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    status = None
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            r = httpx.get(server.url + "/health/ready", timeout=10)
        except httpx.HTTPError:
            continue          # exiting
        status = r.status_code
        if status == 503:
            assert r.json()["error"]["code"] == "engine_dead"
            break
        time.sleep(0.05)
    assert status in (503, None)
    # without --restart-engine the server exits non-zero, for a supervisor to restart it
    assert server.proc.wait(timeout=30) != 0


# ---------------------------------------------------------------- the command line alone
def test_unknown_flag_is_an_error_under_the_serve_usage_naming_the_closest_flag():
    done = _cli("serve", "--max-model-length", "512")
    assert done.returncode == 2
    assert "usage: tokenmill serve" in done.stderr
    assert ("tokenmill serve: error: unrecognized arguments: --max-model-length (did you mean --max-model-len?)"
            in done.stderr)
    done = _cli("serve", "--enable-prefx-caching")
    assert "did you mean --enable-prefix-caching?" in done.stderr


def test_tensor_parallel_sizes_the_model_cannot_split_are_a_clear_error():
    done = _cli("serve", "-tp", "0", "--device", "cpu")
    assert done.returncode == 2 and "usage: tokenmill serve" in done.stderr
    assert "--tensor-parallel-size/-tp 0: must be >= 1" in done.stderr
    # The default model has 9 query heads (docs/distributed.md): refused before any worker starts.
    done = _cli("serve", "-tp", "2", "--device", "cpu")
    assert done.returncode != 0
    assert "tensor_parallel_size=2 cannot split this model" in done.stderr + done.stdout
    assert "values that work: 1, 3" in done.stderr + done.stdout


def test_the_serve_parser_reads_vllm_spellings():
    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.entrypoints.engine_args import engine_kwargs
    args = build_parser().parse_args(["serve", "--model", "m.gguf", "--no-enable-chunked-prefill",
                                      "--enable-chunked-prefill", "--generation-config", "vllm",
                                      "--tensor-parallel-size", "1", "--trust-remote-code"])
    assert args.model_flag == "m.gguf" and args.model is None and args.enable_chunked_prefill
    kw = engine_kwargs(args)
    assert kw["generation_config"] == "none" and kw["tensor_parallel_size"] == 1
    assert "trust_remote_code" not in kw        # accepted; no remote code is ever run
    done = _cli("serve", "a.gguf", "--model", "b.gguf")
    assert done.returncode == 2 and "the model is given twice" in done.stderr
    done = _cli("serve", "--generation-config", "/no/such/folder")
    assert done.returncode == 2 and "generation_config.json" in done.stderr


def test_default_served_name():
    assert default_served_name("SmolLM2-135M-Instruct.Q4_1") == "SmolLM2-135M-Instruct"
    assert default_served_name("Llama-3.2-1B-Instruct-Q4_K_M") == "Llama-3.2-1B-Instruct"
    assert default_served_name("qwen2.5-0.5b-instruct-q8_0") == "qwen2.5-0.5b-instruct"
    assert default_served_name("model-BF16") == "model"
    assert default_served_name("Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct"


def test_a_model_that_fails_to_load_exits_1():
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        ServerProcess(["/no/such/model.gguf", "--device", "cpu"], fake_engine=True,
                      startup_timeout=120).start()
    assert "Traceback" in str(e.value) or "no/such/model" in str(e.value)
