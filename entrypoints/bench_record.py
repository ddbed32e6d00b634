"""What every benchmark result file records besides its figures: the command that reproduces it,
the host it ran on and when (`run_record`), and the host class results are grouped by in
docs/benchmarks.md (`host_class`; entrypoints/bench_report.py writes that page from the files).

A host is described by what decides which kernels run, not by its name: the CPU family, the
instruction-set extensions the kernels choose between (AVX2, AVX-512 and its VNNI/BF16/FP16
parts, AMX), the cores this process may use, and the GPU when there is one.
"""
from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
from typing import Any, Optional, Sequence

# /proc/cpuinfo flags the kernels choose between; the rest say nothing about speed here.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "sve2")


def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break           # the first processor is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return fields


def host_info() -> dict[str, Any]:
    """CPU model, the ISA flags of ISA_FLAGS it has, usable cores; torch and GPU when torch is loaded."""
    info = _cpuinfo()
    cpu = re.sub(r"\((R|TM)\)", "", info.get("model name") or platform.processor() or platform.machine())
    flags = set((info.get("flags") or info.get("features") or "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    host: dict[str, Any] = {"cpu": " ".join(cpu.split()), "isa": [f for f in ISA_FLAGS if f in flags],
                            "cores": cores}
    torch = sys.modules.get("torch")          # never imported for this alone
    if torch is not None:
        host["torch"] = torch.__version__
        if torch.cuda.is_available():
            host["gpu"] = torch.cuda.get_device_name(0)
            host["gpus"] = torch.cuda.device_count()
    return host


def cli_command(args: Any) -> str:
    """The `tokenmill ...` command line this run was started with (entrypoints/cli.py keeps argv)."""
    argv: Optional[Sequence[str]] = getattr(args, "_argv", None)
    return "tokenmill " + shlex.join(argv if argv is not None else sys.argv[1:])


def run_record(command: str) -> dict[str, Any]:
    """The keys a result file carries besides its figures."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {"command": command, "host": host_info(), "date": now.isoformat()}


def _cpu_family(cpu: str) -> str:
    for family in ("EPYC", "Xeon", "Ryzen", "Threadripper", "Core", "Graviton", "Neoverse"):
        if family in cpu.split():
            vendor = "AMD" if "AMD" in cpu or family in ("EPYC", "Ryzen", "Threadripper") else ""
            vendor = vendor or ("Intel" if "Intel" in cpu or family in ("Xeon", "Core") else "")
            return f"{vendor} {family}".strip()
    return cpu or "unknown CPU"


def _isa_summary(isa: set[str]) -> str:
    if "avx512f" in isa:
        parts = [name for name, flag in (("VNNI", "avx512_vnni"), ("BF16", "avx512_bf16"), ("FP16", "avx512_fp16"))
                 if flag in isa]
        text = "AVX-512" + (f" ({' + '.join(parts)})" if parts else "")
        return text + (" with AMX" if isa & {"amx_tile", "amx_bf16", "amx_int8"} else ", no AMX")
    if "avx2" in isa:
        return "AVX2, no AVX-512"
    if "sve" in isa or "sve2" in isa:
        return "Arm SVE"
    return "Arm NEON" if "asimd" in isa else "ISA not recorded"


def host_class(host: Optional[dict[str, Any]]) -> str:
    """The heading results are grouped under: GPU, or CPU family, cores and ISA class."""
    if not host:
        return "host not recorded"
    if host.get("gpu"):
        count = int(host.get("gpus") or 1)
        return f"{host['gpu']}" + (f" x{count}" if count > 1 else "")
    cores = f", {host['cores']} cores" if host.get("cores") else ""
    return f"{_cpu_family(str(host.get('cpu', '')))}{cores}: {_isa_summary(set(host.get('isa') or ()))}"
