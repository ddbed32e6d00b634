"""Write a random-weight checkpoint of another family at the default model's size (SmolLM2-135M:
hidden 576, 30 layers, 9 query / 3 KV heads of 64, FFN 1536, vocabulary 49152, tied embeddings)
with the default model's tokenizer, for speed comparisons across families on equal work:

    python docs/bench/shaped_checkpoint.py --family gemma3_text --out /tmp/shaped/gemma3
    python docs/bench/shaped_checkpoint.py --family phi3 --out /tmp/shaped/phi3
    tokenmill bench throughput --model /tmp/shaped/gemma3 --workload W1,W2,W4 --dtype bfloat16 \\
        --baseline vllm --repeat 3

Family switches are those of the family's released models: Gemma 3 five sliding (window 512) layers
to each global one, (1 + w) sandwich norms, GeGLU, q/k norms, a rope table per layer type; Phi-3 /
Phi-4-mini partial rotary (0.75); Qwen3.5 three Gated DeltaNet layers to each gated full-attention
one. Random weights decode random tokens: the speed of the arithmetic, not of any model's answers.

`--family qwen3_moe` is a mixture-of-experts model sized for a small CPU instead (MOE_SIZE: Qwen3-MoE's
switches — per-head q/k norms, every layer sparse, top-8 routing renormalized — with 48 experts of 384
over hidden 1024 and 24 layers: 1.52 B parameters, 0.34 B of them read per token), saved in bfloat16;
`--gguf Q4_0|Q8_0` also writes the same weights as a GGUF file (`model.Q4_0.gguf` in --out) laid out
as llama.cpp's convert_hf_to_gguf.py writes qwen3moe (experts stacked per layer as ffn_*_exps, the
routers and norms float32), with the default model's tokenizer, for llama.cpp and tokenmill alike
(docs/bench/moe_gguf.py).
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
    # Qwen3.5's hybrid: three Gated DeltaNet layers to each gated full-attention one, partial rotary 0.25.
    "qwen3_5_text": dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                         linear_value_head_dim=64, linear_conv_kernel_dim=4,
                         layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 7 + ["linear_attention"] * 2),
    "llama": dict(),
}
# Families with their own size (not the default model's).
MOE_SIZE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=16,
                num_key_value_heads=4, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2, num_experts=48,
                num_experts_per_tok=8, moe_intermediate_size=384, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[])
SIZED = {"qwen3_moe": (MOE_SIZE, torch.bfloat16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted([*FAMILIES, *SIZED]), required=True)
    parser.add_argument("--gguf", choices=["Q4_0", "Q8_0"], default=None,
                        help="also write the weights as a GGUF file in this format (qwen3_moe)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import transformers

    from tokenmill.core.loaders.model_source import default_model_path

    torch.manual_seed(args.seed)
    size, dtype = SIZED.get(args.family, (None, torch.float32))
    config = transformers.AutoConfig.for_model(args.family, **(size or {**SIZE, **FAMILIES[args.family]}))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(args.out)
    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tokenizer.save_pretrained(args.out)
    total = sum(p.numel() for p in model.parameters())
    where = "at the default model's size " if size is None else ""
    print(f"saved {args.family} ({total / 1e9:.2f} B parameters) {where}to {args.out}")
    if args.gguf:
        from moe_gguf import write_qwen3moe_gguf
        target = os.path.join(args.out, f"model.{args.gguf}.gguf")
        write_qwen3moe_gguf(args.out, target, args.gguf, tokenizer_from=path)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
