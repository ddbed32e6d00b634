"""Qwen2: the Llama network with biases on q/k/v (not on o_proj)."""
from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
