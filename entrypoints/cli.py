"""`tokenmill` command line: each subcommand lives in its own module and registers itself.

A command module exposes `add_subparser(subparsers)`; a bench module exposes
`add_bench_subparser(bench_subparsers)`. Both set `func=run` on their parser. Modules keep
heavy imports (torch, the engine) inside `run`, so `tokenmill --help` stays fast.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
from typing import Optional

COMMAND_MODULES = [
    "tokenmill.entrypoints.generate_cmd",
    "tokenmill.entrypoints.platforms_cmd",
    "tokenmill.entrypoints.plugins_cmd",
    "tokenmill.entrypoints.models_cmd",
    "tokenmill.entrypoints.check_plugin",
    "tokenmill.entrypoints.openai.serve_cmd",
    "tokenmill.entrypoints.run_batch_cmd",
    "tokenmill.entrypoints.attention_matrix",
]
BENCH_MODULES = [
    "tokenmill.entrypoints.bench_throughput",
    "tokenmill.entrypoints.bench_serve",
    "tokenmill.entrypoints.bench_attention",
    "tokenmill.entrypoints.bench_gemm",
    "tokenmill.entrypoints.bench_moe",
    "tokenmill.entrypoints.bench_embed",
    "tokenmill.entrypoints.bench_report",
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
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve, attention, gemm, moe, embed; report")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    for name in BENCH_MODULES:
        module = _import_optional(name)
        if module is not None:
            module.add_bench_subparser(bench_sub)
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    # Each command's parser, so that an unknown flag is reported under that command's usage line.
    for sub in (subparsers, bench_sub):
        for command in sub.choices.values():
            command.set_defaults(_cli_parser=command)
    return parser


def unknown_arguments_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """`unrecognized arguments: …`, naming the closest known flag for each unknown one (difflib)."""
    known = [s for action in parser._actions for s in action.option_strings]
    hints = []
    for arg in extras:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{flag} (did you mean {close[0]}?)")
            else:
                hints.append(flag)
    return "unrecognized arguments: " + " ".join(hints or extras)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        command_parser = getattr(args, "_cli_parser", None) or parser
        command_parser.error(unknown_arguments_message(command_parser, extras))
    args._argv = list(argv) if argv is not None else sys.argv[1:]     # result files record their command
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
