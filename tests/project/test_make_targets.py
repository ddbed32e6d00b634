"""The README's two commands: `make serve` installs what serving needs and nothing of the test extra;
`make test` adds it (dry runs of make, no installs)."""
from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def dry_run(target: str, tmp_path: Path) -> str:
    venv = tmp_path / "venv"        # a venv that does not exist: make lists every install step
    return subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def test_make_serve_installs_only_the_runtime_dependencies(tmp_path):
    commands = dry_run("serve", tmp_path)
    installs = [line for line in commands.splitlines() if " install " in line and "pip" in line]
    assert any(line.rstrip().endswith("install -q -e .") for line in installs), installs
    assert not any("[test]" in line for line in installs), installs
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    for requirement in test_extra:
        name = requirement.split(">")[0].split("=")[0].split("<")[0]
        assert not any(f" {name}" in line for line in installs), (name, installs)


def test_make_test_adds_the_test_extra(tmp_path):
    assert "install -q -e '.[test]'" in dry_run("test", tmp_path)


def test_make_test_lints_before_the_suite(tmp_path):
    """ruff over the tree and mypy over the seams (both configured in pyproject.toml) run first."""
    lines = dry_run("test", tmp_path).splitlines()
    ruff = next(i for i, line in enumerate(lines) if line.endswith("/bin/ruff check ."))
    mypy = next(i for i, line in enumerate(lines) if line.endswith("/bin/mypy"))
    pytest_ = next(i for i, line in enumerate(lines) if " -m pytest " in line)
    assert ruff < pytest_ and mypy < pytest_
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(r.startswith("ruff") for r in test_extra) and any(r.startswith("mypy") for r in test_extra)
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
