"""Qwen3: the Llama network plus an RMSNorm over each q and k head before rotary."""
from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"
