"""model_impl="transformers": any causal LM transformers can build, on tokenmill's paged KV cache.

vLLM's Transformers modeling backend. The network is transformers' own modeling code, built with
attn_implementation="tokenmill": every attention module's call goes through the function this
module registers with transformers' AttentionInterface, which hands the layer's query/key/value
to a tokenmill `Attention` layer (core/layers/attention.py) for its `layer_idx`. That layer writes
K/V into the paged cache and attends through the chosen backend with the step's metadata, so
continuous batching, chunked prefill and prefix caching work underneath unchanged. The step's
tokens stay one flat sequence: the base model runs on input_ids/position_ids [1, T]; which token
attends to which is the metadata's business (no transformers mask is built: "tokenmill" has no
mask function, which transformers takes as "the attention function masks").

What each layer asks of attention (heads, head size, scaling, window, soft-cap) is read by
running the network once on the meta device (no memory, no weights) and recording the calls:
that is what the modeling code really passes, whatever its config names things.
"""
from __future__ import annotations

import contextvars
import copy
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from ..distributed import tp_size
from ..layers.attention import Attention
from ..layers.linear import Linear
from .decoder import sliding_window as _sliding_window

logger = logging.getLogger("tokenmill.models.transformers")

ATTN_IMPLEMENTATION = "tokenmill"
# Layer kinds whose state is the KV cache; any other (mamba, linear attention, ...) keeps a
# recurrent state tokenmill does not manage.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Keyword arguments an attention call may carry that change nothing here (masking is the
# metadata's; sliding_window / softcap are read at the probe and built into the layer).
_HARMLESS_KWARGS = {"position_ids", "use_cache", "cache_position", "output_attentions", "sliding_window",
                    "softcap", "is_causal", "layer_idx"}


class TransformersUnsupported(ValueError):
    """Why the transformers implementation cannot run a checkpoint."""


@dataclass(frozen=True)
class LayerGeometry:
    """What one attention layer passes to the attention function."""
    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: Optional[int]
    soft_cap: Optional[float]


class _Probe:
    """The attention function's mode while the meta-device run records each layer's call."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.layers: list[LayerGeometry] = []

    def record(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Any, scaling: Optional[float], kwargs: dict) -> None:
        name = type(module).__name__
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise TransformersUnsupported(f"its attention module {name} has no layer_idx")
        if any(g.layer_idx == idx for g in self.layers):
            raise TransformersUnsupported(f"layer {idx} attends more than once per forward")
        if mask is not None:
            raise TransformersUnsupported(f"{name} passes its own attention mask/bias (e.g. ALiBi), which the "
                                          "paged attention backends do not take")
        # transformers' own functions read `is_causal` from the call, else from the module.
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
            raise TransformersUnsupported(f"{name} attends bidirectionally (is_causal=False)")
        unknown = sorted(k for k, v in kwargs.items() if k not in _HARMLESS_KWARGS and v is not None)
        if unknown:
            raise TransformersUnsupported(f"{name} passes {', '.join(unknown)} to attention (e.g. attention "
                                          "sinks), which tokenmill's attention layer does not take")
        if key.shape[-1] != value.shape[-1] or key.shape[-1] != query.shape[-1]:
            raise TransformersUnsupported(f"{name} has different query/key/value head sizes")
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(
            module, "sliding_window", _sliding_window(self.config, idx))
        soft_cap = kwargs["softcap"] if "softcap" in kwargs else getattr(self.config, "attn_logit_softcapping", None)
        self.layers.append(LayerGeometry(
            layer_idx=int(idx), num_heads=query.shape[1], num_kv_heads=key.shape[1], head_size=query.shape[-1],
            scale=float(scaling if scaling is not None else query.shape[-1] ** -0.5),
            sliding_window=int(window) if window else None, soft_cap=float(soft_cap) if soft_cap else None))


@dataclass
class _Run:
    """The attention function's mode during a step: this model's layers and the step's metadata."""
    layers: dict[int, Attention]
    metadata: Any


# Set around each forward (and the probe); the attention function reads it.
_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("tokenmill_transformers_step", default=None)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: Optional[float] = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, T, D], key/value [1, Hkv, T, D]
    -> ([1, T, H, D], no weights)."""
    step = _STEP.get()
    if isinstance(step, _Probe):
        step.record(module, query, key, value, attention_mask, scaling, kwargs)
        return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None
    if step is None:
        raise RuntimeError("the tokenmill attention function runs only inside TransformersForCausalLM.forward")
    layer = step.layers[module.layer_idx]
    t = query.shape[2]
    # [1, H, T, D] -> the flat [T, H*D] rows the backend takes.
    q = query[0].transpose(0, 1).reshape(t, -1)
    k = key[0].transpose(0, 1).reshape(t, -1)
    v = value[0].transpose(0, 1).reshape(t, -1)
    out = layer(q, k, v, step.metadata)
    return out.view(1, t, layer.num_heads, layer.head_size), None


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)


def _take_linears(base: nn.Module) -> int:
    """Replace the network's plain nn.Linear modules by tokenmill's Linear over the same weights, so
    the platform's dense-matmul kernel reaches them (apply_layer_kernels after loading), as vLLM's
    Transformers backend swaps in its own linear layers. Subclasses of nn.Linear keep their own
    forward; the output embedding is not in the base model. Returns how many were replaced."""
    swaps = [(name, module) for name, module in base.named_modules() if type(module) is nn.Linear]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        with torch.device("meta"):         # the parameters come from `module`, none are allocated
            linear = Linear(module.in_features, module.out_features, bias=module.bias is not None,
                            dtype=module.weight.dtype)
        linear.weight = module.weight
        linear.bias = module.bias
        setattr(base.get_submodule(parent_name) if parent_name else base, child, linear)
    return len(swaps)


def _quiet(base: nn.Module) -> nn.Module:
    """`base` without its padding check: it reads input_ids on the host each forward (a device sync,
    and impossible on meta) to warn about a missing attention mask, which is never passed here."""
    base.warn_if_padding_and_no_attention_mask = lambda *args, **kwargs: None
    return base


def hf_class(hf_config: Any) -> type:
    """transformers' causal-LM class for the checkpoint's architecture (TransformersUnsupported why not)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        names = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    reasons = []
    for name in names:
        if name not in causal:
            known = hasattr(transformers, name)
            reasons.append(f"{name} is not a causal LM class of transformers {transformers.__version__}" if known
                           else f"transformers {transformers.__version__} has no {name}")
            continue
        try:
            return getattr(transformers, name)
        except Exception as exc:   # a modeling module whose optional dependency is missing
            reasons.append(f"transformers' {name} does not import: {exc}")
    if getattr(hf_config, "auto_map", None):
        reasons.append("its modeling code is the checkpoint's own (auto_map), and tokenmill never runs a "
                       "checkpoint's code")
    raise TransformersUnsupported("; ".join(reasons) or "the config names no architecture")


_GEOMETRY: dict[str, tuple[LayerGeometry, ...]] = {}


def layer_geometry(hf_config: Any) -> tuple[LayerGeometry, ...]:
    """Each attention layer's geometry, in layer order, read from a meta-device run of the model
    (cached per config); TransformersUnsupported when the model cannot run here."""
    key = hf_config.to_json_string()
    if key not in _GEOMETRY:
        _GEOMETRY[key] = _probe(hf_config)
    return _GEOMETRY[key]


def _probe(hf_config: Any) -> tuple[LayerGeometry, ...]:
    cls = hf_class(hf_config)
    if getattr(hf_config, "is_causal", True) is False:
        raise TransformersUnsupported("its config makes it attend bidirectionally (is_causal false)")
    if getattr(hf_config, "alibi", False) or getattr(hf_config, "position_embedding_type", None) == "alibi":
        raise TransformersUnsupported("its ALiBi position bias travels in the attention mask, which the paged "
                                      "attention backends do not take")
    other = sorted(set(getattr(hf_config, "layer_types", None) or []) - _ATTENTION_LAYER_TYPES)
    if other:
        raise TransformersUnsupported(f"its {', '.join(other)} layers keep a state tokenmill's paged KV cache "
                                      "does not hold")
    _register()
    probe = _Probe(hf_config)
    token = _STEP.set(probe)
    try:
        with torch.device("meta"):
            model = cls._from_config(copy.deepcopy(hf_config), attn_implementation=ATTN_IMPLEMENTATION)
            base = _quiet(model.base_model)
            if base is model or model.get_output_embeddings() is None:
                raise TransformersUnsupported(f"{cls.__name__} has no base model / LM head to split it into")
            base(input_ids=torch.zeros(1, 2, dtype=torch.long), position_ids=torch.arange(2)[None], use_cache=False)
    except TransformersUnsupported:
        raise
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0]
        raise TransformersUnsupported(f"its attention layers could not be traced (a forward of {cls.__name__} on "
                                      f"the meta device failed: {type(exc).__name__}: {first_line})") from exc
    finally:
        _STEP.reset(token)
    layers = tuple(sorted(probe.layers, key=lambda g: g.layer_idx))
    if not layers:
        raise TransformersUnsupported(f"its attention classes do not accept a registered attention function "
                                      f"({cls.__name__} never calls transformers' AttentionInterface)")
    expected = getattr(hf_config, "num_hidden_layers", len(layers))
    if len(layers) != expected:
        raise TransformersUnsupported(f"only {len(layers)} of its {expected} layers attend through the attention "
                                      "interface (the others keep a state tokenmill does not manage)")
    shapes = {(g.num_heads, g.num_kv_heads, g.head_size) for g in layers}
    if len(shapes) > 1:
        raise TransformersUnsupported(f"its layers differ in heads / KV heads / head size {sorted(shapes)}; "
                                      "tokenmill's KV pool holds one geometry")
    if len({g.soft_cap for g in layers}) > 1:
        raise TransformersUnsupported("its layers differ in attention logit soft-capping")
    return layers


def check_engine_config(config: Any, hf_config: Any, checkpoint_kind: str, pooling: bool) -> None:
    """ValueError naming the engine argument the transformers implementation cannot honour
    (`config` an EngineConfig; `checkpoint_kind` "hf" or "gguf"; `pooling` a pooling run)."""
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={parallel.tensor_parallel_size} / pipeline_parallel_size="
                         f"{parallel.pipeline_parallel_size}: model_impl='transformers' runs on one rank only "
                         "(transformers' base_model_tp_plan is not wired to tokenmill's ranks yet)")
    if config.model.quantization is not None:
        raise ValueError(f"quantization {config.model.quantization!r} is not supported with "
                         "model_impl='transformers' (its layers are transformers' own, unquantized)")
    if config.lora.enable_lora:
        raise ValueError("enable_lora is not supported with model_impl='transformers' (LoRA adapters attach to "
                         "tokenmill's own linear layers)")
    if checkpoint_kind == "gguf":
        raise ValueError("model_impl='transformers' needs an HF checkpoint directory, not a GGUF file")
    if pooling:
        raise ValueError("runner 'pooling' is not supported with model_impl='transformers' (generation only)")
    logger.info("model_impl=transformers: transformers' %s with tokenmill's paged attention",
                hf_class(hf_config).__name__)


def unsupported_reason(hf_config: Any) -> Optional[str]:
    """None when the transformers implementation can run this checkpoint, else why not."""
    try:
        layer_geometry(hf_config)
    except TransformersUnsupported as exc:
        return str(exc)
    return None


class TransformersForCausalLM(nn.Module):
    """The model contract of core/models/llama.py:LlamaForCausalLM over transformers' modeling code.
    Weights load through `load_checkpoint` (transformers' from_pretrained: its key renames, tied
    heads and dtype rules), not the generic loader."""
    # What `tokenmill models` lists (core/models/features.py): (supported, how / why not).
    features: ClassVar[dict[str, tuple[bool, str]]] = {
        "tp": (False, "runs on one rank (transformers' base_model_tp_plan is not wired to tokenmill's ranks)"),
        "pp": (False, "the network runs whole on one rank"),
        "lora": (False, "adapters are not mapped onto transformers' module names"),
        "quantization": (False, "unquantized weights only"),
        "fast_path": (False, "no decoder_stack(): decode steps run eagerly"),
        "sliding_window": (True, "per layer, as the modeling code passes it (also attention logit soft-capping)"),
        "pooling": (False, "generation only"),
    }

    def __init__(self, hf_config: Any, attn_backend_cls: type, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        if quant_method is not None and not isinstance(quant_method, UnquantizedLinearMethod):
            raise ValueError(f"quantization is not supported with model_impl='transformers' (got "
                             f"{type(quant_method).__name__})")
        self.config = hf_config
        self.dtype = dtype
        self._hf_cls = hf_class(hf_config)
        geometry = layer_geometry(hf_config)
        self.attn_layers = nn.ModuleList(
            Attention(g.num_heads, g.head_size, g.scale, g.num_kv_heads, attn_backend_cls,
                      sliding_window=g.sliding_window, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=g.soft_cap)
            for g in geometry)
        self.attention_layers: list[Attention] = list(self.attn_layers)
        self._by_index = {g.layer_idx: layer for g, layer in zip(geometry, self.attention_layers)}
        # The loader builds the model under the platform's device context: where the weights go.
        self._device = torch.empty(0).device
        self.hf_model: Optional[nn.Module] = None

    @classmethod
    def attention_config(cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                         block_size: int = 16, graph_capture: str = "none", device: str = "cpu") -> AttentionConfig:
        geometry = layer_geometry(hf_config)
        first = geometry[0]
        windows = {g.sliding_window for g in geometry} - {None}
        return AttentionConfig(
            head_size=first.head_size, num_heads=first.num_heads, num_kv_heads=first.num_kv_heads, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, sliding_window=max(windows, default=None),
            logits_soft_cap=first.soft_cap, graph_capture=graph_capture, device=device)

    def load_checkpoint(self, path: str) -> None:
        """Build and load the network from the HF directory `path` (safetensors or .bin)."""
        model, info = self._hf_cls.from_pretrained(
            path, config=copy.deepcopy(self.config), dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=True, output_loading_info=True)
        missing = info.get("missing_keys") or []
        if missing:     # transformers would run them randomly initialized
            raise ValueError(f"the checkpoint at {path!r} lacks {len(missing)} weights of {self._hf_cls.__name__} "
                             f"(e.g. {sorted(missing)[:3]})")
        self.hf_model = model.to(self._device).eval()
        if tp_size() == 1:          # at tp > 1 transformers' tp plan owns the linears
            _take_linears(model.base_model)
        self._base = _quiet(model.base_model)
        self._lm_head = model.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                intermediate: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.hf_model is None:
            raise RuntimeError("TransformersForCausalLM.load_checkpoint has not run")
        if intermediate is not None:
            raise ValueError("pipeline parallelism is not supported with model_impl='transformers'")
        token = _STEP.set(_Run(self._by_index, attn_metadata))
        try:
            out = self._base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _STEP.reset(token)
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head plus what transformers' causal-LM forwards apply after it."""
        logits = self._lm_head(hidden)
        config = self.config
        if getattr(config, "logit_scale", None) is not None:            # Cohere
            logits = logits * config.logit_scale
        if getattr(config, "logits_scaling", None) is not None:         # Granite
            logits = logits / config.logits_scaling
        cap = getattr(config, "final_logit_softcapping", None)          # Gemma 2/3
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

