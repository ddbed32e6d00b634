"""What the cpu platform's native decode step (platforms/csrc/cpu_decode_step.cpp) runs of the
layer vocabulary (platforms/interface.py LayerStructure), and why a layer it does not run falls
back to the eager model (platforms/cpu_fused_decode.py runs such layers between native ranges)."""
from __future__ import annotations

import dataclasses

from .cpu_decode_kernels import ROWS
from .cpu_fused_moe import moe_refusals, shared_shapes_fit
from .interface import DecoderLayerSpec, DecoderStackSpec, LayerStructure



# What the native step (platforms/csrc/cpu_decode_step.cpp) runs of the layer vocabulary
# (platforms/interface.py LayerStructure), by entry: the values it expresses (entries not named take
# any value: norm offsets and placements, partial rotary, per-layer rope tables, parallel blocks,
# residual scales).
NATIVE_VALUES: dict[str, tuple] = {
    "norm": ("rms", "layer", "layer_nobias"),
    "rotary": ("neox", "gptj", "none"),
    "attention_sinks": (False,),
    "attention": ("mha",),
    "activation": ("silu", "gelu_tanh", "gelu", "xielu"),
    "ffn": ("dense", "plain", "moe"),
    "qk_norm": ("none", "head", "projection"),
}
NORM_KINDS = {"rms": 0, "layer": 1, "layer_nobias": 1}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "xielu": 3}
QK_NORMS = {"none": 0, "head": 1, "projection": 2}


def layer_refusals(layer: DecoderLayerSpec) -> list[str]:
    """What of `layer` the native step does not run: vocabulary entries ("activation relu2"), a
    backend without a native decode entry, shapes outside its blocks; empty when it runs it."""
    structure = layer.structure
    out = [f"{f.name} {getattr(structure, f.name)}" for f in dataclasses.fields(LayerStructure)
           if f.name in NATIVE_VALUES and getattr(structure, f.name) not in NATIVE_VALUES[f.name]]
    if structure.qk_norm != "none" and structure.norm != "rms":
        out.append(f"qk_norm {structure.qk_norm} with norm {structure.norm}")
    moe = structure.ffn == "moe"
    if moe:
        out += moe_refusals(layer)
    if out:
        return out
    impl = layer.attention.impl
    if impl.native_decode_fn(layer.attention.kv_cache) is None:
        out.append(f"attention backend {impl.name!r} has no native decode for this cache")
    for name in dense_linears(layer):
        shape = linear_shape(getattr(layer, name))
        if shape[0] % ROWS or shape[1] % 32:
            out.append(f"{name} {shape[0]}x{shape[1]} outside blocks of 16 x 32")
    return out + (shared_shapes_fit(getattr(layer, "moe", None), linear_shape) if moe else [])


def dense_linears(layer: DecoderLayerSpec) -> tuple[str, ...]:
    """The layer's linears the step packs as its own (an expert FFN brings its experts packed)."""
    return ("qkv", "o") if layer.structure.ffn == "moe" else ("qkv", "o", "gate_up", "down")


def outside_vocabulary(spec: DecoderStackSpec) -> list[str]:
    """Each reason some layers cannot run natively, with the layers: "layers 0-5: activation relu2",
    ...; empty when the native step runs every layer."""
    found: dict[str, list[int]] = {}
    for i, layer in enumerate(spec.layers):
        for what in layer_refusals(layer):
            found.setdefault(what, []).append(i)
    return [f"layers {ranges(layers)}: {what}" for what, layers in found.items()]


def ranges(indices: list[int]) -> str:
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)




def linear_shape(linear) -> tuple[int, int]:
    """(output rows, inputs) of a linear layer, also where its method dropped `weight` (int8 keeps
    int8_weight only)."""
    if hasattr(linear, "output_size"):
        return int(linear.output_size), int(linear.input_size)
    return tuple(linear.weight.shape)
