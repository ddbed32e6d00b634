"""The architecture's rules, checked: import-linter's contracts (pyproject.toml) and module size."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400


def test_import_linter_contracts_hold():
    exe = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))
    assert exe, "import-linter is a test dependency (pip install -e '.[test]')"
    run = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


def test_no_module_over_400_lines():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    files = [ROOT / f for f in tracked.stdout.split()] if tracked.returncode == 0 else list(ROOT.rglob("*.py"))
    long = {str(f.relative_to(ROOT)): n for f in files
            if "tests" not in f.relative_to(ROOT).parts[:1] and ".venv" not in f.parts
            and f.is_file() and (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them along their seams): {long}"
