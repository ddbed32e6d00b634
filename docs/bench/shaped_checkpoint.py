"""Write a random-weight checkpoint of another family at the default model's size (SmolLM2-135M:
hidden 576, 30 layers, 9 query / 3 KV heads of 64, FFN 1536, vocabulary 49152, tied embeddings)
with the default model's tokenizer, for speed comparisons across families on equal work:

    python docs/bench/shaped_checkpoint.py --family gemma3_text --out /tmp/shaped/gemma3
    python docs/bench/shaped_checkpoint.py --family phi3 --out /tmp/shaped/phi3
    tokenmill bench throughput --model /tmp/shaped/gemma3 --workload W1,W2,W4 --dtype bfloat16 \\
        --baseline vllm --repeat 3

Family switches are those of the family's released models: Gemma 3 five sliding (window 512) layers
to each global one, (1 + w) sandwich norms, GeGLU, q/k norms, a rope table per layer type; Phi-3 /
Phi-4-mini partial rotary (0.75). Random weights decode random tokens: the speed of the arithmetic,
not of any model's answers.
"""
from __future__ import annotations

import argparse
import os

import torch

SIZE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
FAMILIES = {
    "gemma3_text": dict(query_pre_attn_scalar=64, sliding_window=512,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "phi3": dict(partial_rotary_factor=0.75),
    "llama": dict(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import transformers

    from tokenmill.core.loaders.model_source import default_model_path

    torch.manual_seed(args.seed)
    config = transformers.AutoConfig.for_model(args.family, **SIZE, **FAMILIES[args.family])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(args.out)
    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tokenizer.save_pretrained(args.out)
    print(f"saved {args.family} at the default model's size to {args.out}")


if __name__ == "__main__":
    main()
