"""HF `architectures` name -> model class.

The one registry is the entry-point group `tokenmill.model_architectures` (tokenmill's own four
models are registered there like any plugin's), read by plugins/discovery.py; this only picks
from what it found. A model class follows the contract of core/models/llama.py:LlamaForCausalLM.
`model_impl` (vLLM's --model-impl) chooses between that native class and transformers' own
modeling code (core/models/transformers_impl.py).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

MODEL_IMPLS = ("auto", "native", "transformers")


def resolve_architecture(architectures: Optional[list[str]], registered: Mapping[str, type]) -> tuple[str, type]:
    """(name, class) for the first of the checkpoint's `architectures` that is registered;
    ValueError naming them and every registered one otherwise."""
    for arch in architectures or []:
        if arch in registered:
            return arch, registered[arch]
    raise ValueError(f"unsupported model architecture {architectures!r}; registered architectures: "
                     + ", ".join(sorted(registered)))


def resolve_model_class(hf_config: Any, registered: Mapping[str, type], model_impl: str = "auto") -> tuple[str, type]:
    """(architecture, class) for `model_impl`: "native" the registered class; "transformers"
    transformers' modeling code; "auto" native when registered, else transformers. ValueError
    naming the architecture and why each implementation cannot run it otherwise."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}; got {model_impl!r}")
    architectures = list(getattr(hf_config, "architectures", None) or [])
    names = architectures or [str(getattr(hf_config, "model_type", "?"))]
    if model_impl != "transformers":
        native = next((a for a in architectures if a in registered), None)
        if native is not None:
            return native, registered[native]
    from .transformers_impl import TransformersForCausalLM, unsupported_reason

    no_native = (f"no native implementation of {' / '.join(names)} registered (registered: "
                 + ", ".join(sorted(registered)) + ")")
    why_not = unsupported_reason(hf_config)
    if model_impl == "native":
        hint = "" if why_not else "; model_impl='transformers' (or 'auto') runs it through transformers"
        raise ValueError(f"model_impl='native': {no_native}{hint}")
    if why_not is None:
        return names[0], TransformersForCausalLM
    if model_impl == "transformers":
        raise ValueError(f"model_impl='transformers' cannot run {' / '.join(names)}: {why_not}")
    raise ValueError(f"unsupported model architecture {names!r}: {no_native}; transformers: {why_not}")
