"""The native CPU code as one tree (issue 33): every C++ source in platforms/csrc/, all of them
including the one common header (ISA macros, bf16 rounding, AMX tiles) instead of their own
copies, and a library whose kernels need an instruction set the build target lacks refused at
build time with a reason, never built with do-nothing stand-ins."""
from __future__ import annotations

import ctypes
import platform
import re
import tomllib
from pathlib import Path

import pytest

from tokenmill.platforms import native_build
from tokenmill.platforms.native_build import COMMON_HEADER, CSRC, NativeLibrary, source

ROOT = CSRC.parents[1]           # the repository root: the tokenmill package
CPP = sorted(CSRC.glob("*.cpp"))
SOURCES = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
SKIP_DIRS = {".venv", "venv", "build", "dist", "node_modules", "__pycache__", "tokenmill.egg-info"}

# The bf16 helpers' fingerprints: the round-to-nearest-even bias, a bf16's bits widened to a
# float's, and the same on vectors. Only the common header may hold them.
BF16_HELPER = re.compile(
    r"0x7fff(?![0-9a-f])"
    r"|static_cast<uint32_t>\([^)]*\)\s*<<\s*16"
    r"|_mm512_slli_epi32\(\s*_mm512_cvtepu16_epi32"
    r"|_mm512_cvtepi32_epi16\(\s*_mm512_srli_epi32",
    re.IGNORECASE)
# A function whose body is empty or only answers false/0/-1: what a missing ISA used to compile.
STUB = re.compile(r"(\w+)\s*\([^;{}()]*\)\s*(?:const\s*)?\{\s*(?:return\s+(?:false|0|-1)\s*;\s*)?\}", re.S)
STUB_ALLOWED = {"amx_usable"}    # the capability query: false where the target has no AMX


def test_all_cpp_sources_live_in_platforms_csrc():
    outside = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts):
            continue
        if path.suffix in (".cpp", ".cc", ".cxx", ".c", ".h", ".hpp") and path.parent != CSRC:
            outside.append(str(rel))
    assert not outside, f"C/C++ sources outside {CSRC.relative_to(ROOT)}: {outside}"
    assert {p.name for p in CPP} >= {"cpu_decode_step.cpp", "cpu_kernels.cpp", "cpu_lora.cpp",
                                     "flash_prefill.cpp", "paged_decode.cpp"}


@pytest.mark.parametrize("cpp", CPP, ids=lambda p: p.name)
def test_every_cpp_includes_the_common_header(cpp: Path):
    includes = re.findall(r'^\s*#\s*include\s+"([^"]+)"', cpp.read_text(), flags=re.MULTILINE)
    assert includes and includes[0] == COMMON_HEADER.name, \
        f"{cpp.name}: its first quoted include must be {COMMON_HEADER.name}, found {includes}"
    assert all("/" not in name for name in includes), f"{cpp.name} includes across folders: {includes}"


@pytest.mark.parametrize("path", [p for p in SOURCES if p != COMMON_HEADER], ids=lambda p: p.name)
def test_no_source_has_its_own_bf16_rounding(path: Path):
    found = [m.group(0) for m in BF16_HELPER.finditer(path.read_text())]
    assert not found, f"{path.name} defines bf16 conversions of its own ({found}): use {COMMON_HEADER.name}'s"


def test_the_common_header_holds_the_helpers():
    text = COMMON_HEADER.read_text()
    for name in ("f32_to_bf16", "bf16_to_f32", "f32x16_to_bf16", "bf16x16_to_f32", "configure_tiles", "amx_ready",
                 "TM_AVX512_VNNI", "TM_AVX512_BF16", "TM_AMX_BF16", "tokenmill-refused"):
        assert name in text, name


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_do_nothing_stand_ins(path: Path):
    stubs = [m.group(1) for m in STUB.finditer(path.read_text()) if m.group(1) not in STUB_ALLOWED]
    assert not stubs, f"{path.name}: functions with an empty body or a bare false/0/-1: {stubs}"


def test_sources_are_named_through_native_build():
    from tokenmill.attention_backends import cpu_flash_prefill, cpu_paged_decode
    from tokenmill.platforms import cpu_decode_kernels, cpu_kernels, cpu_lora

    for module in (cpu_flash_prefill, cpu_paged_decode, cpu_decode_kernels, cpu_kernels, cpu_lora):
        assert module.LIBRARY.source.parent == CSRC, module.__name__
    with pytest.raises(FileNotFoundError):
        source("no_such_kernel.cpp")


def test_package_data_ships_the_tree():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["tokenmill.platforms"]
    for path in SOURCES:
        assert any(path.relative_to(CSRC.parent).match(p) for p in patterns), path.name
    assert ("tokenmill.attention_backends" not in data
            or not any("csrc" in p for p in data["tokenmill.attention_backends"]))


def test_every_library_key_covers_the_common_header(tmp_path, monkeypatch):
    for cpp in CPP:
        assert COMMON_HEADER.read_bytes() in native_build._local_includes(cpp), cpp.name
    assert (CSRC / "flash_tiles.h").read_bytes() in native_build._local_includes(source("paged_decode.cpp"))
    before = {cpp.name: native_build.build_key(cpp, "c++") for cpp in CPP}
    changed = tmp_path / COMMON_HEADER.name
    changed.write_bytes(COMMON_HEADER.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(native_build, "COMMON_HEADER", changed)
    after = {cpp.name: native_build.build_key(cpp, "c++") for cpp in CPP}
    assert all(before[name] != after[name] for name in before)


needs_x86_compiler = pytest.mark.skipif(
    native_build._compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs a C++ compiler for x86-64")


@needs_x86_compiler
@pytest.mark.parametrize("name, flag, isa", [("flash_prefill.cpp", "-mno-avx512bf16", "AVX512-BF16"),
                                             ("cpu_decode_step.cpp", "-mno-avx512vnni", "AVX512-VNNI"),
                                             ("cpu_decode_step.cpp", "-mno-avx512f", "AVX512-VNNI")])
def test_a_missing_isa_is_a_build_time_refusal_with_a_reason(tmp_path, monkeypatch, name, flag, isa):
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(native_build.DISABLE_ENV, "1")
    declared = []
    library = NativeLibrary(source(name), 0, declared.append, extra_flags=(flag,))
    lib, why = library.load()                  # no exception: a reason
    assert lib is None and declared == []
    assert why == f"the build target (-march=native {flag}) has no {isa}", why
    assert library.available() == why
    assert not list(tmp_path.glob("*.so")), "a refused library must not be built"
    with pytest.raises(RuntimeError, match=isa):
        library.require()


@needs_x86_compiler
def test_without_avx512_bf16_paged_prefill_answers_does_not_run(tmp_path, monkeypatch):
    """paged_decode builds anywhere (float32 loops); its bf16-tile entries then say -1 (the
    caller keeps its flash path) instead of returning with nothing done."""
    import torch

    from tokenmill.attention_backends import cpu_paged_decode as pd

    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(native_build.DISABLE_ENV, "1")
    library = NativeLibrary(source("paged_decode.cpp"), pd.ABI_VERSION, pd._declare, extra_flags=("-mno-avx512bf16",))
    lib, why = library.load()
    assert why is None
    kv = torch.zeros(2, 4, 16, 1, 64, dtype=torch.bfloat16)
    q = torch.ones(3, 2, 64)
    out = torch.full_like(q, 7.0)
    tables, lens = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    starts = torch.tensor([0, 3])
    rc = lib.paged_prefill_bf16kv(q.data_ptr(), 128, 0, kv.data_ptr(), tables.data_ptr(), 4, lens.data_ptr(),
                                  starts.data_ptr(), out.data_ptr(), 1, 2, 1, 64, 16, 4, 0.125, 1.0, 1.0)
    assert rc == -1 and bool((out == 7.0).all())
    decoded = torch.empty(1, 2, 64)
    lib.paged_decode_bf16kv(q[:1].contiguous().data_ptr(), kv.data_ptr(), tables.data_ptr(), 4, lens.data_ptr(),
                            decoded.data_ptr(), 1, 2, 1, 64, 16, 4, 0.125, 0, 0, None, 1.0, 1.0)
    assert torch.equal(decoded, torch.zeros(1, 2, 64))      # attention over zero values: zeros, computed
    assert isinstance(lib, ctypes.CDLL)
