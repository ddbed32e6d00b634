"""quantization="gguf": loading a GGUF file with its blocks kept (quantization/gguf_linear.py).

Before loading: refuse a block format the platform cannot run (ValueError naming `quantization`,
the format and the platforms that can), and make the token embedding and LM head load as stored
too. After: the embedding is wrapped so lookups dequantize only the rows they gather, and a tied
head multiplies from the same stored rows.
"""
from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from tokenmill.quantization.gguf import qtype_name
from tokenmill.quantization.gguf_blocks import FLOAT

from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.stored_embedding import StoredVocabEmbedding
from .gguf_file import GGUFFile


def _formats(platform: Any) -> dict[str, str]:
    ask = getattr(platform, "native_quantization_formats", None)
    return dict(ask()) if ask is not None else {}


def _platforms_running(fmt: str, reports: Iterable[Any]) -> list[str]:
    return sorted(r.name for r in reports if fmt in ((r.description or {}).get("quantization_formats") or {}))


def check_formats(gguf: GGUFFile, platform: Any) -> None:
    """ValueError when a stored block format is not one `platform` runs kept quantized."""
    offered = _formats(platform)
    missing: dict[str, str] = {}
    for name, info in gguf.tensors.items():
        if int(info.qtype) in {int(q) for q in FLOAT}:
            continue
        fmt = f"gguf:{qtype_name(info.qtype)}"
        if fmt not in offered:
            missing.setdefault(fmt, name)
    if not missing:
        return
    from tokenmill.plugins import discovery

    reports = discovery.discover_platforms()
    fmt, tensor = next(iter(missing.items()))
    can = _platforms_running(fmt, reports)
    raise ValueError(f"quantization 'gguf': the {platform.name} platform cannot run the GGUF format "
                     f"{fmt.split(':', 1)[1]} (tensor {tensor!r}); platforms that can: {', '.join(can) or 'none'} "
                     f"(or leave quantization unset to dequantize the file to float at load)")


def _named(model: nn.Module, cls: type) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) for every submodule of type `cls`."""
    out = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, cls):
                out.append((parent, attr, child))
    return out


def keep_embeddings_stored(model: nn.Module, method: Any) -> None:
    """Embedding and LM head weights load as stored (a tied head keeps sharing the embedding's)."""
    embeddings = _named(model, VocabEmbedding)
    for _, _, emb in embeddings:
        method.keep_stored(emb)
    for _, _, head in _named(model, LMHead):
        if head.tied:
            tied = next((emb for _, _, emb in embeddings if emb.weight.shape == head.weight.shape), None)
            if tied is None:
                raise ValueError("quantization 'gguf': the tied LM head's embedding was not found")
            head.weight = tied.weight
            head.gguf_source = tied
        else:
            method.keep_stored(head)
            # Not `head.gguf_source = head`: a module set as its own attribute becomes its own
            # submodule, and walking the module tree never ends.
            object.__setattr__(head, "gguf_source", head)


def finish(model: nn.Module, method: Any) -> None:
    """After process_weights_after_loading: wrap the embeddings; the heads read their source's parts."""
    for _, _, emb in _named(model, VocabEmbedding):
        method.process_weights_after_loading(emb)      # (no quant_method of its own to be called by)
    for _, _, head in _named(model, LMHead):
        head.gguf_parts = head.gguf_source.gguf_parts
    for parent, attr, emb in _named(model, VocabEmbedding):
        setattr(parent, attr, StoredVocabEmbedding(emb, method))
