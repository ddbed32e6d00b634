"""Discovery: every extension point through its entry-point group (built-ins exactly like
third-party ones), API versions checked, refusals reported and never fatal, backend selection,
`tokenmill platforms` / `tokenmill plugins`, and the third-party test package end to end."""
from __future__ import annotations

import importlib.metadata
import json
import logging

import pytest
import torch

from tokenmill.attention_backends.interface import AttentionBackend, AttentionConfig
from tokenmill.platforms.interface import PLATFORM_API_VERSION, Availability, Platform
from tokenmill.plugins import discovery, registry
from tokenmill.plugins.kinds import KINDS

BUILTIN_PLATFORMS = {
    "cpu": "tokenmill.platforms.cpu:CpuPlatform",
    "cuda": "tokenmill.platforms.cuda:CudaPlatform",
    "rocm": "tokenmill.platforms.rocm:RocmPlatform",
    "xpu": "tokenmill.platforms.xpu:XpuPlatform",
    "tpu": "tokenmill.platforms.tpu:TpuPlatform",
    "neuron": "tokenmill.platforms.neuron:NeuronPlatform",
}
ACCELERATOR_HERE = any(discovery.platform_class(n).probe().available for n in ("cuda", "rocm", "xpu", "tpu", "neuron"))


@pytest.fixture(autouse=True)
def fresh_discovery():
    discovery.clear_caches()
    yield
    discovery.clear_caches()


def by_name() -> dict[str, discovery.PlatformReport]:
    return {r.name: r for r in discovery.discover_platforms()}


# ---------------------------------------------------------------------------- built-ins

def test_builtins_come_through_their_entry_point_groups():
    reports = by_name()
    for name, target in BUILTIN_PLATFORMS.items():
        r = reports[name]
        assert r.origin == "built-in" and r.entry_point == target
        assert r.api_version == PLATFORM_API_VERSION and r.load_error is None
        assert r.description["attention_backends"] and r.description["distributed_backend"]
    declared = {(ep.group, ep.name) for ep in importlib.metadata.distribution("tokenmill").entry_points}
    assert {("tokenmill.platforms", n) for n in BUILTIN_PLATFORMS} <= declared
    assert {"reference", "cpu_sdpa", "cpu_mla", "triton_paged", "flash_attn", "flashinfer", "ipex", "pallas"} == {
        n for g, n in declared if g == "tokenmill.attention_backends"}
    for kind in ("platform", "attention_backend", "model_architecture"):
        assert all(r.loaded and r.package == "tokenmill" for r in registry.reports(kind)), kind
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        discovery.model_architectures())
    assert "gguf" in discovery.quantization_methods()
    assert set(discovery.tool_parsers()) == {"hermes", "llama3_json", "mistral", "pythonic", "granite",
                                                 "phi4_mini_json", "glm45", "cohere_command3"}
    assert set(discovery.reasoning_parsers()) == {"qwen3", "deepseek_r1", "glm45", "granite",
                                                      "cohere_command3"}
    assert set(discovery.grammar_backends()) == {"xgrammar", "guidance"}


@pytest.mark.skipif(ACCELERATOR_HERE, reason="an accelerator platform is available here")
def test_auto_picks_cpu_and_says_why_not_the_others(caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.plugins"):
        platform = discovery.resolve_platform("auto")
    assert platform.name == "cpu"
    message = next(r.getMessage() for r in caplog.records if "device auto" in r.getMessage())
    assert f"cuda (unavailable: {by_name()['cuda'].reason})" in message
    for name in ("rocm", "xpu", "tpu", "neuron"):
        assert f"{name} (unavailable:" in message


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_explicit_unavailable_device_is_a_specific_error():
    with pytest.raises(ValueError) as info:
        discovery.resolve_platform("cuda")
    assert str(info.value) == f"device 'cuda' is not available: torch {torch.__version__} was built without CUDA"


def test_unknown_device_lists_known_and_explicit_cpu_wins():
    with pytest.raises(ValueError, match=r"unknown device 'warp9'; discovered platforms: .*cpu.*cuda"):
        discovery.resolve_platform("warp9")
    assert discovery.resolve_platform("cpu").name == "cpu"


# ------------------------------------------------------- fault tolerance, with fake entry points

class HighPriorityPlatform(Platform):
    name = "fancy"
    priority = 1000

    @classmethod
    def probe(cls):
        return Availability.yes("always")


class RaisingProbePlatform(Platform):
    name = "raiser"

    @classmethod
    def probe(cls):
        raise RuntimeError("vendor SDK crashed")


class ImpostorCpu(Platform):
    name = "cpu"

    @classmethod
    def probe(cls):
        return Availability.yes()


class FutureBackend(AttentionBackend):
    name = "future"
    api_version = 7


class PluginBackend(AttentionBackend):
    name = "plugin_a"


class UnversionedParser:
    pass


def fake_entry_points(monkeypatch, group: str, loaded: list, failures: list = ()):
    """Add fake entry points to one group (calls chain: each wraps the previous one)."""
    real = registry._extensions

    def patched(g):
        got, failed = real(g)
        if g == group:
            eps = [(importlib.metadata.EntryPoint(n, v, g), obj) for n, v, obj in loaded]
            fails = [(importlib.metadata.EntryPoint(n, v, g), exc) for n, v, exc in failures]
            return got + eps, failed + fails
        return got, failed
    monkeypatch.setattr(registry, "_extensions", patched)


def test_faulty_platforms_are_refused_and_reported(monkeypatch):
    fake_entry_points(monkeypatch, "tokenmill.platforms", [
        ("fancy", "fake:HighPriorityPlatform", HighPriorityPlatform),
        ("raiser", "fake:RaisingProbePlatform", RaisingProbePlatform),
        ("notaplatform", "fake:thing", object()),
        ("cpu", "fake:ImpostorCpu", ImpostorCpu),
    ], [("gone", "fake_missing:Platform", ModuleNotFoundError("No module named 'fake_missing'"))])
    r = {x.name: x for x in discovery.discover_platforms() if x.entry_point.startswith("fake")}
    assert r["raiser"].load_error is None and not r["raiser"].available
    assert r["raiser"].reason == "probe raised RuntimeError: vendor SDK crashed"
    assert "not a tokenmill.platforms.interface.Platform subclass" in r["notaplatform"].load_error
    assert r["cpu"].load_error == "name clash: platform 'cpu' is already provided by tokenmill"
    assert r["gone"].load_error == ("failed to import fake_missing:Platform: ModuleNotFoundError: "
                                    "No module named 'fake_missing'")
    assert all(x.origin == registry.UNKNOWN_PACKAGE for x in r.values())
    # The others still work; the impostor did not replace the built-in cpu; auto picks the top priority.
    assert type(discovery.resolve_platform("cpu")).__module__ == "tokenmill.platforms.cpu"
    assert discovery.resolve_platform("auto").name == "fancy"
    with pytest.raises(ValueError, match="device 'gone' .* cannot be used: failed to import"):
        discovery.resolve_platform("gone")


def test_every_kind_checks_type_and_api_version(monkeypatch):
    fake_entry_points(monkeypatch, "tokenmill.attention_backends", [
        ("plugin_a", "fake:PluginBackend", PluginBackend), ("future", "fake:FutureBackend", FutureBackend),
        ("notabackend", "fake:int", int), ("reference", "fake:PluginBackend", PluginBackend)])
    fake_entry_points(monkeypatch, "tokenmill.tool_parsers", [("bare", "fake:UnversionedParser", UnversionedParser)])
    backends = discovery.attention_backend_classes()
    assert backends["plugin_a"] is PluginBackend
    assert backends["reference"].__module__ == "tokenmill.attention_backends.reference"   # built-in wins
    errors = discovery.attention_backend_errors()
    assert errors["future"] == "built for attention_backend API version 7; this tokenmill speaks version 1"
    assert "not a tokenmill.attention_backends.interface.AttentionBackend subclass" in errors["notabackend"]
    assert errors["reference"] == "name clash: attention_backend 'reference' is already provided by tokenmill"
    parser = next(r for r in registry.reports("tool_parser") if r.name == "bare")
    assert parser.state == "refused" and "not a tokenmill.plugins.parsers.ToolParser subclass" in parser.reason


def test_model_architectures_default_to_api_version_1():
    kind = KINDS["model_architecture"]
    assert kind.check(torch.nn.Linear) == (1, None)

    class Future(torch.nn.Module):
        api_version = 2
    assert "API version 2" in kind.check(Future)[1]
    assert KINDS["tool_parser"].check(type("P", (), {}))[1].startswith("not a")


def test_retired_group_is_reported(monkeypatch):
    ep = importlib.metadata.EntryPoint("oldplugin", "old_pkg.hooks", "tokenmill.plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [ep] if group == "tokenmill.plugins" else [])
    (report,) = registry.retired_reports()
    assert report.state == "refused" and "tokenmill.hooks" in report.reason


# ------------------------------------------------------------------------- backend selection

def _attn_config(**kw):
    base = dict(head_size=64, num_heads=4, num_kv_heads=2, dtype=torch.float32, device="cpu")
    base.update(kw)
    return AttentionConfig(**base)


def test_select_attention_backend():
    cpu = discovery.resolve_platform("cpu")
    assert discovery.select_attention_backend(cpu, _attn_config()).name == "cpu_sdpa"
    assert discovery.select_attention_backend(cpu, _attn_config(), "reference").name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend 'warp'"):
        discovery.select_attention_backend(cpu, _attn_config(), "warp")
    with pytest.raises(ValueError, match="cannot run here: .*graph capture .*--enforce-eager"):
        discovery.select_attention_backend(cpu, _attn_config(graph_capture="cuda_graphs"), "reference")


def test_select_falls_back_to_eager_and_reference_runs_on_any_device(caplog):
    class NewDevice(Platform):
        name = "newdev"
        dispatch_key = "newdev"

        def attention_backends(self):
            return ["not_here", "cpu_sdpa", "reference"]

    with caplog.at_level(logging.INFO, logger="tokenmill.attention_backends"):
        cls = discovery.select_attention_backend(NewDevice(), _attn_config(graph_capture="cuda_graphs",
                                                                            device="newdev"))
    assert cls.name == "reference" and "without graph capture" in caplog.text
    assert "not_here: not installed" in caplog.text and "device 'newdev' not supported" in caplog.text


# ------------------------------------------------------------------- the third-party package

def test_third_party_package_every_kind(test_plugins):
    reports = by_name()
    test = reports["testcpu"]
    assert test.origin == "tokenmill-testplatform" and test.available and test.load_error is None
    assert test.description["attention_backends"] == ["testcpu_paged"]
    old = reports["testcpu_oldapi"]
    assert old.api_version == 999 and not old.available
    assert old.load_error == f"built for platform API version 999; this tokenmill speaks version {PLATFORM_API_VERSION}"
    assert "No module named 'tokenmill_testplatform_vendor_sdk'" in reports["testcpu_broken"].load_error
    with pytest.raises(ValueError, match="API version 999"):
        discovery.resolve_platform("testcpu_oldapi")
    platform = discovery.resolve_platform("testcpu")
    assert platform.name == "testcpu" and platform.device() == torch.device("cpu")
    backends = discovery.attention_backend_classes()
    assert discovery.select_attention_backend(platform, _attn_config()) is backends["testcpu_paged"]
    from tokenmill.core.models.llama import LlamaForCausalLM
    assert issubclass(discovery.model_architectures()["TestLlamaForCausalLM"], LlamaForCausalLM)
    builtin = {r.name for r in discovery.extension_reports() if r.kind == "model_architecture" and r.builtin}
    assert set(discovery.model_architectures()) - builtin == {"TestLlamaForCausalLM"}
    tools = discovery.tool_parsers()["test_json_tools"](tokenizer=None)
    got = tools.extract_tool_calls('hi <tool>{"name": "f", "arguments": {"x": 1}}</tool>')
    assert got.content == "hi" and got.tool_calls[0].name == "f" and json.loads(got.tool_calls[0].arguments) == {"x": 1}
    think = discovery.reasoning_parsers()["test_think"](tokenizer=None)
    assert think.extract_reasoning("<think>hmm</think> yes") == ("hmm", "yes")
    assert discovery.grammar_backends()["test_regex"](None).compile("regex", "a+").fullmatch("aaa")
    kinds = {(r.kind, r.name): r for r in discovery.extension_reports()}
    for kind in ("platform", "attention_backend", "model_architecture", "tool_parser", "reasoning_parser",
                 "grammar_backend", "hook"):
        assert any(k == kind and r.package == "tokenmill-testplatform" and r.loaded
                   for (k, _), r in kinds.items()), kind
    assert kinds[("hook", "testplatform_events")].detail == "hooks: tokenmill_request_event"


@pytest.mark.skipif(ACCELERATOR_HERE, reason="an accelerator platform is available here")
def test_auto_passes_over_the_third_party_platform(test_plugins, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.plugins"):
        assert discovery.resolve_platform("auto").name == "cpu"
    assert "testcpu (lower priority -10 than cpu's 0)" in caplog.text


# ------------------------------------------------------------ tokenmill platforms / plugins

def test_platforms_command_table(capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["platforms"]) == 0
    out = capsys.readouterr().out
    for name, report in by_name().items():
        assert name in out and report.reason in out
    assert "--device auto -> " in out and "testcpu" not in out


def test_platforms_command_json(test_plugins, capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["platforms", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {p["name"]: p for p in data["platforms"]}
    assert set(BUILTIN_PLATFORMS) | {"testcpu", "testcpu_oldapi"} <= set(names)
    cuda = names["cuda"]
    assert cuda["origin"] == "built-in" and cuda["api_version"] == PLATFORM_API_VERSION
    assert [b["name"] for b in cuda["attention_backends"]] == ["flash_attn", "flashinfer", "triton_paged", "reference"]
    assert cuda["decode_programs"][0] == "cuda_graphs" and cuda["distributed_backend"] == "nccl"
    assert names["testcpu_oldapi"]["load_error"] and data["auto"] == discovery.resolve_platform("auto").name


def test_plugins_command_lists_only_real_extensions_here(capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "refused" not in out.replace("0 refused", "") and "testcpu" not in out and "broken" not in out
    for word in ("platform", "attention_backend", "quantization_method", "model_architecture", "hook"):
        assert word in out


def test_plugins_command_json_with_test_plugins(test_plugins, capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["plugins", "--json"]) == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(capsys.readouterr().out)}
    assert rows[("platform", "testcpu")]["package"] == "tokenmill-testplatform"
    assert rows[("platform", "testcpu")]["package_version"] == "0.1.0"
    assert rows[("platform", "cpu")]["detail"].startswith("available")
    assert rows[("platform", "testcpu_oldapi")]["state"] == "refused"
    assert rows[("attention_backend", "broken_lastblock")]["state"] == "loaded"   # loads; it is wrong, not broken
    assert {"name", "kind", "package", "package_version", "api_version", "state", "reason"} <= set(
        rows[("tool_parser", "test_json_tools")])


# ------------------------------------------------------------------ end to end (the engine)

ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=32 << 20, max_num_seqs=4, seed=0)


def test_generate_on_third_party_platform_matches_cpu(test_plugins):
    from tokenmill import LLM, SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    cpu = LLM(device="cpu", **ENGINE_KW)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    del cpu
    test = LLM(device="testcpu", **ENGINE_KW)
    assert test.engine.platform.name == "testcpu" and test.engine.attention_backend_name == "testcpu_paged"
    got = [o.outputs[0].token_ids for o in test.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) == 8 for t in got)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_generate_device_cuda_exits_2_with_reason(capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["generate", "--device", "cuda", "Hello"]) == 2
    err = capsys.readouterr().err
    assert f"torch {torch.__version__} was built without CUDA" in err
