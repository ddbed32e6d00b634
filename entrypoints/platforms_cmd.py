"""`tokenmill platforms`: every discovered platform, available or not and why (every other kind of
extension: `tokenmill plugins`)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_subparser(subparsers) -> None:
    parser = subparsers.add_parser(
        "platforms", help="list discovered platforms: available or not (and why), attention backends, "
                          "graph capture, distributed backend, quantized formats run natively",
        description="List every platform found through the tokenmill.platforms entry points (built in or "
                    "from installed plugins) and whether it can run here, and why not.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def collect() -> dict[str, Any]:
    from tokenmill.plugins import discovery

    reports = discovery.discover_platforms()
    backends = discovery.attention_backend_classes()
    backend_errors = discovery.attention_backend_errors()
    usable = sorted((r for r in reports if r.usable), key=lambda r: -(r.priority or 0))
    platforms = []
    for r in reports:
        entry = r.to_dict()
        desc = r.description or {}
        entry["attention_backends"] = [
            {"name": b, "loaded": b in backends, **({"error": backend_errors[b]} if b in backend_errors else {})}
            for b in desc.get("attention_backends", [])]
        entry["decode_programs"] = desc.get("decode_programs", [])
        entry["distributed_backend"] = desc.get("distributed_backend")
        entry["quantization"] = desc.get("quantization", [])
        entry["quantization_formats"] = desc.get("quantization_formats", {})
        platforms.append(entry)
    return {
        "platforms": platforms,
        "auto": usable[0].name if usable else None,
        "attention_backends": {"loaded": sorted(backends), "failed": backend_errors},
    }


def table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as aligned text lines (the first row is the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def render(data: dict[str, Any]) -> str:
    header = ["PLATFORM", "ORIGIN", "API", "PRIO", "AVAILABLE", "ATTENTION (preference order)",
              "DECODE PROGRAMS", "DISTRIBUTED"]
    rows = [header]
    notes: list[str] = []
    for p in data["platforms"]:
        if p["load_error"]:
            status = "skipped"
        else:
            status = "yes" if p["available"] else "no"
        attention = ", ".join(b["name"] + ("" if b["loaded"] else "*") for b in p["attention_backends"]) or "-"
        rows.append([p["name"], p["origin"], str(p["api_version"] if p["api_version"] is not None else "?"),
                     str(p["priority"] if p["priority"] is not None else "-"), status, attention,
                     ", ".join(p["decode_programs"]) or "-", p["distributed_backend"] or "-"])
        notes.append(f"  {p['name']}: {p['reason']}" if p["reason"] else f"  {p['name']}")
    lines = table(rows)
    lines.append("")
    lines.append("Why / details:")
    lines.extend(notes)
    if any(not b["loaded"] for p in data["platforms"] for b in p["attention_backends"]):
        lines.append("  (* attention backend not loaded here: " + "; ".join(
            f"{name}: {err}" for name, err in sorted(data["attention_backends"]["failed"].items())) + ")")
    lines.append("")
    lines.append("Quantized checkpoint formats each platform runs without a float copy of the weights")
    lines.append("(native: a kernel multiplies the stored form; per-tile: kept stored, dequantized a tile at a time):")
    for p in data["platforms"]:
        lines.extend(format_lines(p))
    lines.append("")
    lines.append(f"--device auto -> {data['auto'] or 'nothing available'}")
    lines.append("(every extension of every kind, loaded or refused: tokenmill plugins)")
    return "\n".join(lines)


def format_lines(platform: dict[str, Any]) -> list[str]:
    """'  cpu: native gguf:Q4_0, ...; per-tile gguf:Q5_0, ...; run-time quantization int4, gguf'."""
    formats: dict[str, str] = platform.get("quantization_formats") or {}
    native = [f for f, how in formats.items() if how == "native"]
    tiled = [f for f, how in formats.items() if how != "native"]
    parts = []
    if native:
        parts.append("native " + ", ".join(native))
    if tiled:
        parts.append("per-tile " + ", ".join(tiled))
    if platform.get("quantization"):
        parts.append("--quantization " + ", ".join(platform["quantization"]))
    return [f"  {platform['name']}: " + ("; ".join(parts) if parts else "none (checkpoints are dequantized at load)")]


def run(args: argparse.Namespace) -> int:
    data = collect()
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(render(data))
    return 0
