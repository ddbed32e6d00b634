"""Write the default model (SmolLM2-135M-Instruct Q4_1 GGUF) re-quantized in another GGUF block
format, for docs/bench/perplexity.py and `tokenmill bench throughput` per format:

    python docs/bench/requantize_gguf.py Q4_0 /tmp/smollm2-q4_0.gguf
    python docs/bench/perplexity.py --model /tmp/smollm2-q4_0.gguf --quantization gguf
    python docs/bench/perplexity.py --model /tmp/smollm2-q4_0.gguf --dtype float32   # its float reference

Formats: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (gguf-py's quantizers) for every matrix but the token
embedding (kept as the file's Q8_0); Q4_K, which gguf-py cannot quantize, by the min/max packer
of tests/gguf_writers.py, for the matrices whose rows are whole 256-value super-blocks (SmolLM2's
ffn_down only: its other rows are 576 wide), Q4_0 for the rest (as llama.cpp's Q4_K_M falls back
per tensor); `mixed`: attention Q8_0, ffn_down Q4_K, gate/up Q4_0 (the file tests/models/test_gguf_native.py
runs). F32: every tensor dequantized to float32 (a float baseline of the same network). The values
re-quantized are the Q4_1 file's, so each format is priced against that network, not the original
bf16 one. The output carries every other key of the source file (tokenizer, chat template), so
llama.cpp loads the same file for the side-by-side runs of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import sys

from gguf import GGMLQuantizationType as Q

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from gguf_writers import requantize_file  # noqa: E402

BLOCK = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def chooser(fmt: str):
    def choose(name: str, shape: tuple) -> object:
        if len(shape) != 2:
            return None
        if fmt == "F32":
            return Q.F32
        if name == "token_embd.weight":
            return None
        if fmt in BLOCK:
            return Q[fmt]
        if fmt == "mixed" and ".attn_" in name:
            return Q.Q8_0
        return Q.Q4_K if shape[1] % 256 == 0 else Q.Q4_0
    return choose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("format", choices=BLOCK + ("Q4_K", "mixed", "F32"))
    parser.add_argument("output")
    args = parser.parse_args()
    from tokenmill.core.loaders.gguf_file import GGUFFile
    from tokenmill.core.loaders.model_source import resolve_model_source

    source = GGUFFile(resolve_model_source(None).path)
    requantize_file(source, args.output, chooser(args.format), with_tokenizer=True)
    print(f"wrote {args.output} ({os.path.getsize(args.output) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
