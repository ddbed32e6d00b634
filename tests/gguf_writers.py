"""Test helpers that write GGUF files in a chosen block format: a tiny random llama network, the
default model re-quantized, and any HF checkpoint of the dense families converted the way llama.cpp's
convert_hf_to_gguf.py does it (F32, or Q8_0 like its --outtype q8_0). Packing of formats gguf-py
cannot quantize (K-quants) is written here from ggml's block layouts (ggml-common.h): Q4_K by a
plain min/max quantizer, the other K-quants as random blocks with sane super-block scales (their
weights are whatever gguf-py's dequantizer reads from them, which is what the float reference uses)."""
from __future__ import annotations

import math
from typing import Callable, Optional

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

GGUF_PY_QUANTIZES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)

# Random K-quant blocks: where the fp16 super-block scales sit and a d that keeps weights ~0.05.
_K_SCALES = {Q.Q2_K: ((80, 82), 1e-3), Q.Q3_K: ((108,), 3e-4), Q.Q5_K: ((0, 2), 3e-5), Q.Q6_K: ((208,), 1.5e-5),
             Q.Q4_K: ((0, 2), 1e-4)}


def _half(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    size = GGML_QUANT_SIZES[qtype][1]
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    offsets, scale = _K_SCALES[qtype]
    for off in offsets:
        blocks[:, off:off + 2] = _half(rng.uniform(0.5 * scale, scale, n))
    return blocks.reshape(rows, -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [R, K] (K a multiple of 256) -> Q4_K bytes [R, K/256*144]: per sub-block of 32,
    w = d*sc*q - dmin*m with 6-bit sc, m and q in 0..15 (min/max rounding, no search)."""
    rows, cols = x.shape
    sub = x.reshape(-1, 8, 32).astype(np.float32)                       # super-block, sub-block, value
    low = np.minimum(sub.min(axis=-1), 0)
    step = (sub.max(axis=-1) - low) / 15
    d = (step.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(axis=-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    eff_scale = d[:, None] * sc
    q = np.round((sub + (dmin[:, None] * m)[..., None]) / np.where(eff_scale > 0, eff_scale, 1)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)
    scales = np.zeros((sub.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        scales[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)            # chunk i: sub-blocks 2i (low), 2i+1
    blocks = np.concatenate([_half(d), _half(dmin), scales, qs], axis=1)
    return blocks.reshape(rows, -1)


def quantize(x: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """float32 [R, K] -> stored bytes in `qtype` (random blocks for Q2_K, Q3_K, Q5_K, Q6_K)."""
    if qtype == Q.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if qtype in GGUF_PY_QUANTIZES:
        return gguf_quantize(x, qtype)
    if qtype == Q.Q4_K:
        return quantize_q4_k(x)
    return random_k_blocks(qtype, x.shape[0], x.shape[1], rng)


def copy_metadata(writer: GGUFWriter, source_path: str) -> None:
    """Every key of another GGUF file (network, tokenizer, chat template) but the file-format ones
    and the architecture the writer already holds: the output then loads anywhere the source does
    (llama.cpp needs the tokenizer inside the file)."""
    from gguf import GGUFReader, GGUFValueType

    for key, field in GGUFReader(source_path).fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)


def write_gguf(path: str, dims: dict, tensors: dict[str, tuple[np.ndarray, Q]],
               metadata_from: Optional[str] = None) -> None:
    """A llama GGUF with these (name -> (stored array, type)) tensors; the network's dimensions
    from `dims` and no tokenizer, or with `metadata_from` every key of that GGUF file instead."""
    writer = GGUFWriter(path, "llama")
    if metadata_from is not None:
        copy_metadata(writer, metadata_from)
        _write_tensors(writer, tensors)
        return
    writer.add_block_count(dims["layers"])
    writer.add_context_length(dims.get("context", 256))
    writer.add_embedding_length(dims["hidden"])
    writer.add_feed_forward_length(dims["intermediate"])
    writer.add_head_count(dims["heads"])
    writer.add_head_count_kv(dims["kv_heads"])
    writer.add_rope_freq_base(dims.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(dims.get("eps", 1e-5))
    writer.add_vocab_size(dims["vocab"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    _write_tensors(writer, tensors)


def _write_tensors(writer: GGUFWriter, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama_tensors(dims: dict, qtype: Q, seed: int = 0) -> tuple[dict, dict]:
    """(stored tensors in `qtype`, the same network's tensors as float32 from gguf-py's
    dequantizer): every matrix quantized, norms float32."""
    rng = np.random.default_rng(seed)
    h, f, hd = dims["hidden"], dims["intermediate"], dims["hidden"] // dims["heads"]
    shapes = {"token_embd.weight": (dims["vocab"], h)}
    for i in range(dims["layers"]):
        shapes.update({f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (dims["kv_heads"] * hd, h),
                       f"blk.{i}.attn_v.weight": (dims["kv_heads"] * hd, h), f"blk.{i}.attn_output.weight": (h, h),
                       f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                       f"blk.{i}.ffn_down.weight": (h, f)})
    stored, floats = {}, {}
    for name, shape in shapes.items():
        scale = 1.0 if name == "token_embd.weight" else shape[1] ** -0.5
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        data = quantize(x, qtype, rng)
        stored[name] = (data, qtype)
        floats[name] = (gguf_dequantize(data, qtype).reshape(shape).astype(np.float32), Q.F32)
    norms = {f"blk.{i}.{n}.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
             for i in range(dims["layers"]) for n in ("attn_norm", "ffn_norm")}
    norms["output_norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    for name, value in norms.items():
        stored[name] = floats[name] = (value, Q.F32)
    return stored, floats


def requantize_file(source, path: str, choose: Callable[[str, tuple], Optional[Q]],
                    with_tokenizer: bool = False) -> None:
    """Copy a llama GGUF (its network metadata, and with `with_tokenizer` every other key too;
    else the tokenizer comes from the source file at load), every tensor `choose(name, shape)`
    names re-quantized from its dequantized values, the rest as stored."""
    from tokenmill.quantization.gguf import dequantize

    a = source.arch_value
    dims = dict(layers=int(a("block_count")), context=int(a("context_length", 2048)),
                hidden=int(a("embedding_length")), intermediate=int(a("feed_forward_length")),
                heads=int(a("attention.head_count")), kv_heads=int(a("attention.head_count_kv")),
                rope_theta=float(a("rope.freq_base", 10000.0)), eps=float(a("attention.layer_norm_rms_epsilon")),
                vocab=int(a("vocab_size") or len(source.read_string_array("tokenizer.ggml.tokens"))))
    rng = np.random.default_rng(0)
    tensors = {}
    for name, info in source.tensors.items():
        qtype = choose(name, info.shape)
        raw = source.raw(name)
        if qtype is None:
            tensors[name] = (np.asarray(raw).reshape(info.shape[0], -1) if len(info.shape) == 2
                             else dequantize(raw, info.qtype, info.shape).numpy(), Q(info.qtype) if len(info.shape) == 2
                             else Q.F32)
            continue
        values = dequantize(raw, info.qtype, info.shape).numpy()
        tensors[name] = (quantize(values, qtype, rng), qtype)
    write_gguf(path, dims, tensors, metadata_from=source.path if with_tokenizer else None)


# ---------------------------------------------------------------- HF checkpoint -> GGUF, as llama.cpp converts it
# A small mirror of llama.cpp's convert_hf_to_gguf.py (conversion/*.py) for the dense families: each
# class's set_gguf_parameters (TextModel's base keys plus the family's own), tensor names by
# gguf-py's TensorNameMap (the converter's own map), and its tensor transforms: LlamaModel.permute
# of q/k (granite, smollm3), Gemma's norm weights + 1 and no lm_head, Cohere 2's zero biases dropped,
# Granite MoE's fused gate/up split;
# 1-D tensors and norms float32, the rest in `qtype` (the converter's --outtype q8_0).

def _text_model_keys(w: GGUFWriter, hp: dict) -> None:
    """TextModel.set_gguf_parameters."""
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    eps = next((hp[k] for k in ("rms_norm_eps", "norm_eps") if k in hp), None)
    if eps is not None:
        w.add_layer_norm_rms_eps(eps)
    eps = next((hp[k] for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon") if k in hp), None)
    if eps is not None:
        w.add_layer_norm_eps(eps)
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])


def _llama_model_keys(w: GGUFWriter, hp: dict) -> None:
    """LlamaModel (and its subclasses GraniteModel, SmolLM3Model)."""
    _text_model_keys(w, hp)
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def _gemma2_keys(w: GGUFWriter, hp: dict) -> None:
    for add, key in ((w.add_context_length, "max_position_embeddings"), (w.add_embedding_length, "hidden_size"),
                     (w.add_block_count, "num_hidden_layers"), (w.add_feed_forward_length, "intermediate_size"),
                     (w.add_head_count, "num_attention_heads"), (w.add_head_count_kv, "num_key_value_heads"),
                     (w.add_layer_norm_rms_eps, "rms_norm_eps"), (w.add_key_length, "head_dim"),
                     (w.add_value_length, "head_dim"), (w.add_attn_logit_softcapping, "attn_logit_softcapping"),
                     (w.add_final_logit_softcapping, "final_logit_softcapping"),
                     (w.add_sliding_window, "sliding_window")):
        add(hp[key])


def _gemma3_keys(w: GGUFWriter, hp: dict) -> None:
    _text_model_keys(w, hp)
    assert hp.get("attn_logit_softcapping") is None
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])


def _phi3_keys(w: GGUFWriter, hp: dict) -> None:
    rope = hp["rope_parameters"]
    # (The converter reads rope_parameters["original_max_position_embeddings"]; transformers 5 keeps
    # it at the top level of configs without rope scaling.)
    original = rope.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
    w.add_context_length(hp["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    for add, key in ((w.add_embedding_length, "hidden_size"), (w.add_feed_forward_length, "intermediate_size"),
                     (w.add_block_count, "num_hidden_layers"), (w.add_head_count, "num_attention_heads"),
                     (w.add_head_count_kv, "num_key_value_heads"), (w.add_layer_norm_rms_eps, "rms_norm_eps")):
        add(hp[key])
    rotary_pct = rope.get("partial_rotary_factor", 1.0)
    w.add_rope_dimension_count(int(rotary_pct * hp["hidden_size"]) // hp["num_attention_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(hp.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = hp["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _olmo2_keys(w: GGUFWriter, hp: dict) -> None:
    _text_model_keys(w, hp)
    if "sliding_window" in hp:
        w.add_sliding_window(hp["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])


def _granite_keys(w: GGUFWriter, hp: dict) -> None:
    _llama_model_keys(w, {k: v for k, v in hp.items() if k != "head_dim"})       # "Ignoring head_dim"
    for add, key in ((w.add_attention_scale, "attention_multiplier"), (w.add_embedding_scale, "embedding_multiplier"),
                     (w.add_residual_scale, "residual_multiplier"), (w.add_logit_scale, "logits_scaling")):
        if hp.get(key):
            add(hp[key])


def _granitemoe_keys(w: GGUFWriter, hp: dict) -> None:
    """GraniteMoeModel (GraniteMoe and GraniteMoeShared): Granite's keys, TextModel's expert counts and
    the shared expert's length."""
    _granite_keys(w, hp)
    w.add_expert_count(hp["num_local_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("shared_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hp["shared_intermediate_size"])


def _chatglm_keys(w: GGUFWriter, hp: dict) -> None:
    n_embed, n_head = hp["hidden_size"], hp["num_attention_heads"]
    w.add_context_length(hp.get("seq_length", n_embed))
    w.add_embedding_length(n_embed)
    w.add_feed_forward_length(hp.get("ffn_hidden_size", hp.get("intermediate_size", 4 * n_embed)))
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(hp.get("multi_query_group_num", hp.get("num_key_value_heads", n_head)))
    w.add_layer_norm_rms_eps(hp.get("layernorm_epsilon", 1e-5))
    w.add_rope_dimension_count(int(hp.get("attention_dim", n_embed // n_head) * hp.get("partial_rotary_factor", 0.5)))
    w.add_rope_freq_base(10000 * hp.get("rope_ratio", 1))


def _glm4_keys(w: GGUFWriter, hp: dict) -> None:
    _text_model_keys(w, hp)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    w.add_rope_dimension_count(int(dim * hp["rope_parameters"].get("partial_rotary_factor", 0.5)))


def _cohere2_keys(w: GGUFWriter, hp: dict) -> None:
    _text_model_keys(w, hp)
    w.add_logit_scale(hp["logit_scale"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(int(hp.get("rotary_pct", 1.0) * (hp["hidden_size"] // hp["num_attention_heads"])))
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _exaone4_keys(w: GGUFWriter, hp: dict) -> None:
    _text_model_keys(w, hp)
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("sliding_window") is not None:
        w.add_sliding_window(hp["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])


CONVERTER_KEYS = {"gemma2": _gemma2_keys, "gemma3": _gemma3_keys, "phi3": _phi3_keys, "olmo2": _olmo2_keys,
                  "granite": _granite_keys, "smollm3": _llama_model_keys, "chatglm": _chatglm_keys,
                  "glm4": _glm4_keys, "cohere2": _cohere2_keys, "exaone4": _exaone4_keys,
                  "starcoder2": _text_model_keys, "granitemoe": _granitemoe_keys}
_PERMUTES_QK = ("granite", "granitemoe", "smollm3")            # LlamaModel subclasses
# GraniteMoeModel.modify_tensors: the fused gate/up of the experts and the shared expert split in two.
_SPLIT_GATE_UP = {"block_sparse_moe.input_linear.weight": ("ffn_gate_exps", "ffn_up_exps"),
                  "shared_mlp.input_linear.weight": ("ffn_gate_shexp", "ffn_up_shexp")}
_NORM_PLUS_ONE = ("gemma2", "gemma3")


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_hf_checkpoint(hf_dir: str, path: str, arch: str, qtype: Q = Q.F32) -> None:
    """Write the HF checkpoint in `hf_dir` as a GGUF of `arch`, laid out as llama.cpp's converter does."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    hp = AutoConfig.from_pretrained(hf_dir).to_dict()
    writer = GGUFWriter(path, arch)
    CONVERTER_KEYS[arch](writer, hp)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], hp["num_hidden_layers"])
    tensors = {}
    rope = hp.get("rope_parameters") or {}
    if arch == "phi3" and rope.get("long_factor"):          # Phi3MiniModel.generate_extra_tensors
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
    for name, value in load_file(f"{hf_dir}/model.safetensors").items():
        value = value.astype(np.float32)
        if arch in _NORM_PLUS_ONE and name == "lm_head.weight":
            continue
        if arch == "cohere2" and name.endswith(".bias"):
            assert not value.any(), name
            continue
        if arch in _PERMUTES_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = _llama_permute(value, hp["num_attention_heads"])
        if arch in _PERMUTES_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = _llama_permute(value, hp["num_key_value_heads"])
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            value = value + 1
        split = next((parts for suffix, parts in _SPLIT_GATE_UP.items() if name.endswith(suffix)), None)
        if split is not None:
            layer = name.split(".")[2]
            for part, half in zip(split, np.split(value, 2, axis=-2)):
                tensors[f"blk.{layer}.{part}.weight"] = np.ascontiguousarray(half)
            continue
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = value
    for name, value in tensors.items():
        if qtype != Q.F32 and value.ndim > 1 and name.endswith(".weight") and not name.endswith("_norm.weight"):
            writer.add_tensor(name, quantize(value, qtype, np.random.default_rng(0)), raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
