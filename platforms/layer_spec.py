"""The layer spec a model offers decode programs (`model.decoder_stack()`): each layer in the shared
vocabulary of decoder layers (LayerStructure) with its tensors (DecoderLayerSpec), and the stack
around them (DecoderStackSpec). A platform's program (platforms/interface.py DecodeProgram) turns it
into its fastest form; core/models/decoder.py is the eager network that writes it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class LayerStructure:
    """The vocabulary a decoder layer is written in: what a decode program must express to run it.
    The defaults are the Llama layer; a family states only where it differs (Gemma: norm_offset 1,
    sandwich norms, gelu_tanh, soft-capping; Phi-3 / GLM: partial rotary; OLMo 2: post norms;
    SmolLM3: NoPE layers; GPT-OSS: sinks; MoE families: an expert FFN)."""
    norm: str = "rms"                  # "rms" | "layer" (LayerNorm with bias) | "layer_nobias"
    norm_offset: float = 0.0           # norm weights applied as (offset + w): Gemma's (1 + w)
    norm_placement: str = "pre"        # "pre" | "post" (after each block, OLMo 2) | "sandwich" (both)
    rotary: str = "neox"               # "neox" (rotate halves) | "gptj" (interleaved pairs) | "none" (NoPE)
    rotary_dim: Optional[int] = None   # partial rotary: the leading dims of each head; None: all
    attn_logit_softcap: Optional[float] = None
    attention_sinks: bool = False      # a learned per-head logit in the softmax's denominator
    attention: str = "mha"             # "mha" (per-head K/V, grouped or not) | "mla" (DeepSeek's latent cache)
    activation: str = "silu"           # the FFN activation: "silu" | "gelu_tanh" | "gelu" | "xielu"
    ffn: str = "dense"                 # "dense" (gated: gate_up / down) | "plain" (up / down) | "moe"
    parallel_block: bool = False       # attention and FFN read the same normed input (Cohere, GPT-J)
    residual_scale: float = 1.0        # each block's output times this before the residual add (Granite)
    qk_norm: str = "none"              # "none" | "head" (RMSNorm per head, Qwen3) | "projection" (OLMo 2)
    rope_table: str = "default"        # which of the model's rope tables: a layer type's own (Gemma 3)


LLAMA_LAYER = LayerStructure()


@dataclass
class MoeSpec:
    """An expert FFN (structure.ffn "moe") as a decode program reads it: the router (select_experts'
    switches in core/layers/moe.py), the stacked experts and what the platform's moe kernel made
    of them, and a shared expert every token runs."""
    router: Any                                # Linear [num_experts, hidden] (weight, bias)
    top_k: int
    scoring: str                               # "softmax" | "sigmoid" | "topk_softmax"
    renormalize: bool
    w13: torch.Tensor                          # [E, 2 * I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor                           # [E, H, I]
    activation: str                            # the experts' ("silu", ..., "swiglu_oai")
    num_groups: Optional[int] = None           # grouped top-k (DeepSeek V3)
    topk_groups: Optional[int] = None
    correction_bias: Optional[torch.Tensor] = None   # picks experts, does not weight them
    routed_scaling_factor: float = 1.0
    weights_in_hidden_dtype: bool = False      # routing weights rounded to the activations' dtype
    w13_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # The platform moe kernel's packed experts (its `prepare`), None where no kernel packed them.
    prepared: Any = None
    shared_gate_up: Any = None                 # the shared expert's [gate | up] Linear (None: none)
    shared_down: Any = None
    shared_gate: Any = None                    # Linear [1, hidden]: shared output times sigmoid(gate(x))
    # The layer whose `token_counter` (core/layers/expert_tokens.py) counts the routing the program
    # does in its place (None: not counted).
    counted: Any = None


@dataclass
class DecoderLayerSpec:
    """One decoder layer as a decode program reads it: its tensors and its `structure`. With the
    default structure: x += o(attn(rope(qkv(norm(x))))); x += down(silu(gate) * up) of
    gate_up(norm(x)). Linear layers are the core's (`weight` [N, K], `bias`, `quant_method` with the
    quantization interface); `attention` is the core's attention layer (`impl`: the backend,
    `kv_cache`, `scale`, `sliding_window` per layer)."""
    input_norm: Optional[torch.Tensor]         # before attention (None: the placement has none)
    post_norm: Optional[torch.Tensor]          # before the FFN
    qkv: Any
    o: Any
    gate_up: Any
    down: Any
    attention: Any
    q_norm: Optional[torch.Tensor] = None      # per-head RMSNorm of q and k before rope (Qwen3)
    k_norm: Optional[torch.Tensor] = None
    structure: LayerStructure = LLAMA_LAYER
    attn_out_norm: Optional[torch.Tensor] = None   # on attention's output (post / sandwich placements)
    ffn_out_norm: Optional[torch.Tensor] = None
    # LayerNorm biases by slot ("attn_in", "ffn_in", "attn_out", "ffn_out"), where the norm has one.
    norm_bias: dict[str, torch.Tensor] = field(default_factory=dict)
    cos_sin: Optional[torch.Tensor] = None        # this layer's rope table [positions, rotary dims] (None: NoPE)
    activation_constants: tuple[float, ...] = ()  # xIELU: (alpha_p, alpha_n, beta, eps) as applied
    # The layer as the eager model runs it: (positions, hidden, residual, attn_metadata) -> (delta,
    # stream before it), for a program that runs the layers it cannot express eagerly in between.
    eager: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None
    moe: Optional[MoeSpec] = None                 # the expert FFN where structure.ffn is "moe"


@dataclass
class DecoderStackSpec:
    """What a model offers a platform's decode program (`model.decoder_stack()`): its layers in the
    LayerStructure vocabulary, RMSNorm eps, the rope table `cos_sin` [positions, rotary dims] (cos |
    sin) and a final norm; the LM head stays the model's own."""
    embedding: torch.Tensor
    final_norm: torch.Tensor
    eps: float
    cos_sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    intermediate_size: int
    layers: list[DecoderLayerSpec]
    # The model's own lookup, ids [T] -> [T, hidden]: a step uses it where `embedding` is no dense
    # table (an embedding kept quantized, quantization="gguf": its weight only carries the shape).
    embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    embedding_scale: float = 1.0             # embeddings times this (Gemma: sqrt(hidden))
    final_logit_softcap: Optional[float] = None   # applied by the model's compute_logits
    logit_scale: float = 1.0                      # likewise (Granite 1 / logits_scaling, Cohere)
    final_norm_bias: Optional[torch.Tensor] = None   # a LayerNorm's bias
