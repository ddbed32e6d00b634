"""`tokenmill plugins`: every extension of every kind, built-in or third-party, loaded or refused
and why -- platforms, attention backends, quantization methods, model architectures, tool and
reasoning parsers, grammar backends, hook implementations."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .platforms_cmd import table


def add_subparser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plugins", help="list every extension (platforms, attention backends, quantization, models, parsers, "
                        "grammar backends, hooks): package, version, API version, loaded or refused and why",
        description=__doc__)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--kind", action="append", default=None, help="only this kind (repeatable)")
    parser.set_defaults(func=run)


def collect(kinds: list[str] | None = None) -> list[dict[str, Any]]:
    from tokenmill.plugins import discovery

    availability = {p.name: ("available: " if p.available else "unavailable: ") + p.reason
                    for p in discovery.discover_platforms() if p.load_error is None}
    rows = []
    for report in discovery.extension_reports():
        if kinds and report.kind not in kinds:
            continue
        if report.kind == "platform" and report.loaded:
            report.detail = availability.get(report.name, "")
        rows.append(report.to_dict())
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    cells = [["NAME", "KIND", "PACKAGE", "VERSION", "API", "STATE", "WHY / DETAIL"]]
    for r in rows:
        cells.append([r["name"], r["kind"], r["package"], r["package_version"],
                      "?" if r["api_version"] is None else str(r["api_version"]), r["state"],
                      r["reason"] or r["detail"]])
    refused = sum(r["state"] != "loaded" for r in rows)
    return "\n".join(table(cells) + ["", f"{len(rows) - refused} loaded, {refused} refused"])


def run(args: argparse.Namespace) -> int:
    rows = collect(args.kind)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(rows))
    return 0
