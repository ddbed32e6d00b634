"""load_model: a model source -> a ready model plus everything the engine needs around it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from ..models.registry import builtin_architectures, resolve_architecture
from . import gguf_loader, hf
from .gguf_file import GGUFFile
from .model_source import ModelSource, resolve_model_source


@dataclass
class ModelBundle:
    model: nn.Module
    hf_config: Any                       # transformers PretrainedConfig
    tokenizer: Any                       # transformers PreTrainedTokenizerBase
    generation_defaults: dict = field(default_factory=dict)
    max_model_len: int = 2048
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = ""
    source: Optional[ModelSource] = None


@dataclass
class _Metadata:
    source: ModelSource
    hf_config: Any
    tokenizer: Any
    generation_defaults: dict
    config_eos_ids: list[int]
    gguf: Optional[GGUFFile] = None


def _load_tokenizer(path: str) -> Any:
    if path.endswith(".gguf") and os.path.isfile(path):
        return gguf_loader.gguf_tokenizer(GGUFFile(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    try:
        return hf.load_hf_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {path!r} ({exc}); "
                         "pass a tokenizer directory or .gguf file explicitly") from exc


def _load_metadata(model: Optional[str], tokenizer: Optional[str]) -> _Metadata:
    source = resolve_model_source(model)
    if source.kind == "gguf":
        gguf = GGUFFile(source.path)
        config = gguf_loader.gguf_config(gguf)
        tok = _load_tokenizer(tokenizer) if tokenizer else gguf_loader.gguf_tokenizer(gguf)
        return _Metadata(source, config, tok, gguf_loader.gguf_generation_defaults(gguf),
                         gguf_loader.gguf_eos_token_ids(gguf), gguf)
    config = hf.load_hf_config(source.path)
    tok = _load_tokenizer(tokenizer or source.path)
    defaults, eos_ids = hf.read_generation_config(source.path)
    return _Metadata(source, config, tok, defaults, eos_ids)


def _eos_ids(meta: _Metadata) -> list[int]:
    ids = list(meta.config_eos_ids)
    config_eos = getattr(meta.hf_config, "eos_token_id", None)
    if config_eos is not None and not ids:
        ids = [config_eos] if isinstance(config_eos, int) else list(config_eos)
    if getattr(meta.tokenizer, "eos_token_id", None) is not None:
        ids.append(meta.tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


def _max_model_len(config: Any) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return 2048


def load_tokenizer_and_config(model: Optional[str], tokenizer: Optional[str] = None) -> tuple[Any, Any]:
    """(tokenizer, hf_config) without reading any weights (for processes that only tokenize)."""
    meta = _load_metadata(model, tokenizer)
    return meta.tokenizer, meta.hf_config


def load_model(model: Optional[str], tokenizer: Optional[str], dtype: torch.dtype, device: torch.device,
               attn_backend_cls: type, kv_cache_dtype: str = "auto",
               extra_architectures: Optional[dict] = None) -> ModelBundle:
    meta = _load_metadata(model, tokenizer)
    architectures = getattr(meta.hf_config, "architectures", None) or []
    model_cls = resolve_architecture(architectures, extra_architectures)
    known = set(extra_architectures or {}) | set(builtin_architectures())
    architecture = next(a for a in architectures if a in known)
    device = torch.device(device)
    # Build parameters directly on the target device, uninitialized: load fills every one.
    with torch.device(device):
        net = model_cls(meta.hf_config, attn_backend_cls, dtype, kv_cache_dtype)
    if meta.gguf is not None:
        weights = gguf_loader.iterate_gguf_weights(meta.gguf, meta.hf_config)
    else:
        weights = hf.iterate_safetensors(meta.source.path)
    net.load_weights(weights)
    net.eval()
    return ModelBundle(
        model=net,
        hf_config=meta.hf_config,
        tokenizer=meta.tokenizer,
        generation_defaults=meta.generation_defaults,
        max_model_len=_max_model_len(meta.hf_config),
        eos_token_ids=_eos_ids(meta),
        architecture=architecture,
        source=meta.source,
    )
