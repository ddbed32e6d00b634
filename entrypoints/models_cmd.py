"""`tokenmill models`: every registered model architecture (tokenmill's own and plugins', from the
tokenmill.model_architectures entry points) with its implementation and what it supports -- tensor
and pipeline parallelism, LoRA, quantization, the platform's fast path, sliding windows, pooling --
and why not where not; plus the transformers implementation, which runs any other causal LM."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .platforms_cmd import table

COLUMNS = (("tp", "TP"), ("pp", "PP"), ("lora", "LORA"), ("quantization", "QUANT"), ("fast_path", "FAST PATH"),
           ("sliding_window", "SLIDING"), ("pooling", "POOLING"))


def add_subparser(subparsers) -> None:
    parser = subparsers.add_parser(
        "models", help="list model architectures: native (registered, plugins' too) or through transformers, "
                       "and what each supports (tp, pp, LoRA, quantization, fast path, sliding window, pooling)",
        description=__doc__)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def collect() -> dict[str, Any]:
    from tokenmill.core.models.features import architecture_rows, transformers_row
    from tokenmill.plugins import discovery

    return {"architectures": architecture_rows(), "transformers": transformers_row(),
            "quantization_methods": sorted(discovery.quantization_methods())}


def _mark(feature: dict[str, Any]) -> str:
    return {True: "yes", False: "no", None: "?"}[feature.get("supported")]


def render(data: dict[str, Any]) -> str:
    cells = [["ARCHITECTURE", "IMPL", "PACKAGE", "STATE"] + [title for _, title in COLUMNS]]
    refused: list[str] = []
    # Architectures sharing the same reasons (one class under several names) get one line.
    why_not: dict[str, list[str]] = {}
    for row in data["architectures"] + [data["transformers"]]:
        feats = row["features"]
        name = row["name"] if row["implementation"] == "native" else "(any other causal LM)"
        state = row.get("state") or ("loaded" if row.get("available") else "transformers not installed")
        cells.append([name, row["implementation"], row.get("package", "transformers"), state]
                     + [_mark(feats[key]) if key in feats else "-" for key, _ in COLUMNS])
        if row.get("reason"):
            refused.append(f"  {name}: {row['reason']}")
        reasons = "; ".join(f"{key}: {f['detail']}" for key, f in feats.items() if f["supported"] is not True)
        if reasons:
            why_not.setdefault(reasons, []).append(name)
    lines = table(cells)
    if refused:
        lines += ["", "Refused:"] + refused
    if why_not:
        lines += ["", "Why not:"] + [f"  {', '.join(names)}: {reasons}" for reasons, names in why_not.items()]
    t = data["transformers"]
    lines += ["", "quantization methods registered: " + (", ".join(data["quantization_methods"]) or "none"),
              f"transformers {t['transformers_version'] or '(not installed)'}: {t['note']}."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    data = collect()
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(data))
    return 0
