"""Native C++ kernels built on first use with the system compiler and loaded through ctypes.

One helper for every leaf that ships C++: the cpu platform's kernels and cpu_sdpa's attention
kernels, all in one folder, platforms/csrc/, each .cpp a library of its own and every one
including the common header platforms/csrc/tokenmill_cpu.h (ISA checks, bf16 rounding, AMX
tiles). It holds no kernel and imports nothing of tokenmill's, which is why attention_backends/
may import it like an interface module; they name their sources with `source("paged_decode.cpp")`.

Why not a torch C++ extension: compiling against torch's headers takes a minute on a 2-core
machine; these sources have no torch dependency and build in about a second, once per machine
(cached under ~/.cache/tokenmill/kernels, keyed by source, flags, compiler and CPU flags, since
they are built with -march=native). Without a compiler, or with TOKENMILL_CPU_KERNELS=0, callers
fall back to their pure-torch path; `load()` says why.

A library whose kernels need an instruction set this CPU lacks is refused at build time, never
built with functions that do nothing: its source asks tokenmill_cpu.h for the ISA, the compile
stops at `#error "tokenmill-refused: AVX512-BF16"`, and `load()` reports "this CPU has no
AVX512-BF16" (logged once, at INFO) so the callers take their torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

logger = logging.getLogger("tokenmill.native")

DISABLE_ENV = "TOKENMILL_CPU_KERNELS"
# -ffast-math at compile time only: it lets gcc call glibc's vectorized expf. (At link time it
# would add crtfastmath.o, which flips the whole process to flush-denormals-to-zero.)
# No peeling loops to align pointers: where a vectorized reduction starts its vector part would
# then depend on the heap address of the buffer, and the same row could round differently from
# one call to the next (unaligned 512-bit loads cost nothing measurable here).
# -Wfatal-errors: a refused build (see REFUSED) stops at its #error, in milliseconds.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17",
                 "--param=vect-max-peeling-for-alignment=0", "-Wfatal-errors")
LINK_FLAGS = ("-shared", "-fopenmp")


# Every CPU kernel source, and the one header they all include (ISA checks, bf16 rounding, AMX
# tiles); attention backends name their sources through `source()`, not a path into this package.
CSRC = Path(__file__).with_name("csrc")
COMMON_HEADER = CSRC / "tokenmill_cpu.h"


# What tokenmill_cpu.h's #error says when the build target lacks an ISA a library requires.
REFUSED = re.compile(r"tokenmill-refused: ([A-Za-z0-9_-]+)")


def source(name: str) -> Path:
    """The path of the kernel source `name` (a file of platforms/csrc/)."""
    path = CSRC / name
    if not path.is_file():
        raise FileNotFoundError(f"no native kernel source {name!r} in {CSRC}")
    return path


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") == "0"


def _cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _local_includes(source: Path) -> list[bytes]:
    """The bytes of the headers `source` includes with quotes (relative to the including file's
    directory), and theirs in turn, each once, so a change to a shared header rebuilds every
    library that includes it, directly or not."""
    found: list[bytes] = []
    seen: set[Path] = set()
    pending = [source]
    while pending:
        current = pending.pop(0)
        names = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', current.read_bytes(), flags=re.MULTILINE)
        for name in names:
            header = (current.parent / name.decode()).resolve()
            if header not in seen:
                seen.add(header)
                found.append(header.read_bytes())
                pending.append(header)
    return found


def build_key(source: Path, compiler: str, compile_flags: tuple[str, ...] = COMPILE_FLAGS) -> str:
    """The cache key of `source`'s library: its bytes, its quoted includes, the common header
    (always, whatever the source includes), flags, compiler and this CPU's flags."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), *_local_includes(source), COMMON_HEADER.read_bytes(),
                 " ".join(compile_flags + LINK_FLAGS).encode(), compiler.encode(), _cpu_flags().encode()):
        key.update(part)
    return key.hexdigest()[:16]


def _build(compiler: str, source: Path, target: Path, compile_flags: tuple[str, ...] = COMPILE_FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj = Path(tmp) / "kernels.o"
        lib = Path(tmp) / target.name
        subprocess.run([compiler, *compile_flags, "-c", str(source), "-o", str(obj)],
                       check=True, capture_output=True, text=True, timeout=300)
        subprocess.run([compiler, *LINK_FLAGS, str(obj), "-o", str(lib)],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(lib, target)      # atomic: concurrent builders never see half a library


class NativeLibrary:
    """One C++ source file as a lazily built shared library.

    The source must export `int tokenmill_kernels_abi_version()`; `declare` sets the ctypes
    signatures of its other functions. `extra_flags` go after COMPILE_FLAGS (e.g. "-mno-avx512bf16"
    to build as for a CPU without an instruction set: tests of the refusal path).
    """

    def __init__(self, source: Path, abi_version: int, declare: Callable[[ctypes.CDLL], None],
                 extra_flags: tuple[str, ...] = ()) -> None:
        self.source = source
        self.abi_version = abi_version
        self._declare = declare
        self.compile_flags = COMPILE_FLAGS + tuple(extra_flags)
        self._lock = threading.Lock()
        self._library: Optional[ctypes.CDLL] = None
        self._failure: Optional[str] = None

    def load(self) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
        """(library, None) when the kernels can run here, else (None, why not). Builds once."""
        with self._lock:
            if disabled():
                return None, f"disabled by {DISABLE_ENV}=0"
            if self._library is None and self._failure is None:
                self._library, self._failure = self._load_locked()
            return self._library, self._failure

    def available(self) -> Optional[str]:
        """None when the library loads here, else why not. Cheap once loaded (callers ask per
        layer); TOKENMILL_CPU_KERNELS=0 turns the kernels off at any time."""
        if disabled():
            return f"disabled by {DISABLE_ENV}=0"
        if self._library is not None:
            return None
        return self.load()[1]

    def require(self) -> ctypes.CDLL:
        """The library for a caller that already chose the native path (kernels swapped into a
        model keep working if TOKENMILL_CPU_KERNELS changes later); RuntimeError if it cannot load."""
        if self._library is not None:
            return self._library
        lib, why = self.load()
        if lib is None:
            raise RuntimeError(f"native kernels of {self.source.name} unavailable: {why}")
        return lib

    def _load_locked(self) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
        compiler = _compiler()
        if compiler is None:
            failure = "no C++ compiler found (set CXX, or install g++)"
            logger.warning("native kernels of %s unavailable: %s; using the torch path", self.source.name, failure)
            return None, failure
        name = f"{self.source.stem}-{build_key(self.source, compiler, self.compile_flags)}.so"
        try:
            target = _cache_dir() / name
            if not target.exists():
                try:
                    _build(compiler, self.source, target, self.compile_flags)
                except PermissionError:        # read-only home: build in the temp directory
                    target = Path(tempfile.gettempdir()) / f"tokenmill-kernels-{os.getuid()}" / name
                    if not target.exists():
                        _build(compiler, self.source, target, self.compile_flags)
            lib = ctypes.CDLL(str(target))
            lib.tokenmill_kernels_abi_version.restype = ctypes.c_int
            if lib.tokenmill_kernels_abi_version() != self.abi_version:
                raise OSError(f"{target} has ABI {lib.tokenmill_kernels_abi_version()}, expected {self.abi_version}")
            self._declare(lib)
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            refused = REFUSED.search(detail) if isinstance(detail, str) else None
            if refused:
                extra = self.compile_flags[len(COMPILE_FLAGS):]
                failure = (f"this CPU has no {refused.group(1)}" if not extra
                           else f"the build target (-march=native {' '.join(extra)}) has no {refused.group(1)}")
                logger.info("native kernels of %s not built: %s; using the torch path", self.source.name, failure)
                return None, failure
            failure = f"building {self.source.name} failed: {detail.strip()[:500]}"
            logger.warning("native kernels of %s unavailable: %s; using the torch path", self.source.name, failure)
            return None, failure
        return lib, None
