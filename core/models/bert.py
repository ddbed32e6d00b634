"""BERT-style encoders (BertModel: bge, e5, all-MiniLM; RobertaModel / XLMRobertaModel: e5-multilingual,
bge-m3's base) as pooling models.

The HF network: word + absolute position + token type (always 0: one segment) embeddings,
LayerNorm; then per layer bidirectional self-attention and a GELU MLP, each followed by a residual
add and LayerNorm (post-norm). The output is the last layer's hidden states, which the runner
pools (core/layers/pooler.py). Attention goes through the paged KV cache like any model, with
`causal=False` in the metadata: every token attends to the whole sequence, so a prompt must be
computed in one step (the engine turns chunked prefill off for non-causal models).
Module names follow HF's, so checkpoints load as they are (one fused q/k/v projection aside).
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from ..layers.attention import Attention
from ..layers.embedding import VocabEmbedding
from ..layers.linear import Linear

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
                "silu": F.silu, "swish": F.silu}


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.position_embeddings = VocabEmbedding(config.max_position_embeddings, config.hidden_size, dtype)
        self.token_type_embeddings = VocabEmbedding(max(1, getattr(config, "type_vocab_size", 1)),
                                                    config.hidden_size, dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])     # one segment: token type 0


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = Linear(config.hidden_size, [config.hidden_size] * 3, bias=True, dtype=dtype,
                               quant_method=quant_method)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_heads,
                              attn_backend_cls, kv_cache_dtype=kv_cache_dtype)

    def forward(self, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        return self.attn(q, k, v, attn_metadata)


class BertDenseLayerNorm(nn.Module):
    """HF's BertSelfOutput / BertOutput: LayerNorm(dense(x) + residual)."""

    def __init__(self, in_size: int, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.dense = Linear(in_size, config.hidden_size, bias=True, dtype=dtype, quant_method=quant_method)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, attn_backend_cls, dtype, kv_cache_dtype, quant_method)
        self.output = BertDenseLayerNorm(config.hidden_size, config, dtype, quant_method)

    def forward(self, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        return self.output(self.self(hidden, attn_metadata), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True, dtype=dtype,
                            quant_method=quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.attention = BertAttention(config, attn_backend_cls, dtype, kv_cache_dtype, quant_method)
        self.intermediate = BertIntermediate(config, dtype, quant_method)
        self.output = BertDenseLayerNorm(config.intermediate_size, config, dtype, quant_method)

    def forward(self, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        hidden = self.attention(hidden, attn_metadata)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, attn_backend_cls, dtype, kv_cache_dtype, quant_method)
                                   for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The model contract of core/models/llama.py:LlamaForCausalLM, for a pooling model: no LM head
    (`compute_logits` refuses), `is_causal = False`, `checkpoint_name` maps HF's tensor names."""
    is_pooling_model: ClassVar[bool] = True
    is_causal: ClassVar[bool] = False
    packed_modules_mapping: ClassVar[dict[str, list[tuple[str, int]]]] = {
        "qkv_proj": [("query", 0), ("key", 1), ("value", 2)]}
    # Checkpoints of task models (BertForMaskedLM, ...) put the encoder under this prefix.
    checkpoint_prefix: ClassVar[str] = "bert."
    # What `tokenmill models` lists (core/models/features.py): (supported, how / why not).
    features: ClassVar[dict[str, tuple[bool, str]]] = {
        "tp": (False, "pooling runs stay on one rank (per-sequence state in the engine process)"),
        "pp": (False, "pooling runs stay on one rank"),
        "lora": (False, "adapters are served on decoders only"),
        "quantization": (False, "untested on encoders: weights as stored"),
        "fast_path": (False, "an encoder has no decode steps"),
        "sliding_window": (False, "bidirectional attention over the whole input"),
        "pooling": (True, "pooling only (CLS/MEAN; no LM head)"),
    }

    def __init__(self, hf_config: Any, attn_backend_cls: type, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        quant_method = quant_method or UnquantizedLinearMethod()
        self.position_offset = self.position_id_offset(hf_config)
        self.embeddings = BertEmbeddings(hf_config, dtype)
        self.encoder = BertEncoder(hf_config, attn_backend_cls, dtype, kv_cache_dtype, quant_method)
        self.attention_layers: list[Attention] = [layer.attention.self.attn for layer in self.encoder.layer]

    @classmethod
    def position_id_offset(cls, hf_config: Any) -> int:
        return 0

    @classmethod
    def context_length(cls, hf_config: Any) -> int:
        return int(hf_config.max_position_embeddings) - cls.position_id_offset(hf_config)

    @classmethod
    def attention_config(cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                         block_size: int = 16, graph_capture: str = "none", device: str = "cpu") -> AttentionConfig:
        heads = hf_config.num_attention_heads
        return AttentionConfig(head_size=hf_config.hidden_size // heads, num_heads=heads, num_kv_heads=heads,
                               dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                               graph_capture=graph_capture, device=device, causal=False)

    def checkpoint_name(self, name: str) -> Optional[str]:
        """Our parameter name for an HF tensor name; None for what is not part of the encoder
        (the pooler / MLM heads, the position_ids buffer)."""
        if name.startswith(self.checkpoint_prefix):
            name = name[len(self.checkpoint_prefix):]
        if not name.startswith(("embeddings.", "encoder.")) or name.endswith("position_ids"):
            return None
        if name.endswith(".gamma"):       # pre-2019 checkpoints name LayerNorm's weight/bias so
            return name[:-len("gamma")] + "weight"
        if name.endswith(".beta"):
            return name[:-len("beta")] + "bias"
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions + self.position_offset if self.position_offset else positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, attn_metadata)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no LM head: it computes no logits")


class RobertaModel(BertModel):
    """RoBERTa / XLM-R: the BERT network; positions count from padding_idx + 1 (HF's
    create_position_ids_from_input_ids, for inputs without padding)."""
    checkpoint_prefix = "roberta."

    @classmethod
    def position_id_offset(cls, hf_config: Any) -> int:
        return int(getattr(hf_config, "pad_token_id", 1) or 0) + 1


class XLMRobertaModel(RobertaModel):
    pass
