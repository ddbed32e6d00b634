"""The Qwen3-MoE-shaped benchmark checkpoint (docs/bench/shaped_checkpoint.py --family qwen3_moe) as a
GGUF file, laid out as llama.cpp's convert_hf_to_gguf.py writes qwen3moe: Qwen2MoeModel's keys
(expert_count, expert_used_count, expert_feed_forward_length, key/value lengths), each layer's experts
stacked per projection as blk.N.ffn_{gate,up,down}_exps [experts, rows, inputs], the router
ffn_gate_inp and the norms float32, every other matrix in Q4_0 or Q8_0 (quantized by gguf-py, as the
converter's --outtype q8_0 does), and the tokenizer keys of the default model's GGUF (llama.cpp
reads its vocabulary from the file). Both engines then run the same file: llama.cpp, and tokenmill
with quantization="gguf" (the blocks kept as stored).

    python docs/bench/shaped_checkpoint.py --family qwen3_moe --out /tmp/shaped/qwen3moe --gguf Q4_0
"""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from safetensors import safe_open

FILE_TYPES = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _experts(hp: dict) -> int:
    """transformers 5 saves Qwen3-MoE's num_experts as num_local_experts."""
    return int(hp.get("num_experts") or hp["num_local_experts"])


def _keys(w: GGUFWriter, hp: dict) -> None:
    """TextModel.set_gguf_parameters + Qwen2MoeModel's expert keys."""
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base((hp.get("rope_parameters") or {}).get("rope_theta", hp.get("rope_theta", 1000000.0)))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_expert_count(_experts(hp))
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])


def _copy_tokenizer(w: GGUFWriter, source: str) -> None:
    for key, field in GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(key, field.contents(), vtype,
                            sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)


def write_qwen3moe_gguf(hf_dir: str, path: str, qtype: str, tokenizer_from: str) -> None:
    with open(os.path.join(hf_dir, "config.json")) as f:
        hp = json.load(f)
    kind = GGMLQuantizationType[qtype]
    w = GGUFWriter(path, "qwen3moe")
    w.add_name("qwen3moe-shaped-random")
    _keys(w, hp)
    w.add_file_type(FILE_TYPES[qtype])
    _copy_tokenizer(w, tokenizer_from)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, hp["num_hidden_layers"])

    def add(name: str, value: np.ndarray) -> None:
        if value.ndim > 1 and not name.endswith(("norm.weight", "ffn_gate_inp.weight")):
            rows = quantize(value.reshape(-1, value.shape[-1]), kind)
            w.add_tensor(name, rows.reshape(*value.shape[:-1], -1), raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    for file in files:
        with safe_open(os.path.join(hf_dir, file), framework="pt") as st:
            for name in st.keys():
                value = st.get_tensor(name).to(torch.float32).numpy()
                parts = name.split(".")
                if "experts" in parts:
                    layer, e = int(parts[2]), int(parts[parts.index("experts") + 1])
                    group = experts.setdefault((layer, EXPERT_PARTS[parts[-2]]), {})
                    group[e] = value
                    if len(group) == _experts(hp):       # a whole stack: quantize it, free the floats
                        add(f"blk.{layer}.ffn_{EXPERT_PARTS[parts[-2]]}_exps.weight",
                            np.stack([group[i] for i in range(_experts(hp))]))
                        group.clear()
                    continue
                if name.endswith("mlp.gate.weight"):
                    add(f"blk.{parts[2]}.ffn_gate_inp.weight", value)
                    continue
                add(names.get_name(name, try_suffixes=(".weight", ".bias")), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
