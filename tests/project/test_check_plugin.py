"""The conformance kit: `tokenmill check-plugin NAME` and `pytest --tokenmill-plugin NAME` on the
test plugins -- the good ones pass, the broken ones fail with their reasons."""
from __future__ import annotations

import json
import subprocess
import sys

from tokenmill.entrypoints.cli import main


def _rows(capsys) -> dict[str, dict]:
    return {r["check"]: r for r in json.loads(capsys.readouterr().out)}


def test_check_plugin_test_platform_passes_everything(test_plugins, capsys):
    assert main(["check-plugin", "testcpu", "--json"]) == 0
    rows = _rows(capsys)
    assert list(rows) == ["registered", "api_version", "probe", "describe", "attention_matrix",
                          "memory_profiler", "greedy_tokens"]
    assert all(r["status"] == "pass" for r in rows.values()), rows
    assert "identical to --device cpu" in rows["greedy_tokens"]["detail"]


def test_check_plugin_backends(test_plugins, capsys):
    assert main(["check-plugin", "testcpu_paged", "--skip-generate", "--json"]) == 0
    assert all(r["status"] == "pass" for r in _rows(capsys).values())
    assert main(["check-plugin", "broken_lastblock", "--skip-generate"]) == 1
    out = capsys.readouterr().out
    assert "attention_matrix  FAIL" in out and "seq" in out


def test_check_plugin_refused_and_unknown(test_plugins, capsys):
    assert main(["check-plugin", "testcpu_oldapi", "--json"]) == 1
    rows = _rows(capsys)
    assert rows["registered"]["status"] == "fail" and "API version 999" in rows["registered"]["detail"]
    assert {r["status"] for c, r in rows.items() if c != "registered"} == {"skip"}
    assert main(["check-plugin", "warp9"]) == 2
    assert "neither a platform nor an attention backend" in capsys.readouterr().err


def test_pytest_entry_point(test_plugins, tmp_path):
    def pytest_run(*names: str) -> subprocess.CompletedProcess:
        args = [a for n in names for a in ("--tokenmill-plugin", n)]
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                               "-k", "not greedy_tokens", str(tmp_path)], capture_output=True, text=True,
                              cwd=tmp_path, timeout=600)
    good = pytest_run("testcpu_paged")
    assert good.returncode == 0 and "4 passed, 1 deselected" in good.stdout, good.stdout + good.stderr
    bad = pytest_run("broken_lastblock")
    assert bad.returncode == 1 and "check_plugin[broken_lastblock]::attention_matrix" in bad.stdout
