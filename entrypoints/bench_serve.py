"""`tokenmill bench serve`: an OpenAI-protocol load generator (streaming /v1/completions).

Works against any OpenAI-compatible server (tokenmill, vLLM, …): prompts are sent as lists of
token ids (as OpenAI and vLLM accept), `stream_options.include_usage` gives the exact output
token counts, and `ignore_eos` (a vLLM extra; --no-ignore-eos to leave it out) makes output
lengths exact. Reports request and token throughput and mean/median/p99 of TTFT, TPOT, ITL and
end-to-end latency, in the layout of vLLM's `benchmark_serving`.

    tokenmill bench serve --base-url http://127.0.0.1:8000 --workload W1 --request-rate 4
    tokenmill bench serve --random-input-len 128 --random-output-len 128 --num-prompts 64 --max-concurrency 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start: float = 0.0      # time.perf_counter() when it was sent (for --plot's throughput over time)


def add_bench_subparser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("serve", help="load-test an OpenAI-compatible server (streaming completions)",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL, without /v1")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or $TOKENMILL_API_KEY)")
    p.add_argument("--workload", default=None, help="W1, W2, W3 or W4 (shared/WORKLOADS.md)")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="default: the workload's, or 64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that refuse unknown fields)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before the run (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--result-json", default=None, help="also write the results here")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw TTFT and ITL distributions and throughput over time into this PNG "
                        "(needs matplotlib: pip install 'tokenmill[plot]')")
    p.set_defaults(func=run)
    return p


def build_prompts(args: argparse.Namespace) -> tuple[list[list[int]], int, str]:
    """(prompts as token ids, output length, description)."""
    if args.workload:
        from .workloads import build_workload
        w = build_workload(args.workload)
        prompts = w.prompts
        if args.num_prompts is not None:
            prompts = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
        return prompts, w.output_len, f"{w.name} ({w.description})"
    import numpy as np
    n = args.num_prompts if args.num_prompts is not None else 64
    ids = np.random.default_rng(args.seed).integers(1000, 40000, size=(n, args.random_input_len)).tolist()
    return ids, args.random_output_len, f"random {args.random_input_len} in / {args.random_output_len} out"


async def _one(client: Any, url: str, headers: dict[str, str], model: str, prompt: list[int], output_len: int,
               args: argparse.Namespace) -> RequestResult:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": output_len,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    res = RequestResult(prompt_len=len(prompt))
    start = res.start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens: Optional[int] = None
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=args.timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = json.dumps(obj["error"])[:300]
                    return res
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no output"
    except Exception as exc:   # network errors, timeouts: count as failed
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    import numpy as np
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2el_ms": _stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


async def benchmark(args: argparse.Namespace, keep: Optional[list[RequestResult]] = None) -> dict[str, Any]:
    """Run the load; `keep` (a list) receives every request's result."""
    import httpx
    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TOKENMILL_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    prompts, output_len, description = build_prompts(args)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as client:
        model = args.model
        if model is None:
            r = await client.get(base + "/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = base + args.endpoint
        for _ in range(max(0, args.warmup)):
            w = await _one(client, url, headers, model, prompts[0][:16], min(4, output_len), args)
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        rng = random.Random(args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt: list[int]) -> RequestResult:
            if sem is None:
                return await _one(client, url, headers, model, prompt, output_len, args)
            async with sem:
                return await _one(client, url, headers, model, prompt, output_len, args)

        tasks = []
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(args.request_rate) and args.request_rate > 0 and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if keep is not None:
        keep.extend(results)
    summary = summarize(list(results), duration)
    summary.update({"model": model, "base_url": base, "workload": description, "num_prompts": len(prompts),
                    "output_len": output_len,
                    "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                    "max_concurrency": args.max_concurrency})
    return summary


def format_summary(s: dict[str, Any]) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(name: str, value: Any, fmt: str = "{:<10}") -> None:
        lines.append("{:<40} ".format(name) + fmt.format(value))
    rate = s["request_rate"]
    row("Workload:", s["workload"], "{}")
    row("Request rate (req/s):", rate, "{}")
    row("Max concurrency:", s["max_concurrency"] or "unbounded", "{}")
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"], "{:<10.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", s["output_throughput"], "{:<10.2f}")
    row("Total token throughput (tok/s):", s["total_token_throughput"], "{:<10.2f}")
    for key, title, label in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {label} (ms):", s[key]["mean"], "{:<10.2f}")
        row(f"Median {label} (ms):", s[key]["median"], "{:<10.2f}")
        row(f"P99 {label} (ms):", s[key]["p99"], "{:<10.2f}")
    lines.append("=" * 50)
    for err in s.get("errors") or []:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("--max-concurrency must be at least 1", file=sys.stderr)
        return 2
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per request otherwise
    plot = getattr(args, "plot", None)
    if plot:
        from .bench_plot import require_matplotlib
        try:
            require_matplotlib()     # before the run, not after minutes of load
        except RuntimeError as exc:
            print(f"bench serve: {exc}", file=sys.stderr)
            return 2
    results: list[RequestResult] = []
    try:
        summary = asyncio.run(benchmark(args, results))
    except Exception as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    if plot:
        from .bench_plot import plot_results
        plot_results(results, summary, plot)
        print(f"plot: {plot}")
    if args.result_json:
        from .bench_record import cli_command, run_record
        # The host is this client's: the server's when it runs on the same machine, as it usually does.
        with open(args.result_json, "w") as f:
            json.dump({**run_record(cli_command(args)), **summary}, f, indent=2, default=str)
    return 0 if summary["failed"] == 0 else 1

