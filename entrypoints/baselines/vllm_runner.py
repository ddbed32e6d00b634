#!/usr/bin/env python3
"""vLLM baseline runner for `tokenmill bench throughput --baseline vllm`.

Runs under the interpreter of a venv where vLLM is installed, never tokenmill's: it imports no
tokenmill module (only the standard library and vLLM).

    python vllm_runner.py SPEC.json OUT.json

SPEC (written by tokenmill.entrypoints.baselines.external): model (an HF directory), dtype,
prefix_caching, seed, repeat, threads, and workloads: [{name, prompts, warmup_prompts,
output_len}] with token-id prompts. One vllm.LLM for all workloads. Per workload: one untimed
warm-up on warmup_prompts (same shapes, other token ids), then `repeat` timed runs, each a wall
clock around one llm.generate() of all requests (greedy, EOS ignored), the prefix cache reset
before every call; exact output lengths are asserted; the median is reported.
OUT is rewritten after every workload, so a crash keeps the workloads already done.
"""
import json
import os
import statistics
import sys
import time

# The script's own directory (tokenmill's baselines package) must not shadow the engine's modules.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

ENV_PREFIXES = ("VLLM_CPU", "OMP_", "KMP_", "VLLM_")


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=bool(spec["prefix_caching"]),
              seed=int(spec.get("seed", 0)), max_model_len=spec.get("max_model_len"))
    load_s = time.perf_counter() - t0
    out = {"engine": f"vllm {vllm.__version__}", "engine_version": vllm.__version__, "torch": torch.__version__,
           "model": spec["model"], "dtype": spec["dtype"], "prefix_caching": bool(spec["prefix_caching"]),
           "threads": spec["threads"], "load_s": round(load_s, 2),
           "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k == "LD_PRELOAD"},
           "workloads": {}}
    write_json(out_path, out)

    for w in spec["workloads"]:
        n_out = int(w["output_len"])
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)

        def go(prompts, params=params):
            requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(requests, params, use_tqdm=False)
            return time.perf_counter() - start, outs

        warm_s, _ = go(w["warmup_prompts"])        # untimed: same shapes, other token ids
        runs, outs = [], None
        for _ in range(int(spec["repeat"])):
            seconds, outs = go(w["prompts"])
            runs.append(seconds)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert all(n == n_out for n in lengths), f"{w['name']}: output lengths {sorted(set(lengths))} != {n_out}"
        n_prompt = sum(len(p) for p in w["prompts"])
        n_gen = sum(lengths)
        cached = [o.num_cached_tokens for o in outs if getattr(o, "num_cached_tokens", None) is not None]
        seconds = statistics.median(runs)
        out["workloads"][w["name"]] = {
            "requests": len(w["prompts"]), "prompt_tokens": n_prompt, "output_tokens": n_gen,
            "seconds": seconds, "runs": runs, "warmup_seconds": warm_s,
            "output_tok_s": n_gen / seconds, "total_tok_s": (n_prompt + n_gen) / seconds,
            "cached_prompt_tokens": sum(cached) if cached else None,
            "first_output_ids": list(outs[0].outputs[0].token_ids[:8]),
        }
        write_json(out_path, out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: vllm_runner.py SPEC.json OUT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
