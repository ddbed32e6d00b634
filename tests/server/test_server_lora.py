"""LoRA adapters through the official openai SDK against a real `tokenmill serve --enable-lora` (issue 14):
`model` names an adapter (--lora-modules or loaded at run time) and gets transformers+peft's greedy tokens,
the base model beside it its own; /v1/models lists adapters with parent and root; load/unload behind the
API key with vLLM's bodies; unknown adapter 404, unservable adapter 400 naming why; more adapters than
--max-loras under concurrent load all answered right, with swaps and per-adapter gauges in /metrics."""
from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from lora_helpers import hf_greedy, make_base_and_adapters

from tokenmill.entrypoints.openai.testing import ServerProcess

KEY = "lora-key"
MODEL = "tiny-base"
MAX_TOKENS = 8
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    base, hf, adapters = make_base_and_adapters(root, "llama", 3)
    expected = {MODEL: hf_greedy(hf, PROMPTS, MAX_TOKENS)}
    for i, (_, model) in enumerate(adapters):
        expected[f"a{i}"] = hf_greedy(model, PROMPTS, MAX_TOKENS)
    return root, base, [p for p, _ in adapters], expected


@pytest.fixture(scope="module")
def server(setup):
    _, base, paths, _ = setup
    args = [base, "--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL, "--num-threads", "1",
            "--kv-cache-memory", str(16 << 20), "--generation-config", "none", "--api-key", KEY,
            "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"a0={paths[0]}", json.dumps({"name": "a1", "path": paths[1]})]
    with ServerProcess(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _tokens(client, model: str, prompt: list[int]) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert out.model == model
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def _post(server, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_adapters_and_base_give_peft_and_transformers_tokens(client, setup):
    _, _, _, expected = setup
    for model in (MODEL, "a0", "a1"):
        assert [_tokens(client, model, p) for p in PROMPTS] == expected[model], model
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "w10 w11"}], max_tokens=3)
    assert chat.model == "a1" and chat.choices[0].message.content is not None


def test_models_lists_adapters_with_parent_and_root(client, setup):
    _, _, paths, _ = setup
    cards = {m.id: m for m in client.models.list().data}
    assert cards[MODEL].parent is None
    assert (cards["a0"].parent, cards["a0"].root) == (MODEL, paths[0])
    assert (cards["a1"].parent, cards["a1"].root) == (MODEL, paths[1])
    assert client.models.retrieve("a0").parent == MODEL


def test_unknown_adapter_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt=[11, 12], max_tokens=2)
    assert info.value.code == "model_not_found"


def _edit_copy(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return dst


def test_load_and_unload_at_run_time(client, server, setup):
    root, _, paths, expected = setup
    body = {"lora_name": "a2", "lora_path": paths[2]}
    assert _post(server, "/v1/load_lora_adapter", body, key="wrong").status_code == 401
    loaded = _post(server, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert "a2" in {m.id for m in client.models.list().data}
    assert [_tokens(client, "a2", p) for p in PROMPTS] == expected["a2"]
    again = _post(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    assert "a2" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=[11, 12], max_tokens=2)
    gone = _post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"

    bad = [(_edit_copy(paths[2], os.path.join(root, "big"), r=16), "max_lora_rank", "rank 16"),
           (_edit_copy(paths[2], os.path.join(root, "fc1"), target_modules=["q_proj", "fc1"]), "target_modules", "fc1"),
           (_edit_copy(paths[2], os.path.join(root, "mts"), modules_to_save=["lm_head"]), "modules_to_save",
            "modules_to_save"),
           (os.path.join(root, "missing"), "lora_path", "does not exist")]
    for path, param, needle in bad:
        r = _post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and needle in error["message"], error
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "bad" not in {m.id for m in client.models.list().data}


def test_more_adapters_than_slots_under_concurrent_load(client, server, setup):
    _, _, paths, expected = setup
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": paths[2]}).status_code == 200
    jobs = [(model, j) for _ in range(2) for model in (MODEL, "a0", "a1", "a2") for j in range(len(PROMPTS))]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: _tokens(client, job[0], PROMPTS[job[1]]), jobs))
    assert got == [expected[model][j] for model, j in jobs]
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    swaps = [line for line in text.splitlines() if line.startswith("tokenmill:lora_swaps_total{")]
    assert swaps and float(swaps[0].rsplit(" ", 1)[1]) >= 3      # one slot, three adapters: swapped in turn
    assert 'tokenmill:lora_requests_info{' in text and 'max_lora="1"' in text
    for name in ("a0", "a1", "a2"):     # every adapter that ran has its series (0 now: all finished)
        assert f'tokenmill:lora_num_requests_running{{lora_name="{name}",model_name="{MODEL}"}} 0.0' in text
