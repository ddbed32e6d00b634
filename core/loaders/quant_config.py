"""Which quantization a checkpoint is stored in, and how it meets the user's `quantization=`.

An HF checkpoint says it in config.json's `quantization_config` (`quant_method`: "awq",
"gptq", "compressed-tensors", "fp8" — what AutoAWQ, GPTQModel/AutoGPTQ, llm-compressor and
vLLM/transformers write); that names the quantization method (quantization/<format>.py, found
through the entry-point group), built from the config's settings (`from_config`). The user's
`quantization=` must then be None or the same name: a run-time mode (int4, int8, fp8) on a
checkpoint that is already quantized is refused rather than stacked. A format the platform
cannot run is a ValueError naming `quantization`, the format and the platforms that can.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from torch import nn

from tokenmill.plugins.platforms import discover_platforms
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from .model_source import resolve_model_source

# config.json's quant_method -> our method's name (the entry point).
CHECKPOINT_FORMATS = {"awq": "awq", "gptq": "gptq", "compressed-tensors": "compressed-tensors",
                      "compressed_tensors": "compressed-tensors", "fp8": "fp8"}


def read_quantization_config(model: Optional[str]) -> Optional[dict[str, Any]]:
    """config.json's quantization_config of the HF checkpoint `model` names; None for GGUF
    files, the default model, and unquantized checkpoints."""
    source = resolve_model_source(model)
    if source.kind != "hf":
        return None
    with open(os.path.join(source.path, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ValueError("quantization: config.json's quantization_config is not an object")
    return quant


# Formats a model's own loader dequantizes into the model dtype, so the run is unquantized: MXFP4,
# GPT-OSS's experts (core/models/gpt_oss.py, quantization/mxfp4.py).
DEQUANTIZED_AT_LOAD = ("mxfp4",)


def checkpoint_format(quant_config: Optional[dict[str, Any]]) -> Optional[str]:
    """The method name for a quantization_config (None where the model dequantizes it at load);
    ValueError naming quantization for an unknown one."""
    if quant_config is None:
        return None
    stored = str(quant_config.get("quant_method", "")).lower()
    if stored in DEQUANTIZED_AT_LOAD:
        return None
    if stored not in CHECKPOINT_FORMATS:
        raise ValueError(f"quantization: the checkpoint's quantization_config has quant_method {stored!r}, "
                         f"which tokenmill cannot load; supported: {sorted(set(CHECKPOINT_FORMATS.values()))}")
    return CHECKPOINT_FORMATS[stored]


# Formats only a checkpoint can be in (fp8 is also a run-time mode).
CHECKPOINT_ONLY = ("awq", "gptq", "compressed-tensors")


def resolve_quantization(requested: Optional[str], stored: Optional[str]) -> Optional[str]:
    """The method to run: the checkpoint's format, or the user's run-time mode on a float checkpoint."""
    if stored is None and requested in CHECKPOINT_ONLY:
        raise ValueError(f"quantization {requested!r} is a checkpoint format, and this checkpoint is not stored in it "
                         "(its config.json has no quantization_config); run-time modes: int4, int8, fp8")
    if stored is None or requested is None or requested == stored:
        return stored or requested
    raise ValueError(f"quantization {requested!r} cannot be applied to this checkpoint: it is already quantized "
                     f"as {stored!r} (config.json's quantization_config); leave quantization unset or pass {stored!r}")


def platforms_offering(name: str) -> list[str]:
    """The discovered platforms that list quantization method `name`."""
    return sorted(report.name for report in discover_platforms()
                  if name in ((report.description or {}).get("quantization") or []))


def unsupported(name: str, platform_name: str, offered: list[str], from_checkpoint: bool) -> ValueError:
    others = platforms_offering(name)
    what = f"the checkpoint's format {name!r}" if from_checkpoint else repr(name)
    return ValueError(f"quantization {what} is not supported on the {platform_name} platform "
                      f"(it offers {offered or 'none'}); platforms that run {name!r}: {others or 'none installed'}")


def drop_ignored_layers(model: nn.Module, method: QuantizationMethod, dtype: Any) -> None:
    """Layers the quantization_config leaves in float (compressed-tensors' `ignore`, AWQ's
    `modules_to_not_convert`: the method's `ignores(name)`) are stored in float: rebuild them
    with the float method before loading (a fused layer is ignored whole or not at all)."""
    ignores = getattr(method, "ignores", None)
    if ignores is None:
        return
    packed = getattr(model, "packed_modules_mapping", {})
    for name, module in model.named_modules():
        if getattr(module, "quant_method", None) is not method or not hasattr(module, "output_sizes"):
            continue
        prefix, _, leaf = name.rpartition(".")
        names = [f"{prefix}.{hf}" if prefix else hf for hf, _ in packed[leaf]] if leaf in packed else [name]
        hits = [ignores(n) for n in names]
        if not any(hits):
            continue
        if not all(hits):
            raise ValueError(f"quantization: the checkpoint's ignore list names only part of fused layer {name!r} "
                             f"({[n for n, h in zip(names, hits) if h]})")
        has_bias = getattr(module, "bias", None) is not None
        for param in list(module._parameters):
            delattr(module, param)
        module.quant_method = UnquantizedLinearMethod()
        module.quant_method.create_weights(module, module.input_size, module.output_sizes, has_bias, dtype)
