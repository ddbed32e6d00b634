"""A model architecture contributed through the pluggy hook: tokenmill's Llama under another name."""
from __future__ import annotations

from tokenmill.core.models.llama import LlamaForCausalLM


class TestLlamaForCausalLM(LlamaForCausalLM):
    """Identical to LlamaForCausalLM; exists to show that plugins can add architectures."""
    plugin_architecture = True
