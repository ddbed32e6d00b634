"""Discovery: platforms through stevedore entry points (built-in and third-party alike), general
plugins through pluggy hooks, attention-backend registry and selection, `tokenmill platforms`,
and the third-party test package (tests/plugins/tokenmill_testplatform) end to end."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging

import pytest
import torch

from tokenmill.attention_backends.interface import AttentionBackend, AttentionConfig, AttentionMetadata
from tokenmill.platforms.interface import Availability, Platform
from tokenmill.plugins import discovery
from tokenmill.plugins.hookspecs import hookimpl

BUILTINS = {
    "cpu": "tokenmill.platforms.cpu:CpuPlatform",
    "cuda": "tokenmill.platforms.cuda:CudaPlatform",
    "rocm": "tokenmill.platforms.rocm:RocmPlatform",
    "xpu": "tokenmill.platforms.xpu:XpuPlatform",
    "tpu": "tokenmill.platforms.tpu:TpuPlatform",
    "neuron": "tokenmill.platforms.neuron:NeuronPlatform",
}


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


HAS_TEST_PLUGIN = _installed("tokenmill-testplatform")
needs_test_plugin = pytest.mark.skipif(
    not HAS_TEST_PLUGIN, reason="pip install -e tests/plugins/tokenmill_testplatform (the Makefile does)")
ACCELERATOR_HERE = any(discovery.platform_class(n).probe().available for n in ("cuda", "rocm", "xpu", "tpu", "neuron"))


@pytest.fixture(autouse=True)
def fresh_discovery():
    discovery.clear_caches()
    yield
    discovery.clear_caches()


def by_name() -> dict[str, discovery.PlatformReport]:
    return {r.name: r for r in discovery.discover_platforms()}


# ---------------------------------------------------------------------------- built-ins

def test_builtins_come_through_the_entry_point_group():
    reports = by_name()
    for name, target in BUILTINS.items():
        r = reports[name]
        assert r.origin == "built-in" and r.entry_point == target
        assert r.api_version == 1 and r.load_error is None
        assert r.description["attention_backends"] and r.description["distributed_backend"]
    # Exactly the entry points tokenmill's own distribution declares.
    declared = {ep.name: ep.value for ep in importlib.metadata.distribution("tokenmill").entry_points
                if ep.group == "tokenmill.platforms"}
    assert declared == BUILTINS


@pytest.mark.skipif(ACCELERATOR_HERE, reason="an accelerator platform is available here")
def test_this_machine_cpu_only():
    reports = by_name()
    assert reports["cpu"].available
    for name in ("cuda", "rocm", "xpu", "tpu", "neuron"):
        assert not reports[name].available and reports[name].reason, name


@pytest.mark.skipif(ACCELERATOR_HERE, reason="an accelerator platform is available here")
def test_auto_picks_cpu_and_says_why_not_the_others(caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.plugins"):
        platform = discovery.resolve_platform("auto")
    assert platform.name == "cpu"
    message = next(r.getMessage() for r in caplog.records if "device auto" in r.getMessage())
    assert f"cuda (unavailable: {by_name()['cuda'].reason})" in message
    for name in ("rocm", "xpu", "tpu", "neuron"):
        assert f"{name} (unavailable:" in message
    if HAS_TEST_PLUGIN:
        assert "testcpu (lower priority -10 than cpu's 0)" in message


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_explicit_unavailable_device_is_a_specific_error():
    with pytest.raises(ValueError) as info:
        discovery.resolve_platform("cuda")
    assert str(info.value) == f"device 'cuda' is not available: torch {torch.__version__} was built without CUDA"


def test_unknown_device_lists_known():
    with pytest.raises(ValueError, match=r"unknown device 'warp9'; discovered platforms: .*cpu.*cuda"):
        discovery.resolve_platform("warp9")


def test_explicit_cpu_overrides_detection():
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


def fake_extensions(monkeypatch, group: str, loaded: list, failures: list = ()):
    real = discovery._extensions

    def patched(g):
        got, failed = real(g)
        if g == group:
            eps = [(importlib.metadata.EntryPoint(n, v, g), obj) for n, v, obj in loaded]
            fails = [(importlib.metadata.EntryPoint(n, v, g), exc) for n, v, exc in failures]
            return got + eps, failed + fails
        return got, failed
    monkeypatch.setattr(discovery, "_extensions", patched)


def test_faulty_platform_plugins_are_reported_and_skipped(monkeypatch):
    fake_extensions(monkeypatch, "tokenmill.platforms", [
        ("fancy", "fake:HighPriorityPlatform", HighPriorityPlatform),
        ("raiser", "fake:RaisingProbePlatform", RaisingProbePlatform),
        ("notaplatform", "fake:thing", object()),
        ("cpu", "fake:ImpostorCpu", ImpostorCpu),
    ], [("gone", "fake_missing:Platform", ModuleNotFoundError("No module named 'fake_missing'"))])
    reports = discovery.discover_platforms()
    r = {x.name: x for x in reports if x.entry_point.startswith("fake")}
    assert r["raiser"].load_error is None and not r["raiser"].available
    assert r["raiser"].reason == "probe raised RuntimeError: vendor SDK crashed"
    assert "is not a tokenmill Platform subclass" in r["notaplatform"].load_error
    assert r["cpu"].load_error == "platform name 'cpu' is already provided by built-in"
    assert r["gone"].load_error == "failed to import fake_missing:Platform: ModuleNotFoundError: No module named 'fake_missing'"
    # The others still work; the impostor did not replace the built-in cpu; auto picks the top priority.
    assert type(discovery.resolve_platform("cpu")).__module__ == "tokenmill.platforms.cpu"
    assert discovery.resolve_platform("auto").name == "fancy"
    with pytest.raises(ValueError, match="device 'gone' .* cannot be used: failed to import"):
        discovery.resolve_platform("gone")


class BackendA(AttentionBackend):
    name = "plugin_a"


def test_faulty_general_plugins_are_reported_and_skipped(monkeypatch):
    class Good:
        @hookimpl
        def tokenmill_attention_backends(self):
            return {"plugin_a": BackendA, "notabackend": int, "reference": BackendA, "lazy": "tests_nowhere:X"}

        @hookimpl
        def tokenmill_quantization_methods(self):
            return {"q4_plugin": "json:dumps"}

    class Bad:
        @hookimpl
        def tokenmill_model_architectures(self):
            raise RuntimeError("broken plugin")

    class NotAHookspec:
        @hookimpl
        def tokenmill_no_such_hook(self):
            return {}

    fake_extensions(monkeypatch, "tokenmill.plugins", [
        ("good", "fake:Good", Good), ("bad", "fake:Bad", Bad), ("unknown_hook", "fake:NotAHookspec", NotAHookspec),
    ], [("missing", "fake_gone", ImportError("cannot import fake_gone"))])
    backends = discovery.attention_backend_classes()
    assert backends["plugin_a"] is BackendA
    assert backends["reference"].__module__ == "tokenmill.attention_backends.reference"   # built-in wins
    assert "notabackend" not in backends and "lazy" not in backends
    assert discovery.quantization_methods()["q4_plugin"] is json.dumps
    archs = discovery.extra_model_architectures()          # the raising plugin contributes nothing
    assert not any(getattr(c, "__module__", "") == __name__ for c in archs.values())
    reports = {p.name: p for p in discovery.plugin_reports()}
    assert reports["good"].loaded and "tokenmill_attention_backends" in reports["good"].hooks
    good_errors = " | ".join(reports["good"].errors)
    assert "'notabackend'" in good_errors and "clashes with the built-in" in good_errors and "tests_nowhere" in good_errors
    assert reports["bad"].errors == ["tokenmill_model_architectures raised RuntimeError: broken plugin"]
    assert not reports["unknown_hook"].loaded and "failed to register" in reports["unknown_hook"].errors[0]
    assert not reports["missing"].loaded and "cannot import fake_gone" in reports["missing"].errors[0]


def test_backend_registry_tolerates_missing_modules(monkeypatch):
    monkeypatch.setitem(discovery.BUILTIN_ATTENTION_BACKENDS, "future_kernel", "tokenmill.attention_backends.nope:X")
    monkeypatch.setitem(discovery.BUILTIN_ATTENTION_BACKENDS, "reference_by_module",
                        "tokenmill.attention_backends.reference")
    backends, errors = discovery.attention_backend_classes(), discovery.attention_backend_errors()
    assert "reference" in backends and "future_kernel" not in backends
    assert "No module named 'tokenmill.attention_backends.nope'" in errors["future_kernel"]
    assert "defines no AttentionBackend named 'reference_by_module'" in errors["reference_by_module"]


def _attn_config(**kw):
    base = dict(head_size=64, num_heads=4, num_kv_heads=2, dtype=torch.float32, device="cpu")
    base.update(kw)
    return AttentionConfig(**base)


def test_select_attention_backend():
    cpu = discovery.resolve_platform("cpu")
    assert discovery.select_attention_backend(cpu, _attn_config()).name in ("cpu_sdpa", "reference")
    assert discovery.select_attention_backend(cpu, _attn_config(), "reference").name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend 'warp'"):
        discovery.select_attention_backend(cpu, _attn_config(), "warp")
    with pytest.raises(ValueError, match="cannot run here: .*graph capture .*--enforce-eager"):
        discovery.select_attention_backend(cpu, _attn_config(graph_capture="cuda_graphs"), "reference")


def test_select_falls_back_to_eager_when_no_backend_can_be_captured(caplog):
    class OnlyReference(Platform):
        name = "onlyref"

        def attention_backends(self):
            return ["not_here", "reference"]

    with caplog.at_level(logging.WARNING, logger="tokenmill.plugins"):
        cls = discovery.select_attention_backend(OnlyReference(), _attn_config(graph_capture="cuda_graphs"))
    assert cls.name == "reference" and "without graph capture" in caplog.text


# ------------------------------------------------------------------- the third-party package

@needs_test_plugin
def test_third_party_platform_and_broken_ones():
    reports = by_name()
    test = reports["testcpu"]
    assert test.origin == "tokenmill-testplatform" and test.available and test.load_error is None
    assert test.description["attention_backends"] == ["testcpu_paged"]
    old = reports["testcpu_oldapi"]
    assert old.api_version == 999 and not old.available
    assert old.load_error == "built for platform API version 999; this tokenmill speaks version 1"
    broken = reports["testcpu_broken"]
    assert broken.origin == "tokenmill-testplatform" and not broken.available
    assert "No module named 'tokenmill_testplatform_vendor_sdk'" in broken.load_error
    with pytest.raises(ValueError, match="API version 999"):
        discovery.resolve_platform("testcpu_oldapi")
    platform = discovery.resolve_platform("testcpu")
    assert platform.name == "testcpu" and platform.device() == torch.device("cpu")


@needs_test_plugin
def test_third_party_backend_and_architecture_through_pluggy():
    backends = discovery.attention_backend_classes()
    assert backends["testcpu_paged"].__module__ == "tokenmill_testplatform.attention"
    chosen = discovery.select_attention_backend(discovery.resolve_platform("testcpu"), _attn_config())
    assert chosen is backends["testcpu_paged"]
    reports = {p.name: p for p in discovery.plugin_reports()}
    assert reports["testplatform"].loaded and reports["testplatform"].origin == "tokenmill-testplatform"
    assert {"tokenmill_attention_backends", "tokenmill_model_architectures"} <= set(reports["testplatform"].hooks)
    if importlib.util.find_spec("tokenmill.core.models.llama") is None:
        pytest.skip("tokenmill.core.models.llama not written yet")
    from tokenmill.core.models.llama import LlamaForCausalLM
    archs = discovery.extra_model_architectures()
    assert issubclass(archs["TestLlamaForCausalLM"], LlamaForCausalLM)
    assert reports["testplatform"].errors == []


def _random_batch(seed=0, block_size=4, num_blocks=32, hkv=2, group=2, d=16):
    """Mixed batch: 2 decodes then 2 prefill chunks, with shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(9, 1), (5, 1), (7, 7), (12, 5)]     # (seq_len after step, query len)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables, slots, qsl, used = [], [], [0], 0
    for seq_len, q in seqs:
        nb = -(-seq_len // block_size)
        table = perm[used:used + nb].tolist()
        used += nb
        tables.append(table + [0] * (4 - nb))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q, seq_len)]
        qsl.append(qsl[-1] + q)
    t = qsl[-1]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.tensor(slots),
        num_decodes=2, max_query_len=7, max_seq_len=12, block_size=block_size, query_start_loc_cpu=qsl,
        seq_lens_cpu=[s for s, _ in seqs])
    q = torch.randn(t, hkv * group, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g)
    return q, k, v, cache, meta


@needs_test_plugin
@pytest.mark.parametrize("window", [None, 3])
def test_third_party_attention_matches_reference(window):
    from tokenmill.attention_backends.reference import ReferenceAttention
    from tokenmill_testplatform.attention import TestPagedAttention
    q, k, v, cache, meta = _random_batch()
    kwargs = dict(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2, sliding_window=window)
    cache_ref = cache.clone()
    got = TestPagedAttention(**kwargs).forward(q, k, v, cache, meta)
    want = ReferenceAttention(**kwargs).forward(q, k, v, cache_ref, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, cache_ref)


# ------------------------------------------------------------------------- tokenmill platforms

def test_platforms_command_table(capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["platforms"]) == 0
    out = capsys.readouterr().out
    for name, report in by_name().items():
        assert name in out and report.reason in out
    assert "--device auto -> " in out
    if HAS_TEST_PLUGIN:
        assert "tokenmill-testplatform" in out and "testcpu_paged" in out and "skipped" in out


def test_platforms_command_json(capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["platforms", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {p["name"]: p for p in data["platforms"]}
    assert set(BUILTINS) <= set(names)
    cuda = names["cuda"]
    assert cuda["origin"] == "built-in" and cuda["api_version"] == 1
    assert [b["name"] for b in cuda["attention_backends"]] == ["flash_attn", "flashinfer", "triton_paged", "reference"]
    assert cuda["graph_capture"][0] == "cuda_graphs" and cuda["distributed_backend"] == "nccl"
    assert data["auto"] == discovery.resolve_platform("auto").name


# ------------------------------------------------------------------ end to end (lead's engine)

def _llm_importable() -> bool:
    try:
        import tokenmill.entrypoints.llm  # noqa: F401
        return True
    except Exception:
        return False


needs_engine = pytest.mark.skipif(not _llm_importable(), reason="tokenmill.entrypoints.llm not importable yet")
ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=32 << 20, max_num_seqs=4, seed=0)


@needs_engine
@needs_test_plugin
def test_generate_on_third_party_platform_matches_cpu():
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


@needs_engine
@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_generate_device_cuda_exits_2_with_reason(capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["generate", "--device", "cuda", "Hello"]) == 2
    err = capsys.readouterr().err
    assert f"torch {torch.__version__} was built without CUDA" in err
