"""W1 with LoRA adapters mixed in one batch against W1 on the base model, in one run (issue 14).

Makes `--num-adapters` random PEFT adapters (rank `--rank`, every projection q/k/v/o/gate/up/down,
non-zero B) for the default model's architecture with peft, then times, alternately and
`--repeat` times each:
  base:  W1's 64 requests on the base model;
  mixed: the same 64 requests, request i on adapter i % num_adapters (16 each for 4).
Greedy, EOS ignored, prefix cache reset before each run; prints medians and the ratio.

    python docs/bench/lora_throughput.py [--model PATH.gguf] [--repeat 3] [--quantization int4] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time


def make_adapters(hf_config_dir: str, out_dir: str, count: int, rank: int) -> list[str]:
    """`count` PEFT adapters with random non-zero A and B, saved with save_pretrained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_config_dir)
    paths = []
    for i in range(count):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_config(config)
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        model = get_peft_model(base, lora)
        with torch.no_grad():          # small deltas: the adapted model still writes text
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.mul_(0.05)
        path = os.path.join(out_dir, f"adapter{i}")
        model.save_pretrained(path)
        paths.append(path)
        del base, model
    return paths


def _hf_config_dir(model: str, out_dir: str) -> str:
    """A directory holding the model's config.json (peft builds the module tree from it)."""
    from tokenmill.core.loaders import gguf_loader
    from tokenmill.core.loaders.gguf_file import GGUFFile

    if os.path.isdir(model):
        return model
    path = os.path.join(out_dir, "config")
    gguf = GGUFFile(model)
    config = gguf_loader.gguf_config(gguf)
    config.save_pretrained(path)
    # The GGUF config is a plain PretrainedConfig: name its model type for transformers' AutoConfig.
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    data["model_type"] = gguf_loader.hf_architecture(gguf)[0]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M Q4_1 GGUF)")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    from tokenmill import LLM, LoRARequest, SamplingParams
    from tokenmill.core.loaders.model_source import resolve_model_source
    from tokenmill.entrypoints.workloads import build_workload

    model = resolve_model_source(args.model).path
    workload = build_workload("W1")
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(_hf_config_dir(model, tmp), tmp, args.num_adapters, args.rank)
        llm = LLM(model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
                  quantization=args.quantization, dtype=args.dtype)
        adapters = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
        params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
        mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
        llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                     lora_request=mixed[:8], use_tqdm=False)           # warm-up, adapters resident
        runs: dict[str, list[float]] = {"base": [], "mixed": []}
        for _ in range(args.repeat):
            for kind in ("base", "mixed"):
                llm.reset_prefix_cache()
                gc.collect()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, lora_request=None if kind == "base" else mixed, use_tqdm=False)
                runs[kind].append(time.perf_counter() - start)
                assert all(len(o.outputs[0].token_ids) == workload.output_len for o in outs)
    tokens = workload.num_output_tokens
    result = {kind: {"output_tok_s": tokens / statistics.median(times), "runs_s": times}
              for kind, times in runs.items()}
    result["mixed_over_base"] = result["mixed"]["output_tok_s"] / result["base"]["output_tok_s"]
    result["setup"] = {"model": model, "adapters": args.num_adapters, "rank": args.rank,
                       "quantization": args.quantization, "dtype": args.dtype, "threads": os.cpu_count()}
    print(f"W1 base   {result['base']['output_tok_s']:.1f} output tok/s (median of {args.repeat})")
    print(f"W1 mixed  {result['mixed']['output_tok_s']:.1f} output tok/s "
          f"({args.num_adapters} adapters of rank {args.rank}, {len(prompts) // args.num_adapters} requests each)")
    print(f"mixed / base = {result['mixed_over_base']:.2f}")
    if args.json:
        from tokenmill.entrypoints.bench_record import run_record
        result.update(run_record("python docs/bench/lora_throughput.py " + shlex.join(sys.argv[1:])))
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
