"""`tokenmill serve` driven by the official openai SDK: routes, streaming, sampling options, errors.

One real server (default model, light KV pool) is started for the whole module and always stopped
(the `server` fixture of conftest.py, from SERVER_ARGS). TOKENMILL_TEST_FAKE_ENGINE=1 runs the same
tests against the fake engine (no model needed).
"""
from __future__ import annotations

import os

import httpx
import openai
import pytest

KEYS = ("key-old", "key-new")
MODEL = "smol"
MAX_MODEL_LEN = 1024
BODY_LIMIT = 64 * 1024
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]

SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", "16", "--num-threads", "1", "--kv-cache-memory", str(64 * 1024 * 1024),
               "--api-key", KEYS[0], "--max-request-body-bytes", str(BODY_LIMIT), "--disable-access-log"]
SERVER_ENV = {"TOKENMILL_API_KEY": KEYS[1]}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=120)


def _tokenize(server, **body) -> int:
    r = httpx.post(server.url + "/tokenize", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 200, r.text
    return r.json()["count"]


# ---------------------------------------------------------------- happy paths
def test_models_and_meta_routes(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'tokenmill:num_requests_running{model_name="smol"}' in metrics


def test_completion_usage_matches_token_counts(server, client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == _tokenize(server, prompt=PROMPT)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_chat_usage_matches_token_counts(server, client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True}, user="someone")
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str) and out.choices[0].message.content
    assert out.usage.prompt_tokens == _tokenize(server, messages=MESSAGES)
    assert out.usage.completion_tokens == 6


@pytest.mark.skipif(os.environ.get("TOKENMILL_TEST_FAKE_ENGINE") == "1", reason="the fake engine has no prefix cache")
def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client):
    """A prompt repeated after its first run finds its full blocks cached: usage says how many."""
    ids = [1000 + (i * 7) % 3000 for i in range(100)]
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 64      # whole blocks of the 100 tokens
    chat = [{"role": "user", "content": "Tell me about the river " + "and the sea " * 40}]
    client.chat.completions.create(model=MODEL, messages=chat, max_completion_tokens=2, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=chat, max_completion_tokens=2, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens >= 64


def test_token_id_prompt_and_detokenize(server, client):
    ids = list(range(1000, 1010))
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == 10
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert r.status_code == 200 and isinstance(r.json()["prompt"], str)


def test_streamed_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10
    # without include_usage no usage chunk is sent
    plain = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.choices for c in plain)


def test_n_2(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=5, temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, temperature=1.0, seed=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    # greedy: the sampled token is the most likely one
    assert all(e.logprob >= max(t.logprob for t in e.top_logprobs) - 1e-4 for e in content)
    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                   logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].logprobs.content) for c in streamed if c.choices and c.choices[0].logprobs) == 4


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = [w for w in base.split() if len(w) > 2]
    assert words, base
    stop = words[min(1, len(words) - 1)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[: base.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_seed_reproducible(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.95,
                  extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    c = client.chat.completions.create(seed=99, **kwargs).choices[0].message.content
    assert a == b
    assert a != c


def test_vllm_extras_accepted(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, user="u1",
                                    extra_body={"min_tokens": 3, "stop_token_ids": [0], "priority": 0,
                                                "include_stop_str_in_output": False, "ignore_eos": False,
                                                "repetition_penalty": 1.0, "top_k": -1, "min_p": 0.0})
    assert out.usage.completion_tokens >= 3


# ---------------------------------------------------------------- errors
def _assert_error(exc_info, status, param=None, code=None):
    err = exc_info.value
    assert err.status_code == status
    body = err.body
    assert set(body) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["param"] == param
    if code is not None:
        assert body["code"] == code


def test_bad_parameter_is_400_naming_param(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)
    _assert_error(e, 400, param="temperature")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, top_p=0)
    _assert_error(e, 400, param="top_p")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n="two")
    _assert_error(e, 400, param="n")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=4,
                                       extra_body={"messages": [{"content": "no role"}]})
    _assert_error(e, 400)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[10 ** 9], max_tokens=4)
    _assert_error(e, 400, param="prompt")
    with pytest.raises(openai.BadRequestError) as e:   # a stream fails the same way, before it starts
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True, extra_body={"min_p": 2})
    _assert_error(e, 400, param="min_p")


def test_invalid_json_is_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/completions", json=[1, 2], headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_prompt_longer_than_max_model_len(client):
    # The engine checks the length (once); the route names the parameter as the client knows it.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1000] * (MAX_MODEL_LEN + 5), max_tokens=4)
    _assert_error(e, 400, param="prompt", code="context_length_exceeded")
    assert e.value.body["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * MAX_MODEL_LEN}])
    _assert_error(e, 400, param="messages", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    _assert_error(e, 400, param="max_tokens", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_MODEL_LEN)
    _assert_error(e, 400, param="max_completion_tokens", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:   # streamed: still a plain 400, before the stream starts
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_MODEL_LEN, stream=True)
    _assert_error(e, 400, param="max_tokens", code="context_length_exceeded")


def test_one_bad_prompt_among_several_is_400(client):
    """Every prompt of a request reaches the engine in one command, so a refused one fails the request
    before any sibling streams (and the siblings are aborted)."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=[[1000, 1001, 1002], [10 ** 9]], max_tokens=4,
                                      stream=stream)
        _assert_error(e, 400, param="prompt")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[], max_tokens=4)
    _assert_error(e, 400, param="prompt")


def test_echo(client):
    kwargs = dict(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0, echo=True, logprobs=1,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert [c.text[:len(p)] for c, p in zip(out.choices, [PROMPT, "Hello"])] == [PROMPT, "Hello"]
    assert out.choices[0].logprobs.text_offset[0] == len(PROMPT)
    chunks = list(client.completions.create(stream=True, **kwargs))
    for choice in out.choices:
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == choice.index) == choice.text


def test_refusals_become_one_openai_error():
    """The engine's RequestError crosses the process pipe pickled and becomes an APIError in one place."""
    import pickle

    from tokenmill.core.errors import RequestError
    from tokenmill.entrypoints.openai import errors as E
    from tokenmill.entrypoints.openai.engine_client import EngineDeadError

    exc = pickle.loads(pickle.dumps(RequestError("too long", "prompt", "context_length_exceeded")))
    err = E.from_exception(exc, {"prompt": "messages"})
    assert (err.status, err.param, err.code, err.message) == (400, "messages", "context_length_exceeded", "too long")
    plain = ValueError("top_p must be in (0, 1], got 0")
    plain.param = "top_p"   # SamplingParams' own errors
    assert (E.from_exception(plain).status, E.from_exception(plain).param) == (400, "top_p")
    assert E.from_exception(EngineDeadError("gone")).code == "engine_dead"
    assert E.from_exception(E.ServerShuttingDown()).code == "server_shutting_down"
    assert E.from_exception(RuntimeError("boom")).status == 500


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES, max_tokens=2)
    _assert_error(e, 404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nope")


def test_auth(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.models.list()
    _assert_error(e, 401, code="invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True)
    # no key at all (the SDK refuses to send none, so plain HTTP), on every protected route
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                               ("POST", "/v1/chat/completions", {"messages": MESSAGES}),
                               ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, server.url + path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    # both keys work (rotation: one from --api-key, one from TOKENMILL_API_KEY)
    for key in KEYS:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert c.models.list().data[0].id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200   # health stays open


def test_oversized_body_is_413(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="x" * (BODY_LIMIT + 10), max_tokens=2)
    _assert_error(e, 413)


def test_unknown_route_is_openai_shaped(server):
    r = httpx.get(server.url + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_server_survived_everything(server):
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    assert "tokenmill:request_success_total" in text
    for line in text.splitlines():
        if line.startswith("tokenmill:num_requests_running{"):
            assert float(line.split()[-1]) == 0
    assert "Traceback" not in server.log()
