"""Perplexity of the default model on fixed English passages, to price a quantization in accuracy.

    python docs/bench/perplexity.py                          # weights as loaded (float32 here)
    python docs/bench/perplexity.py --quantization int4      # as shipped: int8 GEMMs for 8+ rows
    python docs/bench/perplexity.py --quantization int4 --path int4-kernel   # the <8-row path for all
    python docs/bench/perplexity.py --dtype bfloat16                          # bf16 weights, as prefill runs
    python docs/bench/perplexity.py --quantization int4 --path fused-decode   # what decode steps run
    python docs/bench/perplexity.py --dtype bfloat16 --path fused-decode
    python docs/bench/perplexity.py --quantization int8      # int8 weights at load, per-token int8 activations
    python docs/bench/perplexity.py --quantization fp8       # fp8 (e4m3) weights at load, W8A16
    python docs/bench/perplexity.py --quantization gguf      # the GGUF's blocks kept (quantization/gguf_linear.py)
    python docs/bench/perplexity.py --model F.gguf --tokenizer DEFAULT --quantization gguf   # any GGUF, e.g.
        one from docs/bench/requantize_gguf.py (Q4_0 ... Q8_0, Q4_K, mixed, F32 baseline)
    python docs/bench/perplexity.py --model DIR              # an HF checkpoint, e.g. one written by
        docs/bench/quantize_checkpoint.py in AWQ, GPTQ or compressed-tensors format (detected
        from its config.json); `--format float` there gives the float32 baseline as HF weights

Prompt logprobs come from one prefill per passage, so without --path they measure the batched
(8+ rows) numerics; --path int4-kernel routes every row count through the small-batch kernel;
--path fused-decode feeds each passage one token at a time through the cpu platform's fused
decode step (platforms/cpu_fused_decode.py), the numerics of every generated token there.
"""
from __future__ import annotations

import argparse
import math

import torch

from tokenmill import LLM, SamplingParams

PASSAGES = [
    "The history of the Roman Empire spans many centuries. It began when Augustus became the first "
    "emperor in 27 BC, and the western half fell in AD 476. During this time, Rome built roads, "
    "aqueducts and cities across Europe, North Africa and the Middle East. Latin spread as the "
    "language of government and law, and later gave rise to Italian, French, Spanish, Portuguese "
    "and Romanian. The eastern half, known as the Byzantine Empire, survived until 1453, when "
    "Constantinople fell to the Ottoman Turks.",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into "
    "chemical energy. In the chloroplasts of a leaf, chlorophyll absorbs mostly blue and red light. "
    "That energy splits water molecules, releasing oxygen as a by-product, and drives the reactions "
    "that fix carbon dioxide from the air into sugars. The sugars feed the plant's growth and, "
    "through food chains, nearly every other living thing on land. Over hundreds of millions of "
    "years, photosynthesis also filled the atmosphere with the oxygen that animals breathe, and the "
    "remains of ancient plants became the coal, oil and gas that power much of the modern world. "
    "Scientists study the process closely because improving its efficiency in crops could raise "
    "food production, and because artificial versions might one day make clean fuels from sunlight.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n"
    "        else:\n            result.append(b[j])\n            j += 1\n"
    "    result.extend(a[i:])\n    result.extend(b[j:])\n    return result\n",
]


def decode_nll(llm: LLM, token_ids: list[int]) -> list[float]:
    """-log p(token i+1 | tokens <= i), every token a one-token decode step (the fused path)."""
    from tokenmill.attention_backends.interface import build_metadata

    runner = llm.engine.runner
    if not hasattr(runner.forward, "fused_step"):
        raise SystemExit("this engine does not run the fused decode step (see its log for why)")
    table = list(range((len(token_ids) + runner.block_size - 1) // runner.block_size))
    values = []
    with torch.inference_mode():
        for i in range(len(token_ids) - 1):
            meta = build_metadata([1], [i + 1], [table], runner.block_size, num_decodes=1)
            hidden = runner.forward(torch.tensor([token_ids[i]]), torch.tensor([i]), meta)
            logits = runner.model.compute_logits(hidden).float()
            values.append(float(torch.log_softmax(logits[0], dim=-1)[token_ids[i + 1]]))
    return values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the default model)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer path; DEFAULT: the default model's GGUF (for files written by "
                             "docs/bench/requantize_gguf.py, which carry none)")
    parser.add_argument("--quantization", default=None, help="e.g. gguf: a GGUF file's blocks kept quantized")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--path", choices=["as-shipped", "int4-kernel", "fused-decode"], default="as-shipped")
    args = parser.parse_args()
    if args.tokenizer == "DEFAULT":
        from tokenmill.core.loaders.model_source import resolve_model_source
        args.tokenizer = resolve_model_source(None).path
    llm = LLM(model=args.model, tokenizer=args.tokenizer, quantization=args.quantization, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, max_model_len=2048)
    if args.path == "int4-kernel":
        from tokenmill.quantization.cpu_int4 import CpuInt4Quantization
        for module in llm.engine.bundle.model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, CpuInt4Quantization):
                method.small_batch_rows = 1 << 30
    total_nll, total_tokens = 0.0, 0
    for passage in PASSAGES:
        if args.path == "fused-decode":
            values = decode_nll(llm, llm.engine.tokenizer.encode(passage))
        else:
            out = llm.generate([passage], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            logprobs = [next(iter(d.values())) for d in out.prompt_logprobs if d]
            values = [lp.logprob if hasattr(lp, "logprob") else float(lp) for lp in logprobs]
        nll = -sum(values)
        total_nll += nll
        total_tokens += len(values)
        print(f"{len(values):4d} tokens  perplexity {math.exp(nll / len(values)):8.3f}  {passage[:40]!r}")
    print(f"all {total_tokens} tokens: perplexity {math.exp(total_nll / total_tokens):.3f}")


if __name__ == "__main__":
    main()
