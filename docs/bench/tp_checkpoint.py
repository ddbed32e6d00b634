"""A random-weight SmolLM2-135M-shaped Llama that splits over 2 ranks, for the -tp 2 benchmark.

The default model (SmolLM2-135M: 9 query heads, 3 KV heads) only splits at -tp 1 or 3. This one
keeps its hidden size, depth, MLP and vocabulary (so W1's token ids 1000..40000 are valid and the
FLOPs per token are the same to within 1%) with 8 query heads of 72 and 4 KV heads:

    python docs/bench/tp_checkpoint.py /tmp/smollm2-8heads
"""
from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main(path: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=72, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    # The default model's tokenizer (W1 feeds token ids; the server needs one to detokenize).
    from tokenmill.core.loaders.loader import _load_tokenizer
    from tokenmill.core.loaders.model_source import default_model_path
    _load_tokenizer(default_model_path()).save_pretrained(path)
    print(path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smollm2-8heads")
