"""A generating decoder (Llama, Qwen2, Qwen3, ...) as a pooling model: the same network, no LM head.

vLLM's `as_embedding_model`: embedding checkpoints of decoders (Qwen3-Embedding, e5-mistral) are
the decoder's weights, saved with the LM head (architectures `Qwen3ForCausalLM`) or without it
and without the `model.` prefix (the `Qwen3Model` that sentence-transformers wraps and saves).
Both load here; the runner pools the final (normed) hidden states (core/layers/pooler.py).
"""
from __future__ import annotations

from typing import Any, Optional

_ADAPTED: dict[type, type] = {}


def as_pooling_model(cls: type) -> type:
    """`cls` itself when it is a pooling model already (an encoder), else its pooling subclass."""
    if getattr(cls, "is_pooling_model", False):
        return cls
    if cls not in _ADAPTED:
        _ADAPTED[cls] = type(f"{cls.__name__}AsPooling", (cls,), {
            "__init__": _init, "__doc__": f"{cls.__name__} without its LM head: hidden states are pooled.",
            "is_pooling_model": True, "is_causal": True, "checkpoint_name": _checkpoint_name,
            "compute_logits": _no_logits, "__module__": __name__})
    return _ADAPTED[cls]


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    super(type(self), self).__init__(*args, **kwargs)
    del self.lm_head            # its weight (tied or not) is never read: no parameter to load


def _checkpoint_name(self: Any, name: str) -> Optional[str]:
    if name.startswith("lm_head."):
        return None
    return name if name.startswith("model.") else "model." + name


def _no_logits(self: Any, hidden: Any) -> Any:
    raise RuntimeError("a pooling model has no LM head: it computes no logits")
