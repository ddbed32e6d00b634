"""POST /v1/embeddings through the official openai SDK against a real `tokenmill serve` of a tiny
sentence-transformers BertModel (mean pooling, Matryoshka): string, list, token ids, lists of token ids,
base64 equal to float, dimensions, usage, a 64-input batch equal to 64 single calls, errors as the SDK's
classes; generation routes on a pooling server and /v1/embeddings on a generating one are 400s; a
/v1/embeddings line through `tokenmill run-batch`."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from embedding_helpers import cosines, reference_vectors, save_embedding_checkpoint

# Checked, not imported: importing sentence-transformers at collection imports triton, and triton
# imported before TRITON_INTERPRET=1 is set breaks the interpreter tests of test_attention_backends.
if importlib.util.find_spec("sentence_transformers") is None:
    pytest.skip("sentence-transformers is not installed", allow_module_level=True)

from tokenmill.entrypoints.openai.testing import ServerProcess  # noqa: E402

KEY = "emb-key"
MODEL = "tiny-embed"
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL, "--num-threads", "1",
               "--kv-cache-memory", str(16 * 1024 * 1024)]
TEXTS = ["w7 w8 w9", "w10 " * 70, "w11", "w12 w13 " * 20]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_embedding_checkpoint("bert", str(tmp_path_factory.mktemp("st") / "bert"), "mean",
                                     is_matryoshka=True)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess([model_dir, *ENGINE_ARGS, "--api-key", KEY]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_inputs_match_sentence_transformers(client, server, model_dir):
    want = reference_vectors(model_dir, TEXTS)
    got = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == list(range(len(TEXTS))) and got.model == MODEL
    assert min(cosines([d.embedding for d in got.data], want)) >= 1 - 1e-4
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and cosines([one.data[0].embedding], want[:1])[0] >= 1 - 1e-4
    # Token ids: the same vectors as the text they encode ([CLS] ... [SEP] included).
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": TEXTS[0]},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS) * 3
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert by_ids.usage.prompt_tokens == len(ids)
    assert cosines([by_ids.data[0].embedding], want[:1])[0] >= 1 - 1e-4
    many = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert len(many.data) == 2 and many.usage.prompt_tokens == len(ids) + 3
    # base64 (the SDK's default: it asks for base64 and decodes it) equals float.
    b64 = client.embeddings.create(model=MODEL, input=TEXTS)
    assert torch.allclose(torch.tensor([d.embedding for d in b64.data]), torch.tensor([d.embedding for d in got.data]))
    raw = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "w7", "encoding_format": "base64"},
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    assert isinstance(raw["data"][0]["embedding"], str) and raw["object"] == "list"


def test_dimensions(client, model_dir):
    want = reference_vectors(model_dir, TEXTS, truncate_dim=16)
    got = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=16, encoding_format="float")
    assert [len(d.embedding) for d in got.data] == [16] * len(TEXTS)
    assert min(cosines([d.embedding for d in got.data], want)) >= 1 - 1e-4
    raw = client.embeddings.create(model=MODEL, input=TEXTS[:1], dimensions=16, encoding_format="float",
                                   extra_body={"normalize": False}).data[0].embedding
    assert abs(torch.tensor(raw).norm().item() - 1) > 1e-3               # vLLM's normalize extra: off
    assert cosines([raw], want[:1])[0] >= 1 - 1e-4
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="w7", dimensions=1000)
    assert info.value.body["param"] == "dimensions"


def test_batch_of_64_equals_singles(client, server):
    inputs = [" ".join(f"w{5 + (i * 7 + j) % 900}" for j in range(3 + i % 29)) for i in range(64)]
    batch = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    singles = [client.embeddings.create(model=MODEL, input=x, encoding_format="float").data[0].embedding
               for x in inputs]
    assert len(batch.data) == 64
    assert min(cosines([d.embedding for d in batch.data], torch.tensor(singles))) >= 1 - 1e-5
    assert server.metrics().get("kv_cache_usage_perc", 0.0) == 0.0      # every block back in the pool


def test_errors(client, server):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="w7")
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="w7 " * 300)          # 256 positions
    assert info.value.body["param"] == "input" and info.value.body["code"] == "context_length_exceeded"
    ok = client.embeddings.create(model=MODEL, input="w7 " * 300, extra_body={"truncate_prompt_tokens": -1})
    assert ok.usage.prompt_tokens == 256
    for bad in ([], "", [10 ** 6]):
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=MODEL, input=bad)
        assert info.value.body["param"] == "input", bad
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="w7", encoding_format="int8")
    assert info.value.body["param"] == "encoding_format"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            model=MODEL, input="w7")
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.completions.create(model=MODEL, prompt="w7 w8", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w7"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.responses.create(model=MODEL, input="w7")
    spec = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "requestBody" in spec["paths"]["/v1/embeddings"]["post"]


def test_generating_server_refuses_embeddings(tmp_path):
    from model_helpers import save_tiny_checkpoint, tiny_tokenizer
    path = str(tmp_path / "qwen3")
    save_tiny_checkpoint("qwen3", path)
    tiny_tokenizer().save_pretrained(path)
    with ServerProcess([path, *ENGINE_ARGS]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not support Embeddings API"):
            client.embeddings.create(model=MODEL, input="w7")
        assert client.completions.create(model=MODEL, prompt="w7", max_tokens=2).choices[0].text is not None


def test_run_batch_embeddings_line(tmp_path, model_dir):
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": TEXTS[i], "encoding_format": "float"}} for i in range(len(TEXTS))]
    lines.append({"custom_id": "dims", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": MODEL, "input": "w7", "dimensions": 8}})
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "run-batch", "-i", str(src), "-o",
                           str(dst), model_dir, *ENGINE_ARGS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    want = reference_vectors(model_dir, TEXTS)
    got = [out[f"e{i}"]["response"]["body"]["data"][0]["embedding"] for i in range(len(TEXTS))]
    assert all(out[f"e{i}"]["response"]["status_code"] == 200 for i in range(len(TEXTS)))
    assert min(cosines(got, want)) >= 1 - 1e-4
    assert len(out["dims"]["response"]["body"]["data"][0]["embedding"]) == 8
