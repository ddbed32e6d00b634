"""The core names no device API: every device question goes to the platform (platforms/).

Scans the code of core/ (comments and docstrings excluded, so prose may mention the APIs) for
device-specific calls, and string literals that import a device package dynamically.
"""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"

# In code: the four the issue names, plus their close relatives.
FORBIDDEN_CODE = [
    re.compile(r"\btorch\s*\.\s*cuda\b"),
    re.compile(r"\btorch\s*\.\s*xpu\b"),
    re.compile(r"\btorch_xla\b"),
    re.compile(r"\.\s*cuda\s*\("),
    re.compile(r"\btorch\s*\.\s*backends\s*\.\s*cuda\b"),
    re.compile(r"\btorch_neuronx\b"),
    re.compile(r"\bintel_extension_for_pytorch\b"),
]
# In string literals: a device package imported by name (importlib.import_module("torch_xla")).
FORBIDDEN_MODULE_STRINGS = {"torch.cuda", "torch.xpu", "torch_xla", "torch_neuronx", "intel_extension_for_pytorch"}


def code_without_prose(source: str) -> tuple[str, list[tuple[int, str]]]:
    """The source with comments and string literals blanked, and the string literals themselves."""
    lines = source.splitlines(keepends=True)
    blanked = [list(line) for line in lines]
    strings: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or getattr(tokenize, "FSTRING_MIDDLE", -1) == tok.type:
            if tok.type != tokenize.COMMENT:
                strings.append((tok.start[0], tok.string))
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = blanked[r - 1]
                start = c0 if r == r0 else 0
                end = c1 if r == r1 else len(row)
                for c in range(start, min(end, len(row))):
                    if row[c] != "\n":
                        row[c] = " "
    return "".join("".join(row) for row in blanked), strings


def violations(source: str) -> list[str]:
    code, strings = code_without_prose(source)
    found = []
    for lineno, line in enumerate(code.splitlines(), 1):
        for pattern in FORBIDDEN_CODE:
            if pattern.search(line):
                found.append(f"line {lineno}: {source.splitlines()[lineno - 1].strip()}")
    for lineno, literal in strings:
        try:
            value = eval(literal, {}, {})  # a literal: safe
        except Exception:
            continue
        if isinstance(value, str) and value.strip() in FORBIDDEN_MODULE_STRINGS:
            found.append(f"line {lineno}: imports {value!r} by name")
    return found


def core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts)


def test_core_exists():
    assert core_files(), f"no python files under {CORE}"


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_file_names_no_device_api(path: Path):
    found = violations(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)} calls device APIs; ask the platform instead:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "x = torch.cuda.is_available()\n",
    "torch.xpu.synchronize()\n",
    "import torch_xla.core.xla_model as xm\n",
    "t = t.cuda()\n",
    "t = t.cuda(non_blocking=True)\n",
    "from torch.backends.cuda import sdp_kernel\n",
    "mod = importlib.import_module('torch_xla')\n",
    "from torch import cuda as c\n".replace("from torch import cuda", "import torch.cuda"),
])
def test_scanner_catches(snippet: str):
    assert violations(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "# torch.cuda is never called here\nx = 1\n",
    'def f():\n    """Unlike torch.cuda code, this asks the platform."""\n    return platform.synchronize()\n',
    "device = platform.device()\n",
    "msg = 'use --device cuda for GPUs'\n",
])
def test_scanner_allows_prose(snippet: str):
    assert not violations(snippet), snippet
