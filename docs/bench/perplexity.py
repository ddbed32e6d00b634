"""Perplexity of the default model on fixed English passages, to price a quantization in accuracy.

    python docs/bench/perplexity.py                          # weights as loaded (float32 here)
    python docs/bench/perplexity.py --quantization int4      # as shipped: int8 GEMMs for 8+ rows
    python docs/bench/perplexity.py --quantization int4 --path int4-kernel   # the <8-row path for all

Prompt logprobs come from one prefill per passage, so without --path they measure the batched
(8+ rows) numerics; --path int4-kernel routes every row count through the small-batch kernel.
"""
from __future__ import annotations

import argparse
import math

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--path", choices=["as-shipped", "int4-kernel"], default="as-shipped")
    args = parser.parse_args()
    llm = LLM(quantization=args.quantization, max_model_len=2048)
    if args.path == "int4-kernel":
        from tokenmill.quantization.cpu_int4 import CpuInt4Quantization
        for module in llm.engine.bundle.model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, CpuInt4Quantization):
                method.small_batch_rows = 1 << 30
    total_nll, total_tokens = 0.0, 0
    for passage in PASSAGES:
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
