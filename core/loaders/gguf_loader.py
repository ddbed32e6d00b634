"""GGUF checkpoints: HF config and tokenizer rebuilt from the metadata, tensors renamed to HF
names and llama.cpp's converter transforms undone (per family: core/loaders/gguf_families.py).
Tensors stay as stored (GGUFTensor); the GGUF checkpoint-format method (quantization/gguf.py)
dequantizes each one as it is loaded."""
from __future__ import annotations

import re
from typing import Any, Iterator, Optional

import numpy as np

from tokenmill.quantization.gguf import GGUFTensor, dequantize

from .gguf_families import FAMILIES, GGUFFamily, build_config, family_of
from .gguf_file import GGUFFile

# GGUF architecture -> (HF model_type, HF architecture class name); core/loaders/gguf_families.py
# says how each is read.
GGUF_ARCHITECTURES = {arch: (f.model_type, f.architecture) for arch, f in FAMILIES.items()}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
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
    # Mixture-of-experts blocks: the router, the shared expert and its gate (Qwen2-MoE); the stacked
    # experts (ffn_*_exps, [E, rows, cols]) are cut into per-expert tensors (_split_experts).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_exps": "mlp.experts",
    "ffn_up_exps": "mlp.experts",
    "ffn_down_exps": "mlp.experts",
}
# Stacked experts -> each expert's HF tensor: (Qwen-MoE name, Mixtral name).
_EXPERT_PARTS = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                 "ffn_down_exps": ("down_proj", "w2")}
# Mixtral files of llama.cpp's converter before stacked experts: one tensor per expert, ffn_gate.{e}.
_LEGACY_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_LEGACY_EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that are not weights of the HF network (rope factors become config values).
_NON_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_GENERATION_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def hf_tensor_name(gguf_name: str, block_names: Optional[dict] = None) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    names = {**_BLOCK_NAMES, **(block_names or {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF equivalent")


def hf_architecture(gguf: GGUFFile) -> tuple[str, str]:
    return family_of(gguf).resolve(gguf)


def gguf_config(gguf: GGUFFile) -> Any:
    """A transformers PretrainedConfig for the network this GGUF holds."""
    family = family_of(gguf)
    model_type, arch_class = family.resolve(gguf)
    a = gguf.arch_value
    num_heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    embedding = gguf.tensors.get("token_embd.weight")
    # The embedding's rows first: Gemma 3's converter trims them below config.vocab_size.
    vocab_size = (embedding.shape[0] if embedding is not None else None) or a("vocab_size") or \
        (len(tokens) if isinstance(tokens, list) else tokens)
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
    scaling_type = a("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": float(a("rope.scaling.factor", 1.0))}
        if a("rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length"))
        kwargs["rope_scaling"] = scaling
    family.configure(gguf, kwargs)
    config = build_config(family, model_type, kwargs)
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


def _split_rows(name: str, info: Any, data: np.ndarray, sizes: list[int],
                names: list[str]) -> list[tuple[str, GGUFTensor]]:
    """A fused tensor (q/k/v, gate/up) cut into its parts by output rows. ggml blocks run along a
    row, so each part's stored bytes are whole rows of the original: exact in every format."""
    by_row = np.asarray(data).reshape(info.shape[0], -1)
    out, start = [], 0
    for size, part in zip(sizes, names):
        rows = by_row[start:start + size].reshape(-1)
        out.append((part, GGUFTensor(f"{name}[{start}:{start + size}]", rows, info.qtype, (size, *info.shape[1:]))))
        start += size
    return out


def _split_experts(name: str, info: Any, data: np.ndarray, hf_name: str, part: str) -> list[tuple[str, GGUFTensor]]:
    """A stacked experts tensor [E, rows, cols] cut into E tensors [rows, cols] named
    `{hf_name}.{e}.{part}.weight`. Each expert's blocks are whole rows of the stored bytes: exact in
    every format, and a kept-quantized load keeps each expert's blocks as stored."""
    num = info.shape[0]
    by_expert = np.asarray(data).reshape(num, -1)
    prefix = hf_name.rpartition(".")[0]
    return [(f"{prefix}.{e}.{part}.weight", GGUFTensor(f"{name}[{e}]", by_expert[e], info.qtype, tuple(info.shape[1:])))
            for e in range(num)]


def _unshifted(name: str, info: Any, data: np.ndarray, shift: float) -> GGUFTensor:
    """A norm weight the converter stored as (1 + w) (Gemma): w again, as float32."""
    values = dequantize(data, info.qtype, info.shape).numpy() - np.float32(shift)
    return GGUFTensor(name, np.ascontiguousarray(values, dtype=np.float32).view(np.uint8), 0, info.shape)


def _family_tensors(family: GGUFFamily, config: Any, name: str, info: Any,
                    data: np.ndarray) -> list[tuple[str, GGUFTensor]]:
    legacy = _LEGACY_EXPERT_RE.match(name)
    if legacy is not None:
        layer, part, expert = legacy.groups()
        return [(f"model.layers.{layer}.mlp.experts.{expert}.{_LEGACY_EXPERT_NAMES[part]}.weight",
                 GGUFTensor(name, data, info.qtype, info.shape))]
    hf_name = hf_tensor_name(name.replace(".attn_qkv.", ".attn_q."), dict(family.block_names))
    kind = name.split(".")[-2] if name.startswith("blk.") else ""
    if kind in _EXPERT_PARTS:
        return _split_experts(name, info, data, hf_name, _EXPERT_PARTS[kind][config.model_type == "mixtral"])
    if kind == "ffn_gate_inp_shexp" and len(info.shape) == 1:        # stored as a vector: HF's [1, hidden]
        return [(hf_name, GGUFTensor(name, data, info.qtype, (1, info.shape[0])))]
    if family.norm_shift and name.endswith("norm.weight"):
        return [(hf_name, _unshifted(name, info, data, family.norm_shift))]
    if kind == "attn_qkv":
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = [config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d]
        return _split_rows(name, info, data, sizes, [hf_name.replace(".q_proj.", f".{p}.") for p in
                                                     ("q_proj", "k_proj", "v_proj")])
    if kind == "ffn_up" and family.fused_ffn_up and info.shape[0] == 2 * config.intermediate_size:
        half = config.intermediate_size
        return _split_rows(name, info, data, [half, half], [hf_name.replace(".up_proj.", ".gate_proj."), hf_name])
    if family.permuted_qk and kind in ("attn_q", "attn_k"):
        # HF pairs rotary dims (i, i + D/2); llama.cpp's converter interleaved them.
        heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
        data = _unpermute_rows(data, info.shape[0], heads)
    return [(hf_name, GGUFTensor(name, data, info.qtype, info.shape))]


def iterate_gguf_weights(gguf: GGUFFile, config: Any) -> Iterator[tuple[str, GGUFTensor]]:
    """(HF name, stored tensor) for every weight of the file, the converter's transforms undone:
    Q/K un-permuted where it permuted them, Gemma's norms back to w, fused q/k/v and gate/up split
    into the HF parts (whole rows of the stored blocks, so kept-quantized loading splits them too)."""
    family = family_of(gguf)
    for name, info in gguf.tensors.items():
        if name in _NON_WEIGHTS:
            continue
        yield from _family_tensors(family, config, name, info, gguf.raw(name))


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
