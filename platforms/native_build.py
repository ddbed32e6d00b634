"""Native C++ kernels built on first use with the system compiler and loaded through ctypes.

One helper for every leaf that ships C++ (the cpu platform's layer kernels, platforms/csrc/;
cpu_sdpa's paged decode, attention_backends/csrc/): it holds no kernel and imports nothing of
tokenmill's, which is why attention_backends/ may import it like an interface module.

Why not a torch C++ extension: compiling against torch's headers takes a minute on a 2-core
machine; these sources have no torch dependency and build in about a second, once per machine
(cached under ~/.cache/tokenmill/kernels, keyed by source, flags, compiler and CPU flags, since
they are built with -march=native). Without a compiler, or with TOKENMILL_CPU_KERNELS=0, callers
fall back to their pure-torch path; `load()` says why.
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
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17",
                 "--param=vect-max-peeling-for-alignment=0")
LINK_FLAGS = ("-shared", "-fopenmp")


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
    """The bytes of the headers `source` includes with quotes (relative to its directory), so a
    change to a shared header rebuilds every library that includes it."""
    found = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', source.read_bytes(), flags=re.MULTILINE)
    return [(source.parent / name.decode()).read_bytes() for name in found]


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj = Path(tmp) / "kernels.o"
        lib = Path(tmp) / target.name
        subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                       check=True, capture_output=True, text=True, timeout=300)
        subprocess.run([compiler, *LINK_FLAGS, str(obj), "-o", str(lib)],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(lib, target)      # atomic: concurrent builders never see half a library


class NativeLibrary:
    """One C++ source file as a lazily built shared library.

    The source must export `int tokenmill_kernels_abi_version()`; `declare` sets the ctypes
    signatures of its other functions.
    """

    def __init__(self, source: Path, abi_version: int, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source = source
        self.abi_version = abi_version
        self._declare = declare
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
        key = hashlib.sha256()
        for part in (self.source.read_bytes(), *_local_includes(self.source),
                     " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(), compiler.encode(), _cpu_flags().encode()):
            key.update(part)
        name = f"{self.source.stem}-{key.hexdigest()[:16]}.so"
        try:
            target = _cache_dir() / name
            if not target.exists():
                try:
                    _build(compiler, self.source, target)
                except PermissionError:        # read-only home: build in the temp directory
                    target = Path(tempfile.gettempdir()) / f"tokenmill-kernels-{os.getuid()}" / name
                    if not target.exists():
                        _build(compiler, self.source, target)
            lib = ctypes.CDLL(str(target))
            lib.tokenmill_kernels_abi_version.restype = ctypes.c_int
            if lib.tokenmill_kernels_abi_version() != self.abi_version:
                raise OSError(f"{target} has ABI {lib.tokenmill_kernels_abi_version()}, expected {self.abi_version}")
            self._declare(lib)
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            failure = f"building {self.source.name} failed: {detail.strip()[:500]}"
            logger.warning("native kernels of %s unavailable: %s; using the torch path", self.source.name, failure)
            return None, failure
        return lib, None
