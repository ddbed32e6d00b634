"""Test helpers that write GGUF files in a chosen block format: a tiny random llama network, and
the default model re-quantized. Packing of formats gguf-py cannot quantize (K-quants) is written
here from ggml's block layouts (ggml-common.h): Q4_K by a plain min/max quantizer, the other
K-quants as random blocks with sane super-block scales (their weights are whatever gguf-py's
dequantizer reads from them, which is what the float reference uses)."""
from __future__ import annotations

from typing import Callable, Optional

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
