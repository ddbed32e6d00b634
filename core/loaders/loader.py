"""load_model: an engine configuration -> a ready model plus everything the engine needs around it.

Order matters: the attention backend is chosen from the model's attention geometry before the
model is built (so every layer is built with it, never rebound), and the quantization method is
resolved and given the platform's kernels before the layers create their weights.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.platforms.interface import LayerKernels
from tokenmill.plugins import discovery
from tokenmill.quantization.gguf import GGUFQuantization
from tokenmill.quantization.gguf_linear import GGUFLinearMethod
from tokenmill.quantization.interface import QuantizationMethod, QuantKernels
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from ..config import EngineConfig, torch_dtype
from ..distributed import check_parallel_sizes, settle_expert_parallel
from ..errors import PathNotFoundError
from ..layers.kernels import apply_layer_kernels
from ..models.pooling_adapter import as_pooling_model
from ..models.registry import resolve_model_class
from ..models.transformers_impl import TransformersForCausalLM, check_engine_config
from ..pooler_config import PoolerConfig, resolve_pooler_config
from . import gguf_kept, gguf_loader, hf, quant_config
from .gguf_file import GGUFFile
from .kv_scales import KVScales
from .model_source import ModelSource, resolve_model_source
from .weights import load_weights, process_weights_after_loading

logger = logging.getLogger("tokenmill.loader")


class PlatformLike(Protocol):
    """What load_model asks of the platform (platforms/interface.py:Platform answers it; the core
    does not import platforms/)."""
    name: str
    dispatch_key: str

    def device(self) -> torch.device: ...
    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype: ...
    def decode_program(self, config: EngineConfig) -> Any: ...
    def quantization_methods(self) -> list[str]: ...
    def quantization_kernels(self, name: str) -> QuantKernels: ...
    def layer_kernels(self, config: EngineConfig) -> LayerKernels: ...


@dataclass
class ModelBundle:
    model: nn.Module
    hf_config: Any                       # transformers PretrainedConfig
    tokenizer: Any                       # transformers PreTrainedTokenizerBase
    source: ModelSource
    architecture: str
    weight_dtype: torch.dtype            # what the weights are (config.model.dtype)
    dtype: torch.dtype                   # what activations and the KV cache run in
    attention_backend: type              # the class every attention layer was built with
    quantization: Optional[str] = None   # config.model.quantization
    generation_defaults: dict = field(default_factory=dict)
    max_model_len: int = 2048
    eos_token_ids: list[int] = field(default_factory=list)
    pooler_config: Optional[PoolerConfig] = None   # set: a pooling (embedding) run (core/pooler_config.py)


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
        raise PathNotFoundError(f"tokenizer path {path!r} does not exist")
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


def quantization_method(name: Optional[str], platform: PlatformLike,
                        checkpoint_config: Optional[dict] = None) -> QuantizationMethod:
    """The linear method for `quantization=name`: dense for None; else one the platform runs,
    found in the registry (entry-point group tokenmill.quantization_methods), holding the
    platform's kernels, built from the checkpoint's quantization_config when it is stored
    quantized. ValueError naming `quantization` for anything else."""
    if name is None:
        return UnquantizedLinearMethod()
    offered = platform.quantization_methods()
    if name not in offered:
        raise quant_config.unsupported(name, platform.name, offered, checkpoint_config is not None)
    registered = discovery.quantization_methods()
    if name not in registered:
        raise ValueError(f"quantization {name!r} is offered by the {platform.name} platform but no such "
                         f"quantization method is installed (installed: {sorted(registered)})")
    method_cls = registered[name]
    reason = method_cls.available()
    if reason:
        raise ValueError(f"quantization {name!r} cannot run here: {reason}")
    method = method_cls.from_config(checkpoint_config) if checkpoint_config is not None else method_cls()
    method.use_kernels(platform.quantization_kernels(name))
    return method


def load_model(config: EngineConfig, platform: PlatformLike,
               choose_backend: Callable[[AttentionConfig], type], build: bool = True) -> ModelBundle:
    """Build and load the model `config` names, on `platform`, with the attention backend
    `choose_backend` picks for its geometry. `config` has been through EngineConfig.validate and
    platform.check_and_update_config (config.model.dtype is a canonical name, not "auto").
    `build` False: everything but the network (model None) — the engine of a tensor/pipeline-
    parallel run, whose workers each build and load their own shard."""
    # A checkpoint stored quantized (config.json's quantization_config) names its method.
    stored_config = quant_config.read_quantization_config(config.model.model)
    config.model.quantization = quant_config.resolve_quantization(config.model.quantization,
                                                                  quant_config.checkpoint_format(stored_config))
    method = quantization_method(config.model.quantization, platform, stored_config)   # refuse before reading weights
    weight_dtype = torch_dtype(config.model.dtype)
    dtype = platform.activation_dtype(weight_dtype)
    meta = _load_metadata(config.model.model, config.model.tokenizer)
    architecture, model_cls = resolve_model_class(meta.hf_config, discovery.model_architectures(),
                                                  config.model.model_impl)
    pooler_config = resolve_pooler_config(config.model.runner, architecture, meta.hf_config,
                                          meta.source.path if meta.gguf is None else None, config.model.pooler_config)
    if model_cls is TransformersForCausalLM:      # what transformers' modeling code cannot do here: refused
        check_engine_config(config, meta.hf_config, meta.source.kind, pooler_config is not None)
    if pooler_config is not None:     # the same network, its hidden states pooled instead of an LM head
        model_cls = as_pooling_model(model_cls)
    attn_config = model_cls.attention_config(
        meta.hf_config, dtype=dtype, kv_cache_dtype=config.cache.kv_cache_dtype, block_size=config.cache.block_size,
        graph_capture=platform.decode_program(config).backend_mode(), device=platform.dispatch_key)
    backend_cls = choose_backend(attn_config)
    parallel = config.parallel
    settle_expert_parallel(parallel, meta.hf_config)      # ignored (logged) at tp=1 or on a dense model
    check_parallel_sizes(meta.hf_config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                         parallel.enable_expert_parallel)
    if parallel.world_size > 1 and config.model.quantization is not None:
        raise ValueError(f"quantization {config.model.quantization!r} is not supported with "
                         "tensor_parallel_size/pipeline_parallel_size > 1 yet")
    net: Optional[nn.Module] = None
    if not build:
        return _bundle(config, meta, architecture, model_cls, None, weight_dtype, dtype, backend_cls, pooler_config)
    # Parameters are built on the target device, uninitialized (loading fills every one), in the
    # activation dtype: where weights are narrower (bf16 on a CPU without AMX) a platform layer
    # kernel rounds them (Bf16WeightLinear).
    with torch.device(platform.device()):
        net = model_cls(meta.hf_config, backend_cls, dtype, config.cache.kv_cache_dtype, method)
        quant_config.drop_ignored_layers(net, method, dtype)      # layers a quantized checkpoint keeps in float
    kept = isinstance(method, GGUFLinearMethod)      # quantization="gguf": blocks stay as stored
    if kept and meta.gguf is None:
        raise ValueError("quantization 'gguf' needs a GGUF checkpoint (a .gguf file)")
    if meta.gguf is not None:
        if kept:
            gguf_kept.check_formats(meta.gguf, platform)
            gguf_kept.keep_embeddings_stored(net, method)
        elif config.model.quantization is None:
            # Dequantizing is the exact mode (token-identical to transformers on this GGUF); say
            # what the file's own blocks would cost, since that is what llama.cpp users expect.
            logger.info("GGUF %s dequantized to %s at load; --quantization gguf keeps its blocks (%.1f MiB) "
                        "on native kernels", os.path.basename(meta.source.path),
                        str(weight_dtype).replace("torch.", ""),
                        os.path.getsize(meta.source.path) / 2**20)
        load_weights(net, gguf_loader.iterate_gguf_weights(meta.gguf, meta.hf_config), GGUFQuantization())
    elif isinstance(net, TransformersForCausalLM):      # transformers' own loading (key renames, tied heads)
        net.load_checkpoint(meta.source.path)
    else:
        kv_scales = KVScales()                # fp8 KV-cache scales are not weights: set on the attention layers
        # Tensor parallelism: each rank reads only its part of each tensor (hf.LazySlice).
        lazy = parallel.tensor_parallel_size > 1
        load_weights(net, kv_scales.filter(hf.iterate_safetensors(meta.source.path, lazy=lazy)))
        kv_scales.apply(net, config.cache.kv_cache_dtype)
    process_weights_after_loading(net)
    if kept:
        gguf_kept.finish(net, method)
    apply_layer_kernels(net, platform.layer_kernels(config))
    net.eval()
    return _bundle(config, meta, architecture, model_cls, net, weight_dtype, dtype, backend_cls, pooler_config)


def _bundle(config: EngineConfig, meta: _Metadata, architecture: str, model_cls: Any, net: Optional[nn.Module],
            weight_dtype: torch.dtype, dtype: torch.dtype, backend_cls: type,
            pooler_config: Optional[PoolerConfig]) -> ModelBundle:
    return ModelBundle(
        model=net, hf_config=meta.hf_config, tokenizer=meta.tokenizer, source=meta.source,
        architecture=architecture, weight_dtype=weight_dtype, dtype=dtype, attention_backend=backend_cls,
        quantization=config.model.quantization, generation_defaults=meta.generation_defaults,
        max_model_len=getattr(model_cls, "context_length", _max_model_len)(meta.hf_config),   # XLM-R: less its offset
        eos_token_ids=_eos_ids(meta), pooler_config=pooler_config)
