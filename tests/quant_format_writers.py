"""Writers of tiny quantized llama checkpoints in the on-disk layouts of AWQ (AutoAWQ "gemm"),
GPTQ (AutoGPTQ/GPTQModel v1 and v2) and compressed-tensors, for tests/models/test_quant_formats.py.

The AWQ and GPTQ packers are numpy, written from the formats' documentation (AutoAWQ's
WQLinear_GEMM.from_linear, AutoGPTQ's QuantLinear.pack), not from tokenmill's unpacking code.
compressed-tensors checkpoints come from that package's own compressors. Every writer also
puts the dequantized weights into the float transformers model it returns: the reference.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import numpy as np
import torch

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
DIMS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)


def quantize_groups(w: np.ndarray, group: int, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] -> (q [N, K] in 0..15, zero [N, K/G], fp16 scale [N, K/G]); w ~ scale * (q - zero)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group).astype(np.float64)
    if sym:           # GPTQ's symmetric grid: zero at (maxq + 1) / 2
        scale = 2 * np.abs(g).max(-1) / 15
        zero = np.full(scale.shape, 8.0)
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scale = (hi - lo) / 15
        zero = np.clip(np.round(-lo / scale), 0, 15)
    scale = scale.astype(np.float16)
    q = np.clip(np.round(g / scale.astype(np.float64)[..., None]) + zero[..., None], 0, 15)
    return q.reshape(n, k).astype(np.int64), zero.astype(np.int64), scale


def dequantize_groups(q: np.ndarray, zero: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    n, k = q.shape
    out = (q.reshape(n, k // group, group) - zero[..., None]) * scale.astype(np.float32)[..., None]
    return out.reshape(n, k).astype(np.float32)


def pack_rows(values: np.ndarray, order=range(8)) -> np.ndarray:
    """[R, C] ints 0..15 -> int32 [R, C/8]: word m's nibble j holds column 8m + order[j]."""
    r, c = values.shape
    v = values.reshape(r, c // 8, 8).astype(np.uint32)
    word = np.zeros((r, c // 8), dtype=np.uint32)
    for j, column in enumerate(order):
        word |= v[:, :, column] << np.uint32(4 * j)
    return word.view(np.int32)


def awq_tensors(w: np.ndarray, group: int) -> tuple[dict, np.ndarray]:
    q, zero, scale = quantize_groups(w, group, sym=False)
    tensors = {"qweight": pack_rows(q.T, AWQ_ORDER), "qzeros": pack_rows(zero.T, AWQ_ORDER), "scales": scale.T.copy()}
    return tensors, dequantize_groups(q, zero, scale, group)


def shared_input(name: str) -> str:
    """Layers fed the same activations (q/k/v; gate/up) share GPTQ's act-order permutation."""
    for part in ("q_proj", "k_proj", "v_proj"):
        name = name.replace(part, "qkv")
    return name.replace("gate_proj", "gate_up").replace("up_proj", "gate_up")


def gptq_tensors(w: np.ndarray, group: int, sym: bool, v2: bool, perm: Optional[np.ndarray] = None
                 ) -> tuple[dict, np.ndarray]:
    """`perm`: act-order's quantization order of the input channels (None: in order)."""
    n, k = w.shape
    perm = np.arange(k) if perm is None else perm
    qp, zero, scale = quantize_groups(w[:, perm], group, sym)
    q = np.empty_like(qp)
    q[:, perm] = qp
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // group
    stored_zero = zero if v2 else (zero - 1) & 0xF                # v1 stores zero - 1
    tensors = {"qweight": _pack_cols(q.T),
               "qzeros": pack_rows(stored_zero.T), "scales": scale.T.copy(), "g_idx": g_idx}
    deq = np.empty((n, k), dtype=np.float32)
    deq[:, perm] = dequantize_groups(qp, zero, scale, group)
    return tensors, deq


def _pack_cols(values: np.ndarray) -> np.ndarray:
    """[K, N] ints 0..15 -> int32 [K/8, N]: row i's nibble j holds row 8i + j (GPTQ's qweight)."""
    return pack_rows(values.T).T.copy()


def ct_writer(preset: str, group: int = 0, input_scale: float = 0.02):
    """(quantize(name, weight), quantization_config, scheme) from compressed-tensors' preset and
    its own compressor."""
    from compressed_tensors.compressors.naive_quantized.base import (FloatQuantizationCompressor,
                                                                     IntQuantizationCompressor)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group and scheme.weights.strategy == "group":
        scheme.weights.group_size = group
    args = scheme.weights
    fmt, compressor = (("pack-quantized", PackedQuantizationCompressor) if args.num_bits == 4
                       else ("float-quantized", FloatQuantizationCompressor) if args.type == "float"
                       else ("int-quantized", IntQuantizationCompressor))

    def quantize(name, w):
        n, k = w.shape
        if args.strategy == "group":
            view = w.reshape(n, k // args.group_size, args.group_size)
            lo, hi = view.amin(-1), view.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            lo, hi = w.amin(), w.amax()
        scale, zero = calculate_qparams(lo, hi, args)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero.to(args.zp_dtype or torch.int8)
                 if args.type == "int" else zero}
        stored = compressor.compress(state, scheme)
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            stored["input_scale"] = torch.tensor([input_scale])
        dense = compressor.decompress(dict(stored), scheme)["weight"]
        return stored, dense

    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt,
                                quantization_status="compressed").model_dump()
    return quantize, json.loads(json.dumps(config, default=str)), scheme


def build_reference(seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**DIMS)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def quantize_state(state: dict, num_layers: int, quantize: Callable[[str, torch.Tensor], tuple[dict, torch.Tensor]],
                   ignore: tuple[str, ...] = ()) -> tuple[dict, dict, int]:
    """Replace each linear layer's `weight` in the HF state dict by `quantize(name, weight)`'s
    stored tensors; -> (the new state, {layer name: dequantized weight}, stored bytes of them)."""
    state, dense, quantized_bytes = dict(state), {}, 0
    for layer in range(num_layers):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            if any(name.endswith(i) for i in ignore):
                continue
            stored, deq = quantize(name, state.pop(f"{name}.weight").float())
            for suffix, tensor in stored.items():
                tensor = torch.from_numpy(tensor) if isinstance(tensor, np.ndarray) else tensor
                state[f"{name}.{suffix}"] = tensor.contiguous()
                quantized_bytes += tensor.numel() * tensor.element_size()
            dense[name] = torch.as_tensor(deq, dtype=torch.float32)
    return state, dense, quantized_bytes


def save_checkpoint(directory: str, state: dict, config, quantization_config: Optional[dict], tokenizer) -> None:
    """An HF model directory: model.safetensors, config.json (+ quantization_config), tokenizer."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(directory)
    if quantization_config is not None:
        path = os.path.join(directory, "config.json")
        with open(path) as fh:
            data = json.load(fh)
        data["quantization_config"] = quantization_config
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2)
    tokenizer.save_pretrained(directory)


def write_checkpoint(directory: str, quantize: Callable[[str, torch.Tensor], tuple[dict, torch.Tensor]],
                     quantization_config: Optional[dict], seed: int = 0, ignore: tuple[str, ...] = ()):
    """A tiny llama in `directory` whose linear layers `quantize(name, weight)` turns into
    (stored tensors, dequantized weight); returns the float transformers model holding the
    dequantized weights, and the stored bytes of the quantized layers."""
    from model_helpers import tiny_tokenizer

    model = build_reference(seed)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state, dense, quantized_bytes = quantize_state(state, DIMS["num_hidden_layers"], quantize, ignore)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, weight in dense.items():
            modules[name].weight.copy_(weight)
    model.config.architectures = ["LlamaForCausalLM"]
    save_checkpoint(directory, state, model.config, quantization_config, tiny_tokenizer(DIMS["vocab_size"]))
    return model, quantized_bytes
