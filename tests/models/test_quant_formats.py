"""Quantized checkpoints (AWQ, GPTQ, compressed-tensors) and the run-time modes
quantization="int8"/"fp8" on the CPU platform.

Each test writes a tiny random llama (hidden 128, 2 layers) in a format's on-disk layout
(tests/quant_format_writers.py: numpy packers for AWQ/GPTQ, compressed-tensors' own compressors)
and compares tokenmill's logits with transformers' LlamaForCausalLM holding the dequantized
weights. Weight-only formats: the same weights, so float32 rounding only (max |diff| <= 1e-4 of
the logits' range). W8A8 formats: the reference rounds every linear layer's input the way the
scheme does (int8 / FP8 per token, or the static scale), so again float rounding only, plus the
odd activation value on a rounding boundary (1e-3; measured 2e-7). Resident memory of the quantized layers is
checked against the bytes the file stores for them (within 10 %, no float copy).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from model_helpers import hf_last_logits, load_for_test, run_prompt
from quant_format_writers import LINEARS, awq_tensors, ct_writer, gptq_tensors, shared_input, write_checkpoint
from tokenmill.quantization.interface import AffineGroups
from tokenmill.core.layers.linear import Linear
from tokenmill.platforms.cpu import CpuPlatform

PROMPTS = [[1, 17, 300, 42, 999, 5, 77], [1, 8, 8, 8, 512, 640, 3, 900, 11], [1, 250]]
torch.set_num_threads(1)


def _load(directory, **kwargs):
    return load_for_test(directory, platform=CpuPlatform(), **kwargs)


def _assert_logits_match(bundle, reference, rel: float = 1e-4) -> None:
    for ids in PROMPTS:
        ours, ref = run_prompt(bundle.model, ids), hf_last_logits(reference, ids)
        scale = float(ref.max() - ref.min())
        assert float((ours - ref).abs().max()) <= rel * scale, (ids, float((ours - ref).abs().max()), scale)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _quantized_layer_bytes(model) -> int:
    total = 0
    for _name, module in model.named_modules():
        if isinstance(module, Linear):
            total += sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))
            total += sum(t.numel() * t.element_size() for t in module.buffers(recurse=False) if t is not None)
    return total


def _assert_memory_close(model, file_bytes: int) -> None:
    resident = _quantized_layer_bytes(model)
    assert abs(resident - file_bytes) <= 0.10 * file_bytes, (resident, file_bytes)
    for module in model.modules():          # no float weight left beside the stored form
        if isinstance(module, Linear):
            assert "weight" not in module._parameters or not module.weight.is_floating_point() \
                or module.weight.dtype == torch.float8_e4m3fn


# AWQ ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_logits_equal_the_dequantized_float_model(tmp_path, group):
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    reference, file_bytes = write_checkpoint(str(tmp_path), lambda name, w: awq_tensors(w.numpy(), group), config)
    bundle = _load(tmp_path)
    assert bundle.quantization == "awq"
    _assert_logits_match(bundle, reference)
    _assert_memory_close(bundle.model, file_bytes)


# GPTQ ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("group,sym,act_order,v2", [(128, True, False, False), (32, False, False, False),
                                                     (64, False, True, False), (32, True, True, True)])
def test_gptq_logits_equal_the_dequantized_float_model(tmp_path, group, sym, act_order, v2):
    rng = np.random.default_rng(group)
    perms: dict[str, np.ndarray] = {}

    def quantize(name, w):
        perm = perms.setdefault(shared_input(name), rng.permutation(w.shape[1])) if act_order else None
        return gptq_tensors(w.numpy(), group, sym, v2, perm)

    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
              "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    reference, file_bytes = write_checkpoint(str(tmp_path), quantize, config)
    bundle = _load(tmp_path)
    assert bundle.quantization == "gptq"
    _assert_logits_match(bundle, reference)
    _assert_memory_close(bundle.model, file_bytes)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_greedy_tokens_through_the_engine_equal_transformers(tmp_path, fmt):
    from tokenmill import LLM, SamplingParams
    group = 64
    rng, perms = np.random.default_rng(0), {}
    if fmt == "gptq":      # act-order, zero points
        config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True, "sym": False}
        reference, _ = write_checkpoint(str(tmp_path), lambda name, w: gptq_tensors(
            w.numpy(), group, False, False, perms.setdefault(shared_input(name), rng.permutation(w.shape[1]))), config)
    else:
        config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        reference, _ = write_checkpoint(str(tmp_path), lambda name, w: awq_tensors(w.numpy(), group), config)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_awq_modules_to_not_convert_stay_in_float(tmp_path):
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": ["down_proj"]}
    reference, _ = write_checkpoint(str(tmp_path), lambda name, w: awq_tensors(w.numpy(), 32), config,
                                    ignore=("mlp.down_proj",))
    bundle = _load(tmp_path)
    assert bundle.model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32
    _assert_logits_match(bundle, reference)


def test_affine_groups_restate_the_4bit_grid_in_groups_of_32(tmp_path):
    """What a platform's 4-bit kernel reads (QuantizationMethod.weight_form(layer, AffineGroups)): w = scale * q + low
    in groups of 32, the same weights as the layer multiplies by."""
    from tokenmill.quantization.int4_groups import dequantize, layer_groups
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    write_checkpoint(str(tmp_path), lambda name, w: awq_tensors(w.numpy(), 128), config)
    layer = _load(tmp_path).model.model.layers[1].mlp.gate_up_proj
    form = layer.quant_method.weight_form(layer, AffineGroups)
    q, scale, low, group = form.q, form.scale, form.low, form.group_size
    assert group == 32 and q.shape == (512, 128)
    w = (q.float().reshape(512, 4, 32) * scale[..., None] + low[..., None]).reshape(512, 128)
    torch.testing.assert_close(w, dequantize(layer_groups(layer)), rtol=0, atol=1e-6)


# compressed-tensors -------------------------------------------------------------------------

def _ct_writer(preset: str, group: int = 0):
    pytest.importorskip("compressed_tensors")
    return ct_writer(preset, group)


def _round_activations(reference, scheme) -> None:
    """Make the reference quantize every linear layer's input as the scheme's activations are."""
    acts = scheme.input_activations
    if acts is None:
        return

    def hook(module, inputs):
        x = inputs[0].float()
        if acts.type == "int":
            s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
            return (torch.round(x / s).clamp(-128, 127) * s,)
        s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448 if acts.dynamic else torch.tensor(0.02)
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)

    for name, module in reference.named_modules():
        if any(name.endswith(linear) for linear in LINEARS):
            module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("preset,group", [("W4A16", 32), ("W4A16", 128), ("W4A16_ASYM", 64), ("W8A8", 0),
                                          ("FP8_DYNAMIC", 0), ("FP8", 0)])
def test_compressed_tensors_logits_equal_the_dequantized_float_model(tmp_path, preset, group):
    quantize, config, scheme = _ct_writer(preset, group)
    reference, file_bytes = write_checkpoint(str(tmp_path), quantize, config)
    _round_activations(reference, scheme)
    bundle = _load(tmp_path)
    assert bundle.quantization == "compressed-tensors"
    _assert_logits_match(bundle, reference, rel=1e-4 if scheme.input_activations is None else 1e-3)
    _assert_memory_close(bundle.model, file_bytes)


def test_compressed_tensors_ignore_list_keeps_those_layers_in_float(tmp_path):
    quantize, config, scheme = _ct_writer("W4A16", 32)
    config["ignore"] = ["lm_head", "re:.*mlp.down_proj$"]
    reference, _ = write_checkpoint(str(tmp_path), quantize, config, ignore=("mlp.down_proj",))
    bundle = _load(tmp_path)
    down = bundle.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.float32 and getattr(down, "int4_nibbles", None) is None
    _assert_logits_match(bundle, reference)


def test_unsupported_compressed_tensors_scheme_is_a_value_error_naming_quantization(tmp_path):
    _, config, _ = _ct_writer("W4A16", 32)
    config["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    write_checkpoint(str(tmp_path), lambda name, w: ({"weight": w}, w), config)
    with pytest.raises(ValueError, match="quantization 'compressed-tensors'"):
        _load(tmp_path)


# Detection and refusals ---------------------------------------------------------------------

def _awq_checkpoint(directory) -> None:
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    write_checkpoint(str(directory), lambda name, w: awq_tensors(w.numpy(), 32), config)


def test_a_run_time_mode_on_a_quantized_checkpoint_is_refused(tmp_path):
    _awq_checkpoint(tmp_path)
    for mode in ("int4", "int8", "fp8", "gptq"):
        with pytest.raises(ValueError, match=r"quantization '%s'.*already quantized as 'awq'" % mode):
            _load(tmp_path, quantization=mode)
    assert _load(tmp_path, quantization="awq").quantization == "awq"     # the same name is fine


def test_a_format_the_platform_cannot_run_names_quantization_the_format_and_who_can(tmp_path):
    from model_helpers import ReferencePlatform
    _awq_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"quantization the checkpoint's format 'awq'.*reference-test.*\['cpu'"):
        load_for_test(tmp_path, platform=ReferencePlatform())


def test_a_checkpoint_format_asked_of_a_float_checkpoint_is_refused(tmp_path):
    _float_checkpoint(tmp_path)
    for fmt in ("awq", "gptq", "compressed-tensors"):
        with pytest.raises(ValueError, match=f"quantization '{fmt}' is a checkpoint format"):
            _load(tmp_path, quantization=fmt)


def test_an_unknown_quant_method_is_refused(tmp_path):
    _awq_checkpoint(tmp_path)
    path = os.path.join(tmp_path, "config.json")
    config = json.load(open(path))
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    json.dump(config, open(path, "w"))
    with pytest.raises(ValueError, match="quantization.*'bitsandbytes'"):
        _load(tmp_path)


def test_fp8_checkpoint_with_per_tensor_scales(tmp_path):
    """quant_method "fp8" (vLLM's / transformers' serialization): float8_e4m3fn weights, one
    weight_scale per tensor; a fused layer's shards keep their own."""
    def quantize(name, w):
        scale = w.abs().max() / 448
        w8 = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": w8, "weight_scale": scale.reshape(())}, w8.float() * scale

    reference, file_bytes = write_checkpoint(str(tmp_path), quantize, {"quant_method": "fp8",
                                                                       "activation_scheme": "dynamic"})
    bundle = _load(tmp_path)
    assert bundle.quantization == "fp8"
    _assert_logits_match(bundle, reference)
    _assert_memory_close(bundle.model, file_bytes)


# quantization="int8" / "fp8" at load --------------------------------------------------------

def _float_checkpoint(directory):
    return write_checkpoint(str(directory), lambda name, w: ({"weight": w}, w), None)[0]


def _reference_with(reference, quantize_weight) -> None:
    modules = dict(reference.named_modules())
    with torch.no_grad():
        for name, module in modules.items():
            if any(name.endswith(linear) for linear in LINEARS):
                module.weight.copy_(quantize_weight(module.weight))


@pytest.mark.parametrize("native", [True, False])
def test_int8_at_load_matches_per_channel_int8_weights_and_per_token_int8_activations(tmp_path, monkeypatch, native):
    """native: the cpu platform's quantize/dequantize ends around torch._int_mm; else torch ops."""
    if not native:
        monkeypatch.setattr(CpuPlatform, "quantization_kernels", lambda self, name: {})
    reference = _float_checkpoint(tmp_path)
    float_logits = hf_last_logits(reference, PROMPTS[0])
    bundle = _load(tmp_path, quantization="int8")
    assert bundle.quantization == "int8"

    def int8_weight(w):
        s = w.abs().amax(1, keepdim=True) / 127
        return torch.round(w / s).clamp(-127, 127) * s

    _reference_with(reference, int8_weight)

    class Scheme:           # dynamic per-token int8 activations, as the method runs them
        input_activations = type("A", (), {"type": "int", "dynamic": True})
    _round_activations(reference, Scheme)
    _assert_logits_match(bundle, reference, rel=1e-2)
    ours = run_prompt(bundle.model, PROMPTS[0])     # and near the float model itself
    assert float((ours - float_logits).abs().max()) < 0.05 * float(float_logits.max() - float_logits.min())
    expected = sum(m.weight.numel() + 4 * m.weight.shape[0] for n, m in reference.named_modules()
                   if any(n.endswith(linear) for linear in LINEARS))
    _assert_memory_close(bundle.model, expected)


def test_fp8_at_load_matches_per_channel_fp8_weights(tmp_path):
    reference = _float_checkpoint(tmp_path)
    bundle = _load(tmp_path, quantization="fp8")
    assert bundle.quantization == "fp8"

    def fp8_weight(w):
        s = w.abs().amax(1, keepdim=True) / 448
        return (w / s).to(torch.float8_e4m3fn).float() * s

    _reference_with(reference, fp8_weight)
    _assert_logits_match(bundle, reference)
    expected = sum(m.weight.numel() + 4 * m.weight.shape[0] for n, m in reference.named_modules()
                   if any(n.endswith(linear) for linear in LINEARS))
    _assert_memory_close(bundle.model, expected)
