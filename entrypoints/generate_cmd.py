"""`tokenmill generate "prompt" ...`: run the model offline on one or more prompts."""
from __future__ import annotations

import argparse
import sys

from .engine_args import add_engine_args, engine_kwargs


def add_subparser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text offline from prompts")
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    add_engine_args(parser, model_positional=False)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print token ids and text as JSON lines")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.entrypoints.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, ignore_eos=args.ignore_eos)
        llm = LLM(**engine_kwargs(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenmill generate: error: {exc}", file=sys.stderr)
        return 2
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs):
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{prompt}{completion.text}")
    return 0
