"""The pluggy hooks the engine calls with arguments: request lifecycle events and config
validation; their built-in consumers; a third-party subscriber; refusals."""
from __future__ import annotations

import importlib.metadata
import logging

import pytest

from tokenmill.core.config import EngineConfig
from tokenmill.plugins import discovery, hooks, registry
from tokenmill.plugins.hookspecs import RequestEvent, hookimpl


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("TOKENMILL_LOG_REQUESTS", raising=False)
    monkeypatch.setattr(hooks, "_EXTRA_BUILTINS", {})
    discovery.clear_caches()
    yield
    discovery.clear_caches()


def test_no_subscriber_means_no_emitter():
    assert hooks.request_event_emitter() is None
    names = {r.name: r for r in hooks.hook_reports()}
    assert names["config_sanity"].loaded and names["config_sanity"].package == "tokenmill"
    assert "request_log" not in names


def test_request_log_subscriber(monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_LOG_REQUESTS", "1")
    discovery.clear_caches()
    emit = hooks.request_event_emitter()
    assert emit is not None
    with caplog.at_level(logging.INFO, logger="tokenmill.requests"):
        emit(RequestEvent("arrived", "r1", time=100.0, num_prompt_tokens=5))
        emit(RequestEvent("first_token", "r1", time=100.5, num_prompt_tokens=5, num_output_tokens=1))
        emit(RequestEvent("finished", "r1", time=102.25, num_prompt_tokens=5, num_output_tokens=8,
                          finish_reason="length"))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "tokenmill.requests"]
    assert line == ("request r1 finished: 5 prompt tokens, 8 output tokens, finish reason length, e2e 2.250s")


def test_subscribers_run_in_order_and_a_raising_one_does_not_stop_others(caplog):
    seen = []

    class Raises:
        @hookimpl
        def tokenmill_request_event(self, event):
            raise RuntimeError("boom")

    class Records:
        @hookimpl
        def tokenmill_request_event(self, event):
            seen.append(event.kind)

    hooks.register_builtin(Raises(), "raises")
    hooks.register_builtin(Records, "records")      # a class is instantiated once
    emit = hooks.request_event_emitter()
    with caplog.at_level(logging.WARNING, logger="tokenmill.plugins"):
        emit(RequestEvent("arrived", "a"))
        emit(RequestEvent("aborted", "a", finish_reason="abort"))
    assert seen == ["arrived", "aborted"]
    assert caplog.text.count("raised RuntimeError: boom") == 1       # logged once
    discovery.clear_caches()                                         # built-ins survive a rescan
    assert {"raises", "records"} <= {r.name for r in hooks.hook_reports() if r.loaded}


def test_validate_config():
    hooks.validate_config(EngineConfig())                            # defaults are fine
    bad = EngineConfig.from_kwargs(num_gpu_blocks_override=8, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="invalid configuration: num_gpu_blocks_override and kv_cache_memory"):
        hooks.validate_config(bad)
    unchunked = EngineConfig.from_kwargs(enable_chunked_prefill=False, max_num_batched_tokens=512,
                                         max_model_len=2048)
    with pytest.raises(ValueError, match="long prompts could never be scheduled"):
        hooks.validate_config(unchunked)

    class Picky:
        @hookimpl
        def tokenmill_validate_config(self, config):
            return ["seed must be 7"] if config.model.seed != 7 else []

    class Broken:
        @hookimpl
        def tokenmill_validate_config(self, config):
            raise KeyError("oops")

    hooks.register_builtin(Picky(), "picky")
    hooks.register_builtin(Broken(), "broken")
    with pytest.raises(ValueError, match="seed must be 7"):
        hooks.validate_config(EngineConfig())
    hooks.validate_config(EngineConfig.from_kwargs(seed=7))          # the broken validator is skipped


def test_hook_entry_points_refused_with_reasons(monkeypatch):
    class UnknownHook:
        @hookimpl
        def tokenmill_no_such_hook(self):
            pass

    class Future:
        api_version = 3

        @hookimpl
        def tokenmill_request_event(self, event):
            pass

    real = registry._extensions

    def patched(group):
        got, failed = real(group)
        if group == "tokenmill.hooks":
            ep = lambda n: importlib.metadata.EntryPoint(n, f"fake:{n}", group)   # noqa: E731
            return (got + [(ep("unknown"), UnknownHook), (ep("future"), Future)],
                    failed + [(ep("missing"), ImportError("cannot import fake_gone"))])
        return got, failed
    monkeypatch.setattr(registry, "_extensions", patched)
    reports = {r.name: r for r in hooks.hook_reports()}
    assert "does not define: tokenmill_no_such_hook" in reports["unknown"].reason
    assert reports["future"].reason == "built for hook API version 3; this tokenmill speaks version 1"
    assert "cannot import fake_gone" in reports["missing"].reason
    assert not any(reports[n].loaded for n in ("unknown", "future", "missing"))
    assert hooks.request_event_emitter() is None


def test_third_party_subscriber(test_plugins):
    from tokenmill_testplatform.hooks import EVENTS
    emit = hooks.request_event_emitter()
    emit(RequestEvent("scheduled", "x"))
    assert EVENTS[-1].kind == "scheduled" and EVENTS[-1].request_id == "x"
