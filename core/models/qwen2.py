"""Qwen2: the Llama network with biases on q/k/v (not on o_proj)."""
from __future__ import annotations

from typing import Any

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def qkv_bias(cls, config: Any) -> bool:
        return True

    @classmethod
    def o_bias(cls, config: Any) -> bool:
        return False
