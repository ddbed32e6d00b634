"""The plumbing of ci/gpu_check.py: the report, the section decorator, the tiny offline model,
and the printed / written summary."""
from __future__ import annotations

import json
import logging
import os
import time
import traceback
from typing import Any, Callable

REPORT: dict[str, Any] = {"sections": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
GiB = 1 << 30
LOG_LINES: list[str] = []


class _Capture(logging.Handler):
    def emit(self, record):
        LOG_LINES.append(f"{record.name}: {record.getMessage()}")


def section(name: str, strict: bool = True):
    def deco(fn: Callable[..., dict]):
        def run(*args, **kwargs):
            t0 = time.time()
            try:
                result = fn(*args, **kwargs) or {}
                result.setdefault("status", "pass")
            except SkipSection as exc:
                result = {"status": "skip", "reason": str(exc)}
            except AssertionError as exc:
                result = {"status": "fail", "reason": str(exc)}
            except Exception as exc:
                result = {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc(limit=8)}
            result["strict"] = strict
            result["seconds"] = round(time.time() - t0, 1)
            REPORT["sections"][name] = result
            print(f"[{result['status'].upper():5}] {name} ({result['seconds']}s)"
                  + (f": {result.get('reason')}" if result.get("reason") else ""), flush=True)
            return result
        return run
    return deco


class SkipSection(Exception):
    pass


def make_tiny_llama(path: str) -> str:
    """A small random-weight Llama HF directory (config.json, model.safetensors, tokenizer), built
    offline with transformers + tokenizers: for machines where the default GGUF is not present.
    Weights are seeded and scaled up so that greedy choices are decisive, not near-ties."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    corpus = [p * 20 for p in PROMPTS] + ["the quick brown fox jumps over the lazy dog " * 20]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
                         initializer_range=0.08, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "To make a cup of tea, first",
]


def finish(args: Any) -> bool:
    """Print the summary, write the JSON report; True when every strict section passed."""
    REPORT["log"] = [line for line in LOG_LINES if any(k in line for k in (
        "memory profile", "captured", "CUDA graph", "device auto", "attention backend", "graph capture",
        "in use before loading"))][-40:]
    strict_ok = all(s["status"] in ("pass", "skip") for s in REPORT["sections"].values() if s["strict"])
    REPORT["ok"] = strict_ok
    REPORT["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")

    print("\n==== tokenmill GPU check ====")
    env = REPORT["sections"].get("environment", {}).get("info", {})
    print(f"torch {env.get('torch')} CUDA {env.get('torch_cuda')} on {env.get('device')} "
          f"({env.get('capability')}, {env.get('total_gib')} GiB); triton {env.get('triton')}")
    for name, s in REPORT["sections"].items():
        line = f"  {s['status']:5} {name}"
        if name.startswith("generate_") and "graphs_on" in s:
            on, off = s["graphs_on"], s["graphs_off"]
            line += (f": identical={s['identical_tokens']} backend={on['attention_backend']} "
                     f"replays={on['graph_replays']} gen {on['generate_s']}s (graphs) vs {off['generate_s']}s (eager)")
            if on.get("memory"):
                line += (f"\n        memory: {on['memory']['logged']}; free after KV alloc "
                         f"{on['memory']['free_after_kv_alloc_gib']} GiB")
        if s.get("reason"):
            line += f"\n        {s['reason']}"
        print(line)
    for line in REPORT["log"][-10:]:
        print(f"  log: {line}")
    print(f"OVERALL: {'PASS' if strict_ok else 'FAIL'}")

    text = json.dumps(REPORT, indent=2, default=str)
    targets = [args.json] if args.json else []
    if os.environ.get("OUT"):
        targets.append(os.path.join(os.environ["OUT"], "gpu_report.json"))
    for path in targets:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            print(f"report written to {path}")
        except OSError as exc:
            print(f"could not write {path}: {exc}")
    return strict_ok
