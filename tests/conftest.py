"""Fixtures shared by the test modules.

The test plugin packages (tests/plugins/*) are deliberately broken in places, so they are
never installed into the environment tokenmill runs from: `test_plugins` installs them once per
session into a directory of its own and puts that directory on sys.path (for this process) and
PYTHONPATH (for subprocesses) for the tests that ask for it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when it is first imported, and many packages import it
# (peft, sentence-transformers, transformers kernels). Without a GPU its kernels can only run in
# the interpreter, so it is set before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
TEST_PLUGIN_SOURCES = [TESTS / "plugins" / "tokenmill_testplatform", TESTS / "plugins" / "tokenmill_brokenbackend"]


def pip_install_target(sources: list[Path], target: Path) -> None:
    """Install packages (not editable, no dependencies: tokenmill is already here) into `target`."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--disable-pip-version-check", "--target", str(target), *map(str, sources)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")


@pytest.fixture
def use_plugin_dir(monkeypatch) -> Callable[[Path], None]:
    """Make the plugins installed in a directory visible: to discovery here, and to subprocesses."""
    from tokenmill.plugins import discovery

    def use(directory: Path) -> None:
        monkeypatch.syspath_prepend(str(directory))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            filter(None, [str(directory), os.environ.get("PYTHONPATH", "")])))
        discovery.clear_caches()

    yield use
    discovery.clear_caches()


@pytest.fixture(scope="session")
def pip_install() -> Callable[[list[Path], Path], None]:
    """pip_install_target, for test modules (which cannot import conftest)."""
    return pip_install_target


@pytest.fixture(scope="session")
def test_plugins_dir(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("tokenmill-test-plugins")
    pip_install_target(TEST_PLUGIN_SOURCES, target)
    return target


@pytest.fixture
def test_plugins(test_plugins_dir: Path, use_plugin_dir) -> Path:
    """The test plugins (tokenmill-testplatform, tokenmill-brokenbackend), installed and visible."""
    use_plugin_dir(test_plugins_dir)
    return test_plugins_dir


# ==================================================================== server tests
# (test_server*.py, test_bench_serve.py) — owned by the server side of Architecture v2.
# A module that asks for `server` declares SERVER_ARGS (and optionally SERVER_ENV);
# TOKENMILL_TEST_FAKE_ENGINE=1 serves the fake engine (entrypoints/openai/testing.py) instead
# of the default model.
FAKE_ENGINE = os.environ.get("TOKENMILL_TEST_FAKE_ENGINE") == "1"


@pytest.fixture(scope="module")
def server(request):
    """One `tokenmill serve` for the whole module, on a free loopback port; always stopped."""
    from tokenmill.entrypoints.openai.testing import ServerProcess
    module = request.module
    with ServerProcess(list(module.SERVER_ARGS), env=getattr(module, "SERVER_ENV", None),
                       fake_engine=FAKE_ENGINE) as srv:
        yield srv
