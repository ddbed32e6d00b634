"""MXFP4 (OCP microscaling FP4) weights as GPT-OSS checkpoints store their experts, dequantized at load.

A checkpoint with quantization_config quant_method "mxfp4" keeps each expert tensor [..., N, K] as
two tensors: `*_blocks` uint8 [..., N, K / 32, 16], two FP4 E2M1 codes a byte (the low nibble the
even element, the high nibble the odd one), and `*_scales` uint8 [..., N, K / 32], one E8M0
exponent per 32 values (value = code * 2^(scale - 127)). Everything else of such a checkpoint
(attention, router, embeddings, head) is stored in float. The model's loader joins each pair and
multiplies in the model dtype: every FP4 value times a power of two is exact in bf16 and float32.
"""
from __future__ import annotations

import torch

# The 16 E2M1 codes: sign bit 3, exponent bits 2..1, mantissa bit 0.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32            # values sharing one scale
QUANT_METHOD = "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16] and scales uint8 [..., N, G] -> [..., N, G * 32] in `dtype`;
    ValueError naming the tensor whose shape or dtype does not fit."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"mxfp4: blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                         f"(expected blocks [..., groups, {BLOCK // 2}] and scales [..., groups])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()     # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


def is_mxfp4(quantization_config: object) -> bool:
    """Whether an HF config's quantization_config (a dict or transformers' object) says MXFP4."""
    method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) \
        else getattr(quantization_config, "quant_method", None)
    return str(getattr(method, "value", method) or "").lower() == QUANT_METHOD
