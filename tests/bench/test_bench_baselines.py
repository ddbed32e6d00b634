"""`tokenmill bench throughput --baseline vllm|llamacpp` and `--plot`: the spec and the runner contract
(with a stand-in runner under this interpreter), the failure paths, and, where the venvs that
shared/baselines/setup_*.sh build exist, one real run against each engine."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import re
import sys
import textwrap

import pytest

from tokenmill.entrypoints.baselines import external as ext
from tokenmill.entrypoints.baselines.plot import plot_results
from tokenmill.entrypoints.cli import main
from tokenmill.entrypoints.workloads import build_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One thread: on a shared 2-core machine two spin-waiting threads run several times slower.
SMALL_ENGINE = ["--device", "cpu", "--num-threads", "1", "--max-model-len", "1024", "--kv-cache-memory", str(128 << 20)]

# Imitates a runner's output contract; copies the spec it got to $FAKE_SPEC_COPY; with $FAKE_CRASH_AFTER=N it
# writes N workloads, then dies with a traceback.
FAKE_RUNNER = textwrap.dedent('''
    import json, os, sys
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = json.load(open(spec_path))
    if os.environ.get("FAKE_SPEC_COPY"):
        json.dump(spec, open(os.environ["FAKE_SPEC_COPY"], "w"))
    crash_after = int(os.environ.get("FAKE_CRASH_AFTER", "-1"))
    out = {"engine": "fake-engine 1.0", "engine_version": "1.0", "threads": spec["threads"],
           "dtype": spec["dtype"], "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")},
           "workloads": {}}
    for i, w in enumerate(spec["workloads"]):
        if i == crash_after:
            raise RuntimeError("fake engine fell over")
        n_prompt = sum(map(len, w["prompts"])); n_gen = w["output_len"] * len(w["prompts"])
        out["workloads"][w["name"]] = {"requests": len(w["prompts"]), "prompt_tokens": n_prompt,
            "output_tokens": n_gen, "seconds": 0.5, "runs": [0.5] * spec["repeat"],
            "output_tok_s": n_gen / 0.5, "total_tok_s": (n_prompt + n_gen) / 0.5}
        json.dump(out, open(out_path, "w"))
''')


@pytest.fixture
def fake_runner(tmp_path) -> str:
    path = tmp_path / "fake_runner.py"
    path.write_text(FAKE_RUNNER)
    return str(path)


def _small(name: str, n: int):
    w = build_workload(name)
    return type(w)(w.name, w.description, w.prompts[:n], w.output_len)


def test_warmup_prompts_have_the_same_shapes_and_other_ids():
    w = _small("W3", 3)
    warm = [ext.warmup_prompt(p) for p in w.prompts]
    assert [len(p) for p in warm] == [len(p) for p in w.prompts]
    assert all(1000 <= t < 40000 for p in warm for t in p)
    assert all(a != b for p, q in zip(w.prompts, warm) for a, b in zip(p, q))
    assert warm[0][:512] == warm[1][:512] and warm[0][512:] != warm[1][512:]   # the prefix stays shared


def test_spec_carries_the_prompts_tokenmill_runs():
    workloads = [_small("W2", 1), _small("W3", 2)]
    spec = ext.build_spec("vllm", "/m", workloads, repeat=3, threads=2, dtype=None, prefix_caching=True)
    json.dumps(spec)
    assert spec["dtype"] == "bfloat16" and spec["repeat"] == 3 and spec["threads"] == 2 and spec["prefix_caching"]
    assert [w["name"] for w in spec["workloads"]] == ["W2", "W3"]
    for s, w in zip(spec["workloads"], workloads):
        assert s["prompts"] == w.prompts and s["output_len"] == w.output_len
        assert s["warmup_prompts"] == [ext.warmup_prompt(p) for p in w.prompts]
    assert ext.build_spec("llamacpp", "/m.gguf", workloads, repeat=1, threads=1, dtype=None,
                          prefix_caching=False)["dtype"] is None


def test_runner_env(tmp_path):
    gomp = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "torch" / "lib" / "libgomp.so.1"
    gomp.parent.mkdir(parents=True)
    gomp.write_bytes(b"")
    python = str(tmp_path / "venv" / "bin" / "python")
    env = ext.runner_env("vllm", python, 2, base={"PATH": "/bin"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["LD_PRELOAD"] == str(gomp) and env["PATH"] == "/bin"
    assert ext.runner_env("vllm", python, 1, base={})["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert ext.runner_env("vllm", python, 2, base={"VLLM_CPU_KVCACHE_SPACE": "8"})["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert "LD_PRELOAD" not in ext.runner_env("vllm", "/nowhere/bin/python", 2, base={})
    assert ext.runner_env("llamacpp", python, 2, base={"A": "1"}) == {"A": "1"}


def test_resolve_model(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert ext.resolve_model("vllm", None, None) == ext.DEFAULT_VLLM_MODEL
    assert ext.resolve_model("vllm", None, str(gguf)) == ext.DEFAULT_VLLM_MODEL
    assert ext.resolve_model("vllm", None, str(tmp_path)) == str(tmp_path)
    assert ext.resolve_model("llamacpp", None, str(gguf)) == str(gguf)
    assert ext.resolve_model("llamacpp", str(gguf), str(tmp_path)) == str(gguf)
    with pytest.raises(ValueError, match="--baseline-model"):
        ext.resolve_model("llamacpp", None, str(tmp_path))


@pytest.mark.parametrize("name", ["vllm_runner.py", "llamacpp_runner.py"])
def test_runners_import_no_tokenmill(name):
    tree = ast.parse((pathlib.Path(ext.HERE) / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("tokenmill"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("tokenmill") for a in node.names)


def test_missing_interpreter_is_an_error_not_an_exception(tmp_path):
    spec = ext.build_spec("vllm", str(tmp_path), [_small("W2", 1)], repeat=1, threads=2, dtype=None,
                          prefix_caching=True)
    r = ext.run_baseline("vllm", str(tmp_path / "no" / "python"), spec)
    assert not r.ok and "not found" in r.error and "--baseline-python" in r.error
    r = ext.run_baseline("vllm", sys.executable, {**spec, "model": str(tmp_path / "nothing")})
    assert not r.ok and "--baseline-model" in r.error


def test_crash_keeps_finished_workloads_and_the_stderr(tmp_path, fake_runner, monkeypatch):
    monkeypatch.setenv("FAKE_CRASH_AFTER", "1")
    workloads = [_small("W2", 1), _small("W3", 2)]
    spec = ext.build_spec("llamacpp", str(tmp_path), workloads, repeat=1, threads=2, dtype=None, prefix_caching=True)
    r = ext.run_baseline("llamacpp", sys.executable, spec, runner=fake_runner)
    assert not r.ok and "exited with status 1" in r.error
    assert "fake engine fell over" in r.stderr_tail and list(r.workloads) == ["W2"]
    results = {"workloads": {w.name: {"tokenmill": {"output_tok_s": 10.0, "total_tok_s": 20.0}} for w in workloads}}
    ext.attach(results, r)
    assert results["workloads"]["W2"]["baseline"]["ratio_output_tok_s"] == pytest.approx(10.0 / 512)
    assert "error" in results["workloads"]["W3"]["baseline"] and results["baseline"]["ok"] is False
    lines = ext.report_lines(results, r)
    assert lines[0].startswith("baseline llamacpp FAILED: ") and any("fell over" in line for line in lines)
    assert any(line.startswith("W3 fake-engine 1.0: no result") for line in lines)


@pytest.mark.parametrize("sig", ["SIGILL", "SIGSEGV"])
def test_a_runner_killed_by_a_signal(tmp_path, sig):
    """llama.cpp's AMX matmul dies by either on some AMX VMs: the error says what to try."""
    runner = tmp_path / "dies.py"
    runner.write_text("import os, signal, sys\nprint('about to die', file=sys.stderr, flush=True)\n"
                      f"os.kill(os.getpid(), signal.{sig})\n")
    spec = ext.build_spec("llamacpp", str(tmp_path), [_small("W2", 1)], repeat=1, threads=2, dtype=None,
                          prefix_caching=True, extra_bufts=False)
    assert spec["extra_bufts"] is False
    r = ext.run_baseline("llamacpp", sys.executable, spec, runner=str(runner))
    assert not r.ok and f"killed by {sig}" in r.error and "--baseline-no-extra-bufts" in r.error
    assert "-DGGML_NATIVE=OFF" in r.error
    assert "about to die" in r.stderr_tail


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is importable here")
def test_real_runner_without_its_engine_reports_the_import_error(tmp_path):
    spec = ext.build_spec("vllm", str(tmp_path), [_small("W2", 1)], repeat=1, threads=2, dtype=None,
                          prefix_caching=True)
    r = ext.run_baseline("vllm", sys.executable, spec, timeout=120)
    assert not r.ok and "No module named 'vllm'" in r.stderr_tail


def test_plot_is_skipped_with_a_message_without_matplotlib(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    results = {"workloads": {"W2": {"tokenmill": {"output_tok_s": 1.0, "total_tok_s": 2.0}}}}
    message = plot_results(results, str(tmp_path / "p.png"))
    assert "matplotlib is not installed" in message and not (tmp_path / "p.png").exists()


def test_bench_with_a_stand_in_baseline(tmp_path, fake_runner, monkeypatch, capsys):
    copy, out, png = tmp_path / "spec.json", tmp_path / "r.json", tmp_path / "p.png"
    monkeypatch.setenv("FAKE_SPEC_COPY", str(copy))
    code = main(["bench", "throughput", "--workload", "W3", "--num-requests", "2", "--baseline", "vllm",
                 "--baseline-python", sys.executable, "--baseline-runner", fake_runner,
                 "--baseline-model", str(tmp_path), "--json", str(out), "--plot", str(png), *SMALL_ENGINE])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert re.search(r"^W3 \(shared prefix \(prefix caching\)\): 2 requests, .* output tok/s", printed, re.M), printed
    assert re.search(r"^W3 fake-engine 1.0 \(2 threads, bfloat16\): 2 requests, 0.50s, 128.0 output tok/s, "
                     r"2304.0 total tok/s$", printed, re.M), printed
    assert re.search(r"^W3 ratio tokenmill / vLLM: \d+\.\d\dx output tok/s, \d+\.\d\dx total tok/s$", printed, re.M)
    spec = json.loads(copy.read_text())
    assert spec["workloads"][0]["prompts"] == build_workload("W3").prompts[:2]
    assert spec["model"] == str(tmp_path) and spec["dtype"] == "bfloat16" and spec["prefix_caching"] is True
    result = json.loads(out.read_text())
    entry = result["workloads"]["W3"]
    assert entry["baseline"]["output_tok_s"] == 128.0
    assert entry["baseline"]["ratio_output_tok_s"] == pytest.approx(entry["tokenmill"]["output_tok_s"] / 128.0)
    assert result["baseline"]["ok"] and result["baseline"]["engine_version"] == "1.0"
    assert result["baseline"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    # what docs/benchmarks.md shows beside the figures (entrypoints/bench_report.py)
    assert result["command"].startswith("tokenmill bench throughput --workload W3 --num-requests 2 ")
    assert result["host"]["cores"] >= 1 and result["date"]
    if importlib.util.find_spec("matplotlib") is None:
        assert "--plot skipped: matplotlib is not installed" in printed and not png.exists()
    else:
        assert f"plot written to {png}" in printed and png.read_bytes()[:8] == PNG_MAGIC


def test_bench_reports_a_missing_baseline_and_keeps_its_numbers(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "throughput", "--workload", "W3", "--num-requests", "2", "--baseline", "llamacpp",
                 "--baseline-python", str(tmp_path / "nowhere" / "python"), "--json", str(out), *SMALL_ENGINE])
    printed = capsys.readouterr().out
    assert code == 3, printed
    assert re.search(r"^W3 \(shared prefix \(prefix caching\)\): 2 requests, .* output tok/s", printed, re.M), printed
    assert f"baseline llamacpp FAILED: baseline interpreter {tmp_path}/nowhere/python not found" in printed
    result = json.loads(out.read_text())
    assert result["workloads"]["W3"]["tokenmill"]["output_tok_s"] > 0
    assert "not found" in result["workloads"]["W3"]["baseline"]["error"] and result["baseline"]["ok"] is False


# --- the real engines, where shared/baselines/setup_vllm.sh and setup_llamacpp.sh have built them ---------------
# Opt-in (TOKENMILL_BASELINE_TESTS=1): together they take minutes, too long for every CI run.
REAL = os.environ.get("TOKENMILL_BASELINE_TESTS") == "1"


@pytest.mark.skipif(not REAL or not os.path.exists(ext.DEFAULT_PYTHON["vllm"])
                    or not os.path.isdir(ext.DEFAULT_VLLM_MODEL),
                    reason="set TOKENMILL_BASELINE_TESTS=1, with a vLLM venv (shared/baselines/setup_vllm.sh)")
def test_real_vllm_baseline_w2(tmp_path, capsys):
    _real_run("vllm", tmp_path, capsys)


@pytest.mark.skipif(not REAL or not os.path.exists(ext.DEFAULT_PYTHON["llamacpp"]),
                    reason="set TOKENMILL_BASELINE_TESTS=1, with a llama.cpp venv (shared/baselines/setup_llamacpp.sh)")
def test_real_llamacpp_baseline_w2(tmp_path, capsys):
    # Without llama.cpp's extra buffer types: the -march=native build of setup_llamacpp.sh dies with SIGILL in its
    # AMX kernels on some AMX machines (a VM here); the plain CPU path runs on any build.
    _real_run("llamacpp", tmp_path, capsys, "--baseline-no-extra-bufts")


def _real_run(engine: str, tmp_path, capsys, *extra: str):
    out = tmp_path / "r.json"
    # One thread each, like tokenmill's here: two spinning OpenMP threads on a shared 2-core machine run many times
    # slower (llama.cpp's barrier most of all).
    code = main(["bench", "throughput", "--workload", "W2", "--num-requests", "1", "--baseline", engine,
                 "--baseline-threads", "1", "--json", str(out), *extra, *SMALL_ENGINE])
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0, printed
    assert re.search(rf"^W2 ratio tokenmill / {ext.LABELS[engine]}: \d+\.\d\dx output tok/s", printed, re.M), printed
    result = json.loads(out.read_text())
    b = result["workloads"]["W2"]["baseline"]
    assert b["output_tokens"] == 256 and b["prompt_tokens"] == 128 and b["output_tok_s"] > 0
    assert result["baseline"]["engine_version"] and result["baseline"]["threads"] == 1


def test_workloads_are_named_one_all_or_in_a_comma_separated_list():
    from tokenmill.entrypoints.workloads import workload_names
    known = ("W1", "W2", "W3", "W4", "W5")
    assert workload_names("W1,W2,w4", known) == ["W1", "W2", "W4"]
    assert workload_names("all", known) == ["W1", "W2", "W3", "W4"]
    assert workload_names("W5, W5", known) == ["W5"]
    with pytest.raises(SystemExit, match="comma-separated list of them; got 'W1,W9'"):
        workload_names("W1,W9", known)
