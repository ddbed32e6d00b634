"""`tokenmill run-batch -i requests.jsonl -o results.jsonl [MODEL] --device …`: an OpenAI batch file,
offline (vLLM's run_batch). Each line runs through the same routes as `tokenmill serve` (in process, no
HTTP), concurrently; the output has one line per input line, in input order."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any, Optional

from .engine_args import add_engine_args

logger = logging.getLogger("tokenmill.run_batch")


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    from .openai.serve_cmd import add_model_args
    parser = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) offline",
        description="Run an OpenAI batch file: each line a POST to /v1/chat/completions, /v1/completions or "
                    "/v1/embeddings; writes one result line per request line.")
    parser.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL); - for stdin")
    parser.add_argument("-o", "--output-file", required=True, help="where the results go (JSONL); - for stdout")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at once (default: --max-num-seqs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)
    add_model_args(parser)
    parser.set_defaults(func=run)
    return parser


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return [ln for ln in sys.stdin.read().splitlines() if ln.strip()]
    with open(path, encoding="utf-8") as fh:
        return [ln for ln in fh.read().splitlines() if ln.strip()]


async def run_file(app: Any, raw_lines: list[str], out: Any, concurrency: int, progress: Any = None) -> dict[str, int]:
    """Run every line through `app` (at most `concurrency` at once), writing output lines to `out` in input
    order as soon as they (and those before them) are done. Returns {"total", "completed", "failed"}."""
    from .openai.batch_lines import dumps_line, output_record, parse_line, run_line, succeeded
    lines = [parse_line(i, raw) for i, raw in enumerate(raw_lines)]
    gate = asyncio.Semaphore(max(1, concurrency))
    done: dict[int, dict[str, Any]] = {}
    counts = {"total": len(lines), "completed": 0, "failed": 0}
    next_out = 0

    def finished(index: int, record: dict[str, Any]) -> None:
        nonlocal next_out
        done[index] = record
        counts["completed" if succeeded(record) else "failed"] += 1
        if progress is not None:
            progress.update(1)
        while next_out in done:
            out.write(dumps_line(done.pop(next_out)))
            next_out += 1

    async def one(line: Any) -> None:
        if line.error is not None:
            finished(line.index, output_record(line))
            return
        async with gate:
            try:
                status, body = await run_line(app, line)
            except Exception as exc:      # a bug, not the line's fault: still the line's result only
                logger.exception("batch line %d failed", line.index)
                status, body = 500, {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error",
                                               "param": None, "code": "internal_error"}}
        finished(line.index, output_record(line, status, body))

    await asyncio.gather(*(one(line) for line in lines))
    out.flush()
    return counts


def run(args: argparse.Namespace) -> int:
    from .openai.app import create_app
    from .openai.engine_client import EngineClient
    from .openai.serve_cmd import check_parser_args, check_vllm_args, serving_engine_kwargs, serving_settings

    check_parser_args(args)
    check_vllm_args(getattr(args, "_cli_parser", None) or argparse.ArgumentParser("tokenmill run-batch"), args)
    try:
        raw_lines = _read_lines(args.input_file)
    except OSError as exc:
        raise SystemExit(f"--input-file: {exc}") from None
    client = EngineClient(serving_engine_kwargs(args), factory=args.engine_factory,
                          log_level=logging.getLogger().getEffectiveLevel())
    settings = serving_settings(args)
    concurrency = args.max_concurrency or args.max_num_seqs

    async def main() -> dict[str, int]:
        await asyncio.to_thread(client.start, None)
        guard = create_app(client, settings)
        guard.state.on_started.clear()     # no online batch jobs (of a --batch-dir) in this process
        guard.state.started(asyncio.get_running_loop())    # the app's lifespan is not run: no HTTP server
        progress: Optional[Any] = None
        if not args.no_progress:
            from tqdm import tqdm
            progress = tqdm(total=len(raw_lines), desc="run-batch", unit="req", file=sys.stderr)
        out = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
        try:
            return await run_file(guard.app, raw_lines, out, concurrency, progress)
        finally:
            if out is not sys.stdout:
                out.close()
            if progress is not None:
                progress.close()

    try:
        counts = asyncio.run(main())
    finally:
        client.shutdown()
    logger.info("run-batch: %d requests, %d succeeded, %d failed -> %s", counts["total"], counts["completed"],
                counts["failed"], args.output_file)
    return 0
