"""GGUF checkpoints: HF config and tokenizer rebuilt from the metadata, tensors renamed to HF
names, Q/K un-permuted for llama-family files. Tensors stay as stored (GGUFTensor); the GGUF
checkpoint-format method (quantization/gguf.py) dequantizes each one as it is loaded."""
from __future__ import annotations

import re
from typing import Any, Iterator

import numpy as np

from tokenmill.quantization.gguf import GGUFTensor, dequantize

from .gguf_file import GGUFFile

# GGUF architecture -> (HF model_type, HF architecture class name)
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# llama.cpp's converter interleaves the two rotary halves of each q/k head for these
# architectures (its rope kernel pairs adjacent dims); HF pairs dim i with i + D/2.
_PERMUTED_QK_ARCHS = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that are not weights of the HF network.
_NON_WEIGHTS = ("rope_freqs.weight",)

_GENERATION_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF equivalent")


def hf_architecture(gguf: GGUFFile) -> tuple[str, str]:
    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[arch]


def _architecture_config(model_type: str, kwargs: dict[str, Any]) -> Any:
    """The config object: a plain PretrainedConfig holding exactly the values the GGUF states,
    when those are all the model needs. Importing transformers' per-architecture config modules
    costs seconds of start-up (they pull in torch.distributed.tensor through transformers'
    kernels integration) for nothing but defaults. Sliding windows and rope scaling keep the
    architecture's own class: its derived fields (layer_types, rope_parameters) matter there."""
    if "sliding_window" in kwargs or "rope_scaling" in kwargs:
        from transformers import AutoConfig
        return AutoConfig.for_model(model_type, **kwargs)
    from transformers import PretrainedConfig
    config = PretrainedConfig(**kwargs)
    config.model_type = model_type
    return config


def gguf_config(gguf: GGUFFile) -> Any:
    """A transformers PretrainedConfig for the network this GGUF holds."""
    model_type, arch_class = hf_architecture(gguf)
    a = gguf.arch_value
    num_heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    vocab_size = a("vocab_size") or (len(tokens) if isinstance(tokens, list) else tokens)
    kwargs: dict[str, Any] = dict(
        architectures=[arch_class],
        num_hidden_layers=int(a("block_count")),
        max_position_embeddings=int(a("context_length", 2048)),
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(a("attention.head_count_kv", num_heads)),
        head_dim=int(a("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        vocab_size=int(vocab_size),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=gguf.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=gguf.metadata.get("tokenizer.ggml.padding_token_id"),
    )
    if model_type == "qwen2":
        kwargs["attention_bias"] = True
    window = a("attention.sliding_window")
    if window:
        kwargs["sliding_window"] = int(window)
        if model_type == "qwen2":
            kwargs["use_sliding_window"] = True
    scaling_type = a("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": float(a("rope.scaling.factor", 1.0))}
        if a("rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length"))
        kwargs["rope_scaling"] = scaling
    config = _architecture_config(model_type, kwargs)
    if "rope_freqs.weight" in gguf.tensors:
        # llama3-style scaling arrives as per-frequency divisors, not as config values.
        config.rope_freq_factors = dequantize(gguf.raw("rope_freqs.weight"), gguf.tensors["rope_freqs.weight"].qtype,
                                              gguf.tensors["rope_freqs.weight"].shape).tolist()
    return config


def gguf_generation_defaults(gguf: GGUFFile) -> dict:
    return {name: gguf.metadata[key] for key, name in _GENERATION_KEYS.items() if key in gguf.metadata}


def gguf_eos_token_ids(gguf: GGUFFile) -> list[int]:
    """Every end-of-generation id llama.cpp would stop on."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [int(gguf.metadata[k]) for k in keys if gguf.metadata.get(k) is not None]


def _unpermute_rows(data: np.ndarray, rows: int, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` on the stored bytes: per head, rows interleaved as (r0, r_half,
    r1, ...) go back to (first half, second half). llama.cpp viewed rows as [H, 2, D/2] and
    swapped to [H, D/2, 2]. ggml blocks run along a row, so whole rows of bytes move as they are,
    and dequantizing afterwards gives exactly the un-permuted dequantized rows."""
    by_row = np.asarray(data).reshape(rows, -1)
    return by_row.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(-1)


def iterate_gguf_weights(gguf: GGUFFile, config: Any) -> Iterator[tuple[str, GGUFTensor]]:
    """(HF name, stored tensor) for every weight of the file."""
    permuted = gguf.architecture in _PERMUTED_QK_ARCHS
    for name, info in gguf.tensors.items():
        if name in _NON_WEIGHTS:
            continue
        data = gguf.raw(name)
        if permuted and (".attn_q." in name or ".attn_k." in name):
            # HF pairs rotary dims (i, i + D/2); llama.cpp's converter interleaved them.
            data = _unpermute_rows(data, info.shape[0], config.num_attention_heads if ".attn_q." in name
                                   else config.num_key_value_heads)
        yield hf_tensor_name(name), GGUFTensor(name, data, info.qtype, info.shape)


def gguf_tokenizer(gguf: GGUFFile) -> Any:
    """The HF tokenizer (with chat template) described by the GGUF metadata.

    Fast path: feed the already-parsed metadata to transformers' GGUF tokenizer builders.
    Those are internal and move between transformers releases, so on any failure fall back to
    the public (but slower, it re-reads the whole file) `AutoTokenizer(gguf_file=...)`.
    """
    try:
        return _tokenizer_from_metadata(gguf)
    except (ImportError, AttributeError, KeyError, TypeError):
        import os
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(os.path.dirname(gguf.path), gguf_file=os.path.basename(gguf.path))


def _tokenizer_from_metadata(gguf: GGUFFile) -> Any:
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    md = dict(gguf.metadata)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key in md and not isinstance(md[key], list):
            md[key] = gguf.read_string_array(key)
    grouped = {group: {name: md[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in md}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # sentencepiece vocabularies: llama.cpp adds BOS unless the file says otherwise
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for special, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                         ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = md.get(f"tokenizer.ggml.{key}")
        tokenizer_config[special] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(gguf.architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
