"""Tiny configs of every native dense family (the non-default switches of each), the prompts their
tests use (longer than the sliding windows) and `save_family`: shared by tests/models/test_dense_families.py
and tests/models/test_family_fast_path.py."""
from __future__ import annotations

from model_helpers import save_random_checkpoint

VOCAB = 1000
SPECIAL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, **SPECIAL)
WINDOW = dict(sliding_window=8)            # shorter than every prompt below
# Tiny configs of every native family; where a family has switches, the non-default ones.
FAMILIES = {
    "gemma2": dict(DIMS, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, **WINDOW),
    "gemma3_text": dict(DIMS, head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=5.0,
                        layer_types=["sliding_attention", "full_attention"] * 2,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 1000000.0}}, **WINDOW),
    "phi3": dict(DIMS, partial_rotary_factor=0.5, tie_word_embeddings=False),
    "olmo2": dict(DIMS),
    "olmo3": dict(DIMS, **WINDOW),
    "granite": dict(DIMS, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=2.0),
    "glm": dict(DIMS, head_dim=16, attention_bias=True),
    "glm4": dict(DIMS, head_dim=16, attention_bias=True),
    "cohere2": dict(DIMS, logit_scale=0.5, layer_types=["sliding_attention", "full_attention"] * 2, **WINDOW),
    "exaone4": dict(DIMS, layer_types=["sliding_attention", "full_attention"] * 2, **WINDOW),
    "smollm3": dict(DIMS, no_rope_layers=[1, 1, 0, 1]),
    "starcoder2": dict(DIMS, use_bias=True, **WINDOW),
    "seed_oss": dict(DIMS, head_dim=16, attention_bias=True, attention_out_bias=True),
    "apertus": dict(DIMS),
}
ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM", "granite": "GraniteForCausalLM", "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM", "cohere2": "Cohere2ForCausalLM", "exaone4": "Exaone4ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "seed_oss": "SeedOssForCausalLM",
    "apertus": "ApertusForCausalLM",
}
# Mixed lengths over 16-token blocks and 32-token prefill chunks, all longer than the window.
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]


def save_family(model_type: str, directory, seed: int = 0):
    return save_random_checkpoint(model_type, FAMILIES[model_type], str(directory), VOCAB, seed)
