"""GGUF dequantization: every supported type, written to a real GGUF file and read back.

Types gguf-py can quantize are round-tripped from known floats (error within the format's step);
K-quants, which gguf-py cannot quantize, are built as raw blocks and checked against an
independent implementation of ggml's block layout (ggml-quants.c) plus gguf-py's reference.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tokenmill.core.loaders.gguf_file import GGUFFile
from tokenmill.quantization.gguf import SUPPORTED_TYPES, GGUFQuantization, GGUFTensor, dequantize
from tokenmill.quantization.interface import QUANTIZATION_API_VERSION, QuantizationMethod

ROWS, COLS = 8, 512        # two 256-value super-blocks per row
RNG = np.random.default_rng(0)


def _write_and_read(tmp_path, name: str, data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> torch.Tensor:
    """Write one tensor to a GGUF file, read it with our reader, dequantize it with ours."""
    path = str(tmp_path / f"{name}.gguf")
    writer = GGUFWriter(path, "llama")
    # uint8 data is taken as block bytes of raw_dtype; the writer derives the value shape
    writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    info = f.tensors[name]
    assert info.shape == shape and info.qtype == qtype
    out = dequantize(f.raw(name), info.qtype, info.shape, tensor_name=name)
    assert out.dtype == torch.float32 and tuple(out.shape) == shape
    return out


# ---------------------------------------------------------------- float types

def test_f32(tmp_path):
    x = RNG.standard_normal((ROWS, COLS)).astype(np.float32)
    assert torch.equal(_write_and_read(tmp_path, "w", x, Q.F32, (ROWS, COLS)), torch.from_numpy(x))


def test_f16(tmp_path):
    x = RNG.standard_normal((ROWS, COLS)).astype(np.float16)
    out = _write_and_read(tmp_path, "w", x, Q.F16, (ROWS, COLS))
    assert torch.equal(out, torch.from_numpy(x.astype(np.float32)))


def test_bf16(tmp_path):
    x = torch.randn(ROWS, COLS).to(torch.bfloat16)
    raw = x.view(torch.int16).numpy().view(np.uint8).reshape(ROWS, COLS * 2)
    out = _write_and_read(tmp_path, "w", raw, Q.BF16, (ROWS, COLS))
    assert torch.equal(out, x.float())


# ---------------------------------------------------------------- quantized by gguf-py

# format -> worst-case error relative to the largest |value| of a 32-value block
_ROUNDTRIP = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 15, Q.Q5_0: 1 / 15, Q.Q5_1: 1 / 31}


@pytest.mark.parametrize("qtype", list(_ROUNDTRIP), ids=lambda q: q.name)
def test_roundtrip_from_floats(tmp_path, qtype):
    x = RNG.standard_normal((ROWS, COLS)).astype(np.float32)
    packed = gguf_quantize(x, qtype)
    out = _write_and_read(tmp_path, "w", packed, qtype, (ROWS, COLS))
    np.testing.assert_array_equal(out.numpy(), gguf_dequantize(packed, qtype))
    block_max = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    err = np.abs(out.numpy().reshape(-1, 32) - x.reshape(-1, 32))
    assert (err <= block_max * _ROUNDTRIP[qtype] * 1.01 + 1e-6).all()


# ---------------------------------------------------------------- K-quants from raw blocks

def _half(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def _random_blocks(qtype: Q, n_blocks: int) -> np.ndarray:
    """Random bytes shaped as blocks, with the fp16 super-block scales set to sane values."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = RNG.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    d = _half(RNG.uniform(0.001, 0.02, n_blocks))
    dmin = _half(RNG.uniform(0.001, 0.02, n_blocks))
    if qtype in (Q.Q4_K, Q.Q5_K):       # d, dmin first
        blocks[:, 0:2], blocks[:, 2:4] = d, dmin
    elif qtype == Q.Q2_K:               # ..., d, dmin last
        blocks[:, 80:82], blocks[:, 82:84] = d, dmin
    elif qtype in (Q.Q3_K, Q.Q6_K):     # d last
        blocks[:, size - 2:] = d
    return blocks


def _k_scale_min(scales: np.ndarray, j: int) -> tuple[int, int]:
    """ggml's get_scale_min_k4: the j-th 6-bit (scale, min) of a Q4_K/Q5_K block."""
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    return ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))


def _f16(b: np.ndarray) -> float:
    return float(b.view(np.float16)[0])


def _ref_q4_k(block: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _f16(block[0:2]), _f16(block[2:4]), block[4:16].astype(int), block[16:144].astype(int)
    y = np.empty(256)
    for chunk in range(4):
        q = qs[32 * chunk:32 * chunk + 32]
        for half, nib in ((0, q & 0xF), (1, q >> 4)):
            sc, m = _k_scale_min(scales, 2 * chunk + half)
            y[64 * chunk + 32 * half:64 * chunk + 32 * half + 32] = d * sc * nib - dmin * m
    return y


def _ref_q5_k(block: np.ndarray) -> np.ndarray:
    d, dmin = _f16(block[0:2]), _f16(block[2:4])
    scales, qh, qs = block[4:16].astype(int), block[16:48].astype(int), block[48:176].astype(int)
    y = np.empty(256)
    for chunk in range(4):
        q = qs[32 * chunk:32 * chunk + 32]
        for half, nib in ((0, q & 0xF), (1, q >> 4)):
            sc, m = _k_scale_min(scales, 2 * chunk + half)
            high = ((qh >> (2 * chunk + half)) & 1) << 4
            y[64 * chunk + 32 * half:64 * chunk + 32 * half + 32] = d * sc * (nib + high) - dmin * m
    return y


def _ref_q6_k(block: np.ndarray) -> np.ndarray:
    ql, qh = block[0:128].astype(int), block[128:192].astype(int)
    sc, d = block[192:208].view(np.int8).astype(int), _f16(block[208:210])
    y = np.empty(256)
    for n in range(2):
        l_, h_, s_, base = ql[64 * n:], qh[32 * n:], sc[8 * n:], 128 * n
        for i in range(32):
            is_ = i // 16
            q1 = ((l_[i] & 0xF) | (((h_[i] >> 0) & 3) << 4)) - 32
            q2 = ((l_[i + 32] & 0xF) | (((h_[i] >> 2) & 3) << 4)) - 32
            q3 = ((l_[i] >> 4) | (((h_[i] >> 4) & 3) << 4)) - 32
            q4 = ((l_[i + 32] >> 4) | (((h_[i] >> 6) & 3) << 4)) - 32
            y[base + i] = d * s_[is_] * q1
            y[base + i + 32] = d * s_[is_ + 2] * q2
            y[base + i + 64] = d * s_[is_ + 4] * q3
            y[base + i + 96] = d * s_[is_ + 6] * q4
    return y


def _ref_q2_k(block: np.ndarray) -> np.ndarray:
    scales, qs = block[0:16].astype(int), block[16:80].astype(int)
    d, dmin = _f16(block[80:82]), _f16(block[82:84])
    y = np.empty(256)
    out, is_ = 0, 0
    for n in range(2):
        q = qs[32 * n:32 * n + 32]
        for shift in (0, 2, 4, 6):
            for part in range(2):
                sc = scales[is_]
                is_ += 1
                vals = (q[16 * part:16 * part + 16] >> shift) & 3
                y[out:out + 16] = d * (sc & 0xF) * vals - dmin * (sc >> 4)
                out += 16
    return y


_K_REFERENCES = {Q.Q2_K: _ref_q2_k, Q.Q4_K: _ref_q4_k, Q.Q5_K: _ref_q5_k, Q.Q6_K: _ref_q6_k}


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_from_raw_blocks(tmp_path, qtype):
    blocks_per_row = COLS // 256
    blocks = _random_blocks(qtype, ROWS * blocks_per_row)
    raw = blocks.reshape(ROWS, -1)
    out = _write_and_read(tmp_path, "w", raw, qtype, (ROWS, COLS)).numpy()
    # gguf-py's reference
    np.testing.assert_array_equal(out, gguf_dequantize(raw, qtype))
    # ggml's layout math, written out independently (Q3_K's scale packing is only checked above)
    if qtype in _K_REFERENCES:
        expected = np.concatenate([_K_REFERENCES[qtype](b) for b in blocks]).reshape(ROWS, COLS)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- errors and registry

def test_every_supported_type_is_covered():
    covered = {Q.F32, Q.F16, Q.BF16, *_ROUNDTRIP, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    assert set(SUPPORTED_TYPES) == covered


def test_unsupported_type_names_it():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(np.zeros(66, dtype=np.uint8), Q.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="ggml type 999"):
        dequantize(np.zeros(4, dtype=np.uint8), 999, (1,))


def test_wrong_byte_count_is_an_error():
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros(33, dtype=np.uint8), Q.Q8_0, (64,))


def test_gguf_method_dequantizes_what_the_loader_hands_it():
    """GGUF is a checkpoint-format method: its load_tensor is the dequantization, same numerics."""
    values = RNG.standard_normal((4, 64)).astype(np.float32)
    blocks = gguf_quantize(values, Q.Q8_0)
    stored = GGUFTensor("blk.0.attn_q.weight", blocks, int(Q.Q8_0), (4, 64))
    out = GGUFQuantization().load_tensor(stored)
    assert torch.equal(out, torch.from_numpy(gguf_dequantize(blocks, Q.Q8_0)))


def test_quantization_methods_come_from_the_one_registry():
    from tokenmill.plugins import discovery
    from tokenmill.quantization.cpu_int4 import CpuInt4Quantization
    methods = discovery.quantization_methods()
    from tokenmill.quantization.gguf_linear import GGUFLinearMethod
    assert methods["gguf"] is GGUFLinearMethod and methods["int4"] is CpuInt4Quantization
    for cls in methods.values():
        assert issubclass(cls, QuantizationMethod) and cls.api_version == QUANTIZATION_API_VERSION
