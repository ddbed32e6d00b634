"""`tokenmill bench embed`: embeddings throughput of a pooling model, offline through `LLM.embed`.

    tokenmill bench embed --model DIR --num-requests 64 --input-len 128 [--repeats 3] [engine args]

Each run embeds `--num-requests` inputs of exactly `--input-len` random token ids in one call (the
scheduler batches them as the server would); the figure is the median over `--repeats` runs after one
warm-up run, in inputs/s (and prompt tokens/s).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from .engine_args import add_engine_args, engine_kwargs


def add_bench_subparser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("embed", help="embeddings throughput (inputs/s) of a pooling model",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, model_positional=False)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .llm import LLM
    if args.num_requests < 1 or args.input_len < 1 or args.repeats < 1:
        raise SystemExit("--num-requests, --input-len and --repeats must be positive")
    kwargs = engine_kwargs(args)
    if kwargs.get("runner") == "auto":
        kwargs["runner"] = "pooling"
    llm = LLM(**kwargs)
    engine = llm.engine
    rng = random.Random(args.seed)
    low = min(1000, engine.vocab_size // 2)     # clear of the special tokens at the start of most vocabularies
    prompts = [[rng.randrange(low, engine.vocab_size) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    llm.embed(prompts, use_tqdm=False)          # warm-up
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.embed(prompts, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    result = {"model": engine.model_name, "dtype": engine.dtype_description, "attention_backend":
              engine.attention_backend_name, "num_requests": args.num_requests, "input_len": args.input_len,
              "seconds": seconds, "inputs_per_s": args.num_requests / median,
              "tokens_per_s": args.num_requests * args.input_len / median}
    print(f"{engine.model_name} ({result['dtype']}, {result['attention_backend']}): {args.num_requests} x "
          f"{args.input_len} tokens in {median:.3f} s (median of {args.repeats}): "
          f"{result['inputs_per_s']:.1f} inputs/s, {result['tokens_per_s']:.0f} tokens/s")
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0
