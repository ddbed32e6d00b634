"""The attention matrix's reports: text, JSON records and the Markdown document."""
from __future__ import annotations

import os
import platform as _platform
from typing import Optional

from .attention_grid import TOLERANCES


def _cell_text(r: dict, notes: dict) -> str:
    if r["status"] == "pass":
        return f"pass {r['max_abs_error']:.1e}"
    if r["status"] == "unsupported":
        key = "; ".join(r["reasons"])
        notes.setdefault(key, len(notes) + 1)
        return f"unsupported [{notes[key]}]"
    err = r["max_abs_error"]
    return f"**FAIL** {err:.2g}" if err is not None else "**FAIL** (raised)"


def environment_info(device: str) -> dict:
    import importlib.metadata as md
    import torch
    info = {"python": _platform.python_version(), "torch": torch.__version__,
            "os": f"{_platform.system()} {_platform.release()}", "machine": _platform.machine(),
            "cpu": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": device, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    if device.split(":")[0] not in ("cpu", "auto"):
        from tokenmill.plugins.discovery import resolve_platform
        try:
            info["gpu"] = resolve_platform(device.split(":")[0]).device_name()
        except ValueError as e:
            info["gpu"] = f"unavailable: {e}"
    pkgs = {}
    for dist in ("tokenmill", "triton", "flash-attn", "flashinfer-python", "flashinfer",
                 "intel-extension-for-pytorch", "torch-xla", "numpy"):
        try:
            pkgs[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    info["packages"] = pkgs
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or "unknown"


def format_text(results: list[dict]) -> str:
    lines = []
    atol_line = ", ".join(f"{dt}: {a:g} + {r:g}*|ref|" for dt, (a, r) in TOLERANCES.items())
    lines.append(f"tolerance (max |out-ref|): {atol_line}")
    width = max([len(r["label"]) for r in results] + [10])
    for r in results:
        if r["status"] == "pass":
            cell = f"pass  max|err| {r['max_abs_error']:.2e}"
        elif r["status"] == "fail":
            err = r["max_abs_error"]
            cell = f"FAIL  max|err| {err:.3g} at {r['where']}" if err is not None else f"FAIL  {r['where']}"
        else:
            cell = "unsupported: " + "; ".join(r["reasons"])
        lines.append(f"{r['backend']:<14} {r['label']:<{width}}  {cell}")
    return "\n".join(lines)


def summarize(results: list[dict]) -> dict:
    summ: dict = {}
    for r in results:
        s = summ.setdefault(r["backend"], {"pass": 0, "fail": 0, "unsupported": 0})
        s[r["status"] if r["status"] in s else "fail"] += 1
    return summ


def markdown_section(run: dict, title: Optional[str] = None) -> str:
    results = run["results"]
    env = run["environment"]
    out = []
    title = title or run.get("title") or f"{env.get('device')} -- {env.get('cpu')}"
    out.append(f"## {title}\n")
    out.append(f"- command: `{run.get('command', '')}`")
    out.append(f"- date: {run.get('date', '')}, grid: {run.get('grid')}, seed: {run.get('seed')}")
    out.append(f"- machine: {env.get('cpu')}, {env.get('cores')} cores ({env.get('torch_threads')} torch threads), "
               f"{env.get('os')} {env.get('machine')}" + (f", GPU {env['gpu']}"
                                                           if env.get("gpu") else ""))
    pk = ", ".join(f"{k} {v}" for k, v in env.get("packages", {}).items())
    out.append(f"- versions: Python {env.get('python')}, torch {env.get('torch')}" + (f", {pk}" if pk else ""))
    if env.get("TRITON_INTERPRET"):
        out.append(f"- TRITON_INTERPRET={env['TRITON_INTERPRET']} (Triton kernels run in the interpreter)")
    tol = run.get("tolerances", TOLERANCES)
    out.append("- tolerance: max |out - ref| <= atol + rtol*|ref|: "
               + ", ".join(f"{dt} atol {a:g} rtol {r:g}" for dt, (a, r) in tol.items())
               + " (an fp8 cache over float32 activations: bfloat16's)")
    if run.get("load_errors"):
        for k, v in run["load_errors"].items():
            out.append(f"- backend {k} failed to load: {v}")
    out.append("")
    summ = summarize(results)
    out.append("| backend | pass | fail | unsupported |")
    out.append("|---|---|---|---|")
    for b, s in summ.items():
        out.append(f"| {b} | {s['pass']} | {s['fail']} | {s['unsupported']} |")
    out.append("")
    backends = list(summ)
    labels = []
    for r in results:
        if r["label"] not in labels:
            labels.append(r["label"])
    notes: dict = {}
    cells = {(r["backend"], r["label"]): r for r in results}
    out.append("| configuration | " + " | ".join(backends) + " |")
    out.append("|---|" + "---|" * len(backends))
    for lab in labels:
        row = [(_cell_text(cells[(b, lab)], notes) if (b, lab) in cells else "-") for b in backends]
        out.append(f"| {lab} | " + " | ".join(row) + " |")
    out.append("")
    fails = [r for r in results if r["status"] == "fail"]
    if fails:
        out.append("Failures:\n")
        for r in fails:
            err = r["max_abs_error"]
            out.append(f"- {r['backend']} / {r['label']}: max|err| "
                       f"{'-' if err is None else '%.3g' % err}, {r['where']}")
        out.append("")
    if notes:
        out.append("Unsupported, in the backends' own words:\n")
        for text, n in notes.items():
            out.append(f"{n}. {text}")
        out.append("")
    return "\n".join(out)


def write_markdown(path: str, runs: list[dict], notes_text: str = "") -> None:
    parts = ["# Attention-backend matrix\n",
             "Generated by `tokenmill attention-matrix` (entrypoints/attention_matrix.py). Each cell compares "
             "a backend with `reference` on the same inputs: two steps (a prefill of the cached context, "
             "then a batch mixing decodes with prefill chunks from position 0 and after cached context), "
             "contexts ending mid-block and on block boundaries, block tables shuffled so that no sequence's "
             "blocks are contiguous. Each backend builds its own KV cache (`kv_cache_shape`, KV dtype) and "
             "writes it with its own `forward`. `D` head size, `H` query/KV heads, `bs` block size.\n"]
    for run in runs:
        parts.append(markdown_section(run))
    if notes_text:
        parts.append(notes_text.rstrip() + "\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(parts))
