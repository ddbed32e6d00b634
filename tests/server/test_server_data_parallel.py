"""Data parallelism (`tokenmill serve MODEL -dp 2`, issue 16 item 4): two engine replicas behind one API, each
request routed to the replica with the longest cached prefix, then the least loaded; visible in /metrics."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from model_helpers import save_tiny_checkpoint
from tokenmill.entrypoints.openai.testing import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", str(directory))
    args = [str(directory), "--served-model-name", "tiny", "-dp", "2", "--max-model-len", "256",
            "--max-num-seqs", "8", "--kv-cache-memory", str(2 * 2**20), "--disable-access-log"]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}, startup_timeout=180) as srv:
        yield srv


def dp_metrics(server: ServerProcess) -> dict[tuple[str, str], float]:
    """{(series, replica[/reason]): value} of the tokenmill:dp_* series."""
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        m = re.match(r'^tokenmill:(dp_\w+?)(?:_total)?\{([^}]*)\} (\S+)$', line)
        if m and not m.group(1).endswith("_created"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = labels["replica"] + (f"/{labels['reason']}" if "reason" in labels else "")
            out[(m.group(1), key)] = float(m.group(3))
    return out


def test_both_replicas_serve_and_a_shared_prefix_sticks_to_one(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    system_a = list(range(10, 74))          # two "system prompts" of 4 blocks of 16 tokens
    system_b = list(range(300, 364))
    first = c.completions.create(model="tiny", prompt=system_a + [5], max_tokens=2, temperature=0)
    c.completions.create(model="tiny", prompt=system_b + [5], max_tokens=2, temperature=0)
    routed = dp_metrics(server)
    assert routed[("dp_routed_requests", "0/load")] == 1 and routed[("dp_routed_requests", "1/load")] == 1
    for i in range(3):                      # follow-ups sharing a's prefix, then b's
        again = c.completions.create(model="tiny", prompt=system_a + [5], max_tokens=2, temperature=0)
        assert again.choices[0].text == first.choices[0].text      # the same model on either replica
        c.completions.create(model="tiny", prompt=system_b + [6 + i], max_tokens=2, temperature=0)
    m = dp_metrics(server)
    assert m[("dp_routed_requests", "0/prefix")] == 3 and m[("dp_routed_requests", "1/prefix")] == 3
    # The engines' own prefix caches hit: each replica computed its system prompt once.
    for replica in ("0", "1"):
        assert m[("dp_replica_prefix_cache_hits", replica)] >= 3 * 64
    text = httpx.get(server.url + "/metrics").text
    assert 'tokenmill:request_success_total{finished_reason="length",model_name="tiny"} 8.0' in text
    hits = re.search(r'^tokenmill:prefix_cache_hits_total\{model_name="tiny"\} (\S+)$', text, re.M)
    assert float(hits.group(1)) == m[("dp_replica_prefix_cache_hits", "0")] + m[("dp_replica_prefix_cache_hits", "1")]


def test_concurrent_unrelated_requests_spread_over_both(server):
    import concurrent.futures
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    before = dp_metrics(server)
    prompts = [[500 + 7 * i + j for j in range(20)] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: c.completions.create(model="tiny", prompt=p, max_tokens=16), prompts))
    assert all(o.usage.completion_tokens == 16 for o in outs)
    after = dp_metrics(server)
    per_replica = [sum(after[k] - before.get(k, 0) for k in after if k[0] == "dp_routed_requests"
                       and k[1].startswith(r)) for r in ("0", "1")]
    assert sum(per_replica) == 8 and min(per_replica) >= 2, per_replica


def test_threads_split_between_replicas_and_logged(server):
    assert re.search(r"2 engine processes, --num-threads \d+ each \(\d+ cores / 2 engines\)", server.log())
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
