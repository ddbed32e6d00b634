"""`tokenmill bench throughput`: the offline workloads, optionally beside transformers `generate()`.

Time runs from handing all requests to the engine until the last token, model load excluded,
after one untimed warm-up on other prompts (so the prefix cache starts cold).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

from .engine_args import add_engine_args, engine_kwargs


def add_bench_subparser(bench_subparsers) -> None:
    parser = bench_subparsers.add_parser("throughput", help="offline throughput on the standard workloads")
    parser.add_argument("--workload", default="W1", help="W1, W2, W3, W4 or all")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the median is reported")
    parser.add_argument("--baseline", choices=["none", "hf"], default="none",
                        help="also run Hugging Face transformers generate() on the same model")
    parser.add_argument("--baseline-dtype", default="float32")
    parser.add_argument("--baseline-max-requests", type=int, default=4,
                        help="requests timed for the one-at-a-time transformers baseline (it is slow)")
    parser.add_argument("--without-prefix-caching", action="store_true",
                        help="also run each workload with prefix caching off, in the same process")
    parser.add_argument("--json", dest="json_path", default=None, help="write results to this file")
    add_engine_args(parser, model_positional=False)
    parser.set_defaults(func=run)


def _time_engine(llm, workload, repeat: int) -> dict[str, Any]:
    from tokenmill.core.sampling_params import SamplingParams
    from .workloads import build_workload

    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    warm = build_workload("W1").prompts[:4]
    llm.generate([{"prompt_token_ids": [t + 7 for t in p[:64]]} for p in warm],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    times, cached = [], 0
    preempt0 = llm.engine.stats().num_preemptions
    for _ in range(repeat):
        llm.reset_prefix_cache()
        gc.collect()            # garbage of earlier runs (and baselines) is not this run's cost
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == workload.output_len for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
    elapsed = statistics.median(times)
    return {"seconds": elapsed, "output_tok_s": workload.num_output_tokens / elapsed,
            "total_tok_s": (workload.num_output_tokens + workload.num_prompt_tokens) / elapsed,
            "cached_prompt_tokens": cached, "preemptions": llm.engine.stats().num_preemptions - preempt0,
            "runs": times}


def _hf_baseline(model_path, workload, dtype_name: str, max_sequential: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.core.loaders.model_source import resolve_model_source

    source = resolve_model_source(model_path)
    dtype = getattr(torch, dtype_name)
    if source.kind == "gguf":
        import os
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path),
                                                     gguf_file=os.path.basename(source.path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    model.eval()
    n_out = workload.output_len
    kwargs = dict(do_sample=False, max_new_tokens=n_out, min_new_tokens=n_out, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([workload.prompts[0][:16]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        sequential = workload.prompts[:max_sequential]
        start = time.perf_counter()
        for p in sequential:
            model.generate(torch.tensor([p]), **kwargs)
        seq_time = time.perf_counter() - start
        seq_tokens = n_out * len(sequential)
        # One static batch, left-padded to the longest prompt.
        width = max(len(p) for p in workload.prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in workload.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts])
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, **kwargs)
        batch_time = time.perf_counter() - start
    return {"dtype": dtype_name,
            "sequential": {"requests": len(sequential), "seconds": seq_time, "output_tok_s": seq_tokens / seq_time},
            "static_batch": {"requests": len(workload.prompts), "seconds": batch_time,
                             "output_tok_s": workload.num_output_tokens / batch_time,
                             "total_tok_s": (workload.num_output_tokens + workload.num_prompt_tokens) / batch_time}}


def run(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM
    from .workloads import WORKLOAD_NAMES, build_workload

    names = WORKLOAD_NAMES if args.workload.lower() == "all" else [args.workload.upper()]
    workloads = [build_workload(n) for n in names]
    kwargs = engine_kwargs(args)
    llm = LLM(**kwargs)
    engine = llm.engine
    header = (f"tokenmill {engine.model_name} on {engine.platform.name}, dtype "
              f"{engine.dtype_description}, attention {engine.attention_backend_name}, "
              f"prefix caching {'on' if engine.config.cache.enable_prefix_caching else 'off'}")
    print(header)
    results: dict[str, Any] = {"engine": header, "workloads": {}}
    no_cache_llm = None
    if args.without_prefix_caching and engine.config.cache.enable_prefix_caching:
        no_cache_llm = LLM(**{**kwargs, "enable_prefix_caching": False})
    for w in workloads:
        r = _time_engine(llm, w, args.repeat)
        entry: dict[str, Any] = {"tokenmill": r}
        print(f"{w.name} ({w.description}): {len(w.prompts)} requests, {r['seconds']:.2f}s, "
              f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s, "
              f"cached prompt tokens {r['cached_prompt_tokens']}, preemptions {r['preemptions']}")
        if no_cache_llm is not None:
            nc = _time_engine(no_cache_llm, w, args.repeat)
            entry["tokenmill_no_prefix_caching"] = nc
            print(f"{w.name} without prefix caching: {nc['output_tok_s']:.1f} output tok/s "
                  f"(prefix caching speed-up {r['output_tok_s'] / nc['output_tok_s']:.2f}x)")
        if args.baseline == "hf":
            hf = _hf_baseline(args.model, w, args.baseline_dtype, args.baseline_max_requests)
            entry["hf"] = hf
            print(f"{w.name} transformers generate() {hf['dtype']}: one at a time "
                  f"{hf['sequential']['output_tok_s']:.1f} tok/s ({hf['sequential']['requests']} requests); "
                  f"static batch {hf['static_batch']['output_tok_s']:.1f} output tok/s")
            print(f"{w.name} ratio tokenmill / transformers: "
                  f"{r['output_tok_s'] / hf['sequential']['output_tok_s']:.2f}x vs one at a time, "
                  f"{r['output_tok_s'] / hf['static_batch']['output_tok_s']:.2f}x vs static batch")
        results["workloads"][w.name] = entry
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
