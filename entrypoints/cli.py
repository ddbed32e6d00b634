"""`tokenmill` command line: each subcommand lives in its own module and registers itself.

A command module exposes `add_subparser(subparsers)`; a bench module exposes
`add_bench_subparser(bench_subparsers)`. Both set `func=run` on their parser. Modules keep
heavy imports (torch, the engine) inside `run`, so `tokenmill --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional

COMMAND_MODULES = [
    "tokenmill.entrypoints.generate_cmd",
    "tokenmill.entrypoints.platforms_cmd",
    "tokenmill.entrypoints.plugins_cmd",
    "tokenmill.entrypoints.check_plugin",
    "tokenmill.entrypoints.openai.serve_cmd",
    "tokenmill.entrypoints.attention_matrix",
]
BENCH_MODULES = [
    "tokenmill.entrypoints.bench_throughput",
    "tokenmill.entrypoints.bench_serve",
    "tokenmill.entrypoints.bench_attention",
]


def _import_optional(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:   # the command is not written yet; anything else is a real error
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference and serving engine")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = _import_optional(name)
        if module is not None:
            module.add_subparser(subparsers)
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve, attention")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    for name in BENCH_MODULES:
        module = _import_optional(name)
        if module is not None:
            module.add_bench_subparser(bench_sub)
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
