"""HF `architectures` name -> model class, for the builtin models and plugin-provided ones."""
from __future__ import annotations

import importlib
from typing import Optional

_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": "tokenmill.core.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tokenmill.core.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "tokenmill.core.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "tokenmill.core.models.qwen3:Qwen3ForCausalLM",
}


def builtin_architectures() -> list[str]:
    return sorted(_BUILTIN)


def resolve_architecture(architectures: Optional[list[str]], extra: Optional[dict] = None) -> type:
    """The model class for the first of `architectures` we know. Plugin classes (`extra`)
    win over builtins of the same name, so a plugin can replace an implementation."""
    extra = extra or {}
    for arch in architectures or []:
        if arch in extra:
            return extra[arch]
        if arch in _BUILTIN:
            module, _, attr = _BUILTIN[arch].partition(":")
            return getattr(importlib.import_module(module), attr)
    known = sorted(set(_BUILTIN) | set(extra))
    raise ValueError(f"unsupported model architecture {architectures!r}; registered architectures: "
                     + ", ".join(known))
