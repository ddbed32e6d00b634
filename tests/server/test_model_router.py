"""The engine pool without engines: data-parallel routing decisions (prefix_router.py, replica_set.py),
the --models YAML (model_config.py) and picking a model by name (model_router.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.sequence import Sequence
from tokenmill.entrypoints.openai import errors as E
from tokenmill.entrypoints.openai.model_config import (ModelEntryError, parse_models_file, parse_size,
                                                       spec_from_entry, split_budget, split_threads)
from tokenmill.entrypoints.openai.prefix_router import (PrefixShadow, ReplicaLoad, choose_replica,
                                                        prompt_block_hashes)
from tokenmill.entrypoints.openai.replica_set import ReplicaSet


# ------------------------------------------------------------------ routing decisions
def test_prompt_hashes_are_the_block_managers():
    """The router's shadow hashes must be the engine's own, or a cached prefix is never found."""
    ids = list(range(100, 150))     # 3 full blocks of 16 and 2 tokens left over
    seq = Sequence("s", 0, ids, SamplingParams(max_tokens=1), 0.0)
    assert prompt_block_hashes(ids, 16) == BlockManager(8, 16).full_block_hashes(seq)[:3]
    assert len(prompt_block_hashes(ids[:15], 16)) == 0


def test_shadow_matches_a_chained_prefix_and_forgets_least_recent():
    shadow = PrefixShadow(capacity=4)
    a = prompt_block_hashes(list(range(64)), 16)            # 4 blocks
    shadow.insert(a)
    assert shadow.match(a) == 4
    assert shadow.match(prompt_block_hashes(list(range(32)) + [7] * 32, 16)) == 2   # diverges in block 3
    assert shadow.match(prompt_block_hashes([9] * 16 + list(range(16, 64)), 16)) == 0   # chained: no later hit
    shadow.insert(prompt_block_hashes([5] * 32, 16))        # 2 more: the 2 least recent of `a` go
    assert len(shadow) == 4 and shadow.match(a) == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixShadow(0)


def test_longest_prefix_wins_then_least_loaded():
    loads = [ReplicaLoad(3), ReplicaLoad(0), ReplicaLoad(1)]
    d = choose_replica([2, 0, 5], loads)
    assert (d.replica, d.reason, d.matched_blocks) == (2, "prefix", 5)
    d = choose_replica([0, 0, 0], loads)                    # nobody has it: the least loaded
    assert (d.replica, d.reason) == (1, "load")
    d = choose_replica([4, 0, 4], loads)                    # a tie on the prefix: the less loaded holder
    assert (d.replica, d.reason) == (2, "prefix")
    kv = [ReplicaLoad(1, 0.9), ReplicaLoad(1, 0.2)]
    assert choose_replica([0, 0], kv).replica == 1          # equal queues: lower KV use
    fresh = [ReplicaLoad(0, 0.0, True, 10), ReplicaLoad(0, 0.0, True, 3)]
    assert choose_replica([0, 0], fresh).replica == 1       # all idle: the one with the least cached


def test_prefix_gives_way_to_a_large_imbalance_and_dead_replicas_are_skipped():
    loads = [ReplicaLoad(40), ReplicaLoad(2)]
    assert choose_replica([8, 0], loads, balance_threshold=16).reason == "load"
    assert choose_replica([8, 0], loads, balance_threshold=64).replica == 0
    dead = [ReplicaLoad(0, alive=False), ReplicaLoad(5)]
    assert choose_replica([9, 0], dead).replica == 1
    with pytest.raises(ValueError, match="no replica is alive"):
        choose_replica([0], [ReplicaLoad(0, alive=False)])


class StubReplica:
    """An EngineClient without a process: records what it was sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.aborted: list[str] = []
        self.stats: dict = {}
        self.is_alive = True

    @property
    def num_in_flight(self) -> int:
        return 0

    def add(self, requests, priority=0) -> None:
        self.sent += [rid for rid, *_ in requests]

    def abort(self, rids) -> None:
        self.aborted += list(rids)

    def num_waiting_after(self, num_new: int, max_running=None) -> int:
        return max(0, num_new - 4)


def stub_set(n: int = 2) -> tuple[ReplicaSet, list[StubReplica], CollectorRegistry]:
    rs = ReplicaSet({}, n)
    rs.replicas = [StubReplica() for _ in range(n)]
    rs.info = SimpleNamespace(block_size=16)
    from tokenmill.entrypoints.openai.prefix_router import PrefixShadow as Shadow
    rs.shadows = [Shadow(64) for _ in range(n)]
    registry = CollectorRegistry()
    rs.bind_metrics(registry, "m")
    return rs, rs.replicas, registry


def req(rid: str, ids: list[int]):
    return (rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=1), None)


def metric(registry: CollectorRegistry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_replica_set_sends_a_shared_prefix_to_the_same_replica_and_counts_why():
    rs, (r0, r1), registry = stub_set()
    system = list(range(10, 42))                     # a 2-block "system prompt"
    rs.add([req("a", system + [1, 2, 3])])
    rs.add([req("b", [7] * 40)])                     # unseen: the idle replica with the smaller cache
    rs.add([req("c", system + [4, 5])])              # shares a's prefix: a's replica
    rs.add([req("d", [7] * 33)])                     # shares b's 2 blocks
    assert (r0.sent, r1.sent) == (["a", "c"], ["b", "d"])
    labels = {"model_name": "m"}
    assert metric(registry, "tokenmill:dp_routed_requests_total", replica="0", reason="prefix", **labels) == 1
    assert metric(registry, "tokenmill:dp_routed_requests_total", replica="1", reason="prefix", **labels) == 1
    assert metric(registry, "tokenmill:dp_routed_requests_total", replica="0", reason="load", **labels) == 1
    assert metric(registry, "tokenmill:dp_routed_requests_total", replica="1", reason="load", **labels) == 1
    rs.abort(["c"])                                  # offered to both; each skips what it does not hold
    assert r0.aborted == ["c"] and r1.aborted == ["c"]
    r0.is_alive = False                              # a dead replica gets nothing, even for its prefix
    rs.add([req("e", system + [9])])
    assert r1.sent[-1] == "e"
    assert rs.is_alive
    r1.is_alive = False
    from tokenmill.entrypoints.openai.engine_client import EngineDeadError
    with pytest.raises(EngineDeadError):
        rs.add([req("f", [1] * 20)])


def test_replica_set_keeps_adapters_apart_and_sends_adapter_commands_to_every_replica():
    import asyncio
    rs, (r0, r1), _ = stub_set()
    system = list(range(10, 42))
    rs.add([req("a", system)])
    rs.add([("b", {"prompt_token_ids": system, "lora_request": "legal"}, None, None)])   # not the base's cache
    assert (r0.sent, r1.sent) == (["a"], ["b"])
    calls = []

    async def call(op, *args, timeout=120.0, who=None):
        calls.append((who, op, args))
        return {"legal": "/a"}
    r0.call = lambda op, *a, timeout=120.0: call(op, *a, who=0)
    r1.call = lambda op, *a, timeout=120.0: call(op, *a, who=1)
    assert asyncio.run(rs.call("load_lora", "legal", "/a")) == {"legal": "/a"}
    assert sorted(calls) == [(0, "load_lora", ("legal", "/a")), (1, "load_lora", ("legal", "/a"))]


def test_replica_set_stats_add_up_and_survive_a_replica_restart():
    rs, _, registry = stub_set()
    seen: list[dict] = []
    rs.on_stats = seen.append
    rs._stats_from(0, {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5, "prompt_tokens": 100,
                       "prefix_cache_hits": 32})
    rs._stats_from(1, {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.1, "prompt_tokens": 10})
    assert seen[-1]["num_running"] == 3 and seen[-1]["prompt_tokens"] == 110
    assert seen[-1]["kv_cache_usage"] == pytest.approx(0.3)
    assert metric(registry, "tokenmill:dp_replica_num_requests_running", model_name="m", replica="0") == 2
    assert metric(registry, "tokenmill:dp_replica_prefix_cache_hits_total", model_name="m", replica="0") == 32
    rs._stats_from(1, {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "prompt_tokens": 4})  # restarted
    assert seen[-1]["prompt_tokens"] == 114          # a running total, never going back
    lora = {"num_running": 1, "max_loras": 2, "lora_running": {"a": 1}, "lora_swaps": 3}
    rs._stats_from(0, lora)
    rs._stats_from(1, {**lora, "lora_running": {"a": 2, "b": 1}})
    assert seen[-1]["max_loras"] == 2 and seen[-1]["lora_running"] == {"a": 3, "b": 1}
    assert seen[-1]["lora_swaps"] == 6


# ------------------------------------------------------------------ the --models file
def write(tmp_path, text: str) -> str:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return str(path)


def test_models_file_parses_names_engine_options_and_sizes(tmp_path):
    path = write(tmp_path, """
models:
  - name: smol
    model: /models/smol.gguf
    kv_cache_memory: 64MiB
    max_num_seqs: 8
    lora_modules: {sql: /adapters/sql}
  - name: tiny
    path: /models/tiny
    device: cpu
    served_model_name: [tiny-alias]
    adapters: [legal=/adapters/legal]
    data_parallel_size: 2
    kv_cache_share: 3
""")
    smol, tiny = parse_models_file(path, {"max_num_seqs": 256, "block_size": 16, "served_model_name": "x"})
    assert smol.engine_kwargs == {"max_num_seqs": 8, "block_size": 16, "model": "/models/smol.gguf",
                                  "served_model_name": "smol", "kv_cache_memory": 64 * 2**20,
                                  "lora_modules": [["sql", "/adapters/sql"]], "enable_lora": True}
    assert tiny.engine_kwargs["model"] == "/models/tiny" and tiny.engine_kwargs["device"] == "cpu"
    assert tiny.settings["served_model_names"] == ["tiny", "tiny-alias"]
    assert tiny.engine_kwargs["lora_modules"] == ["legal=/adapters/legal"] and tiny.engine_kwargs["enable_lora"]
    from tokenmill.core.lora.config import parse_lora_modules      # the engine reads both forms
    assert parse_lora_modules(smol.engine_kwargs["lora_modules"]) == [("sql", "/adapters/sql")]
    assert (tiny.data_parallel_size, tiny.kv_cache_share) == (2, 3.0)
    assert parse_size("1.5GiB", "x") == 3 * 2**29 and parse_size(4096, "x") == 4096


@pytest.mark.parametrize("body, message", [
    ("models:\n  - name: a\n    model: m\n    max_num_seq: 3\n", r"model 'a': unknown key 'max_num_seq'"),
    ("models:\n  - model: m\n", r"a model has no `name`"),
    ("models:\n  - name: a\n    model: m\n    path: p\n", r"model 'a': give the checkpoint as one of `model` or"),
    ("models:\n  - {name: a, model: 7}\n", r"model 'a': `model` must be a file or directory path"),
    ("models:\n  - {name: a, model: m}\n  - {name: a, model: n}\n", r"the name 'a' is used by two models"),
    ("models:\n  - {name: a, model: m, kv_cache_memory: lots}\n", r"model 'a': kv_cache_memory must be"),
    ("models:\n  - {name: a, model: m, data_parallel_size: 0}\n", r"data_parallel_size must be an integer"),
    ("models:\n  - {name: a, model: m, tool_call_parser: nope}\n", r"model 'a': .*nope"),
    ("models: []\n", r"top-level `models:` list"),
    ("model:\n  - {name: a, model: m}\n", r"top-level `models:` list"),
    ("models: [\n", r"not valid YAML"),
    ("models:\n  - {name: a, model: m, adapters: 3}\n", r"model 'a': adapters must map adapter names"),
    ("models:\n  - {name: a, model: m, adapters: {}, lora_modules: []}\n", r"`adapters` or `lora_modules`"),
])
def test_models_file_errors_name_the_key_and_the_model(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        parse_models_file(write(tmp_path, body), {})


def test_a_model_without_a_checkpoint_is_the_default_model(tmp_path):
    (spec,) = parse_models_file(write(tmp_path, "models:\n  - name: smol\n"), {"model": "ignored"})
    assert spec.engine_kwargs["model"] is None and spec.name == "smol"


def test_load_body_errors_carry_the_field():
    with pytest.raises(ModelEntryError) as info:
        spec_from_entry({"name": "a", "model": "m", "bogus": 1}, {}, "POST /v1/models/load")
    assert info.value.key == "bogus" and info.value.unknown
    with pytest.raises(ModelEntryError) as info:
        spec_from_entry({"name": "a", "model": 3}, {}, "POST /v1/models/load")
    assert info.value.key == "model"


def test_budget_and_threads_are_split_between_engines(tmp_path, caplog):
    path = write(tmp_path, """
models:
  - {name: a, model: m, kv_cache_share: 3}
  - {name: b, model: n}
  - {name: c, model: o, kv_cache_memory: 1000, num_threads: 5, device: cuda:1}
  - {name: d, model: p, data_parallel_size: 2}
""")
    specs = parse_models_file(path, {"kv_cache_memory": 600, "num_threads": None})
    split_budget(specs, 600, 0.9)
    a, b, c, d = specs
    assert [s.engine_kwargs["kv_cache_memory"] for s in specs] == [360, 120, 1000, 120]
    assert a.engine_kwargs["gpu_memory_utilization"] == pytest.approx(0.9 * 3 / 6)   # a, b, d (2 replicas): "auto"
    assert d.engine_kwargs["gpu_memory_utilization"] == pytest.approx(0.9 * 1 / 6)   # each of d's replicas
    assert "gpu_memory_utilization" not in c.engine_kwargs                           # alone on cuda:1
    with caplog.at_level(logging.INFO, logger="tokenmill.serve"):
        split_threads(specs, cores=10)
    assert [s.engine_kwargs["num_threads"] for s in specs] == [2, 2, 5, 2]          # 10 cores / 5 engines
    assert "--num-threads 2 each (10 cores / 5 engines)" in caplog.text


# ------------------------------------------------------------------ picking a model
def test_one_models_replicas_split_the_device():
    from tokenmill.entrypoints.openai.model_config import ModelSpec
    spec = ModelSpec("m", {"gpu_memory_utilization": 0.8}, data_parallel_size=2)
    split_budget([spec], None, 0.8)
    assert spec.engine_kwargs["gpu_memory_utilization"] == pytest.approx(0.4)
    alone = ModelSpec("m", {"gpu_memory_utilization": 0.8})
    split_budget([alone], None, 0.8)
    assert alone.engine_kwargs["gpu_memory_utilization"] == 0.8


def test_router_picks_by_name_and_404s_an_unknown_one():
    from tokenmill.entrypoints.openai.model_config import ModelTable
    from tokenmill.entrypoints.openai.model_router import CURRENT_MODEL, ModelRouter
    from tokenmill.entrypoints.openai.serving import ServerSettings

    class FakeServing:
        def __init__(self, client, settings):
            self.client, self.settings, self.state, self.on_started, self.on_stopping = client, settings, None, [], []

        def require(self):
            return self

    specs = [spec_from_entry({"name": n, "model": "m"}, {}, "t") for n in ("a", "b")]
    client = SimpleNamespace(engine_kwargs={})
    table = ModelTable(specs, [client, client], {})
    router = ModelRouter(FakeServing, ServerSettings(served_model_names=[]), table)
    assert router.several and router.select(None) is router.servings["a"]
    assert router.select("b") is router.servings["b"]
    token = CURRENT_MODEL.set("b")
    try:
        assert router.require() is router.servings["b"]
    finally:
        CURRENT_MODEL.reset(token)
    with pytest.raises(E.APIError) as info:
        router.select("c")
    assert info.value.status == 404 and info.value.code == "model_not_found"


def test_serve_refuses_a_bad_models_file_before_starting_an_engine(tmp_path):
    import subprocess
    import sys
    path = write(tmp_path, "models:\n  - {name: tiny, model: /m, max_num_seq: 3}\n")
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--models", path],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"--models {path}: model 'tiny': unknown key 'max_num_seq'" in done.stderr
    both = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "/m", "--models", path],
                          capture_output=True, text=True, timeout=120)
    assert both.returncode == 1 and "leave out MODEL" in both.stderr
