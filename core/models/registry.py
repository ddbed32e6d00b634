"""HF `architectures` name -> model class.

The one registry is the entry-point group `tokenmill.model_architectures` (tokenmill's own four
models are registered there like any plugin's), read by plugins/discovery.py; this only picks
from what it found. A model class follows the contract of core/models/llama.py:LlamaForCausalLM.
"""
from __future__ import annotations

from typing import Mapping, Optional


def resolve_architecture(architectures: Optional[list[str]], registered: Mapping[str, type]) -> tuple[str, type]:
    """(name, class) for the first of the checkpoint's `architectures` that is registered;
    ValueError naming them and every registered one otherwise."""
    for arch in architectures or []:
        if arch in registered:
            return arch, registered[arch]
    raise ValueError(f"unsupported model architecture {architectures!r}; registered architectures: "
                     + ", ".join(sorted(registered)))
