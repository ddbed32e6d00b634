"""An expert FFN (LayerStructure ffn "moe") inside the cpu platform's native decode step
(platforms/cpu_fused_decode.py): the layer's MoeSpec (platforms/layer_spec.py) as the FusedMoeFfn
structure of platforms/csrc/cpu_decode_step.cpp. The step then routes each token (router logits,
softmax or sigmoid scores, grouped top-k with a correction bias, renormalized, routed scaling — as
select_experts in core/layers/moe.py), runs the experts through the native MoE op (fused_moe, over
the experts the layer's moe kernel already packed: bf16 pairs, Q4 / S8 for int4 / int8 experts,
GGUF blocks kept) and adds the shared expert times sigmoid of its gate (Qwen2-MoE), all inside
the one native call per step instead of a return to the eager layer.

Why: a sparse layer run eagerly between native ranges costs two extra native calls, the torch
router and ~20 small ops per layer; with every layer of a Qwen3-MoE sparse the whole step was
eager Python around the MoE op.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

import torch

from .cpu_decode_kernels import ROWS, NativeLinear
from .cpu_moe import ACTIVATIONS, MAX_TOP_K, NativeMoeLayer, PreparedMoe
from .layer_spec import DecoderLayerSpec, MoeSpec

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SCORING = {"softmax": 0, "sigmoid": 1}


class NativeMoeFfn(ctypes.Structure):
    """platforms/csrc/cpu_decode_step.cpp FusedMoeFfn."""
    _fields_ = ([("experts", NativeMoeLayer), ("router", _P), ("router_bias", _P), ("correction_bias", _P)]
                + [(name, _I) for name in ("router_bf16", "top_k", "scoring", "renormalize", "num_groups",
                                           "topk_groups", "round_weights")]
                + [("routed_scaling", _F), ("shared_gate_up", NativeLinear), ("shared_down", NativeLinear),
                   ("shared_gate", _P), ("noted_ids", _P), ("noted_rows", _I)])


def _dense_weight(linear: Any) -> Optional[torch.Tensor]:
    """A router / gate Linear's weight where it is a plain float32 or bf16 table, else None."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.untyped_storage().nbytes() < weight.numel() * weight.element_size():
        return None         # a placeholder carrying the shape only
    return weight


def moe_refusals(layer: DecoderLayerSpec) -> list[str]:
    """What of `layer`'s expert FFN the native step does not run (empty when it runs it)."""
    spec = getattr(layer, "moe", None)
    if spec is None:
        return ["ffn moe"]          # a layer declaring an expert FFN without handing it over
    out = []
    if spec.scoring not in SCORING:
        out.append(f"router scoring {spec.scoring}")
    if not isinstance(spec.prepared, PreparedMoe):
        out.append("experts not packed by the native MoE op (float32 experts keep the torch op)")
    if spec.activation not in ACTIVATIONS:
        out.append(f"expert activation {spec.activation}")
    if spec.top_k > MAX_TOP_K:
        out.append(f"top_k {spec.top_k} above {MAX_TOP_K}")
    router = _dense_weight(spec.router)
    if router is None or router.shape[1] % 16:
        out.append("a router that is no float32 / bf16 table")
    if spec.num_groups and spec.num_groups > 1 and (spec.w13.shape[0] % spec.num_groups or not spec.topk_groups):
        out.append(f"{spec.w13.shape[0]} experts in {spec.num_groups} groups")
    if spec.shared_gate is not None and (_dense_weight(spec.shared_gate) is None
                                        or getattr(spec.shared_gate, "bias", None) is not None):
        out.append("a shared expert gate that is no float32 / bf16 row without bias")
    if (spec.shared_gate_up is None) != (spec.shared_down is None):
        out.append("a shared expert that is not gate_up / down")
    return out


def moe_linears(spec: Optional[MoeSpec]) -> dict[str, Any]:
    """The layer's linears the step's matmuls read beside the experts (the shared expert's), by name."""
    if spec is None or spec.shared_gate_up is None:
        return {}
    return {"shared_gate_up": spec.shared_gate_up, "shared_down": spec.shared_down}


def pack_moe(spec: MoeSpec, linear: Callable[[Any, str], NativeLinear], keep: list) -> NativeMoeFfn:
    """The FusedMoeFfn of one layer. `linear(layer, name)` packs a Linear as the step packs the
    dense ones; `keep` holds every tensor (and structure) the result points into."""
    def f32(t: torch.Tensor) -> int:
        t = t.detach().float().contiguous()
        keep.append(t)
        return t.data_ptr()

    prepared: PreparedMoe = spec.prepared
    num, inter2, hidden = spec.w13.shape
    router = _dense_weight(spec.router)
    assert router is not None
    router = router.detach().contiguous()
    keep.append(router)
    bf16 = router.dtype == torch.bfloat16
    experts = NativeMoeLayer(num_experts=num, hidden=hidden, inter=inter2 // 2,
                             activation=ACTIVATIONS[spec.activation], w13=prepared.w13, w2=prepared.w2,
                             b13=f32(spec.w13_bias) if spec.w13_bias is not None else None,
                             b2=f32(spec.w2_bias) if spec.w2_bias is not None else None,
                             alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
    keep.append(prepared)
    bias = getattr(spec.router, "bias", None)
    out = NativeMoeFfn(
        experts=experts, router=router.data_ptr(), router_bias=f32(bias) if bias is not None else None,
        correction_bias=f32(spec.correction_bias) if spec.correction_bias is not None else None,
        router_bf16=int(bf16), top_k=spec.top_k, scoring=SCORING[spec.scoring], renormalize=int(spec.renormalize),
        num_groups=int(spec.num_groups or 0), topk_groups=int(spec.topk_groups or 0),
        # The model multiplies the routing weights in its activations' dtype (the router's).
        round_weights=int(spec.weights_in_hidden_dtype and bf16), routed_scaling=float(spec.routed_scaling_factor))
    for name, layer in moe_linears(spec).items():
        setattr(out, name, linear(layer, name))
    if spec.shared_gate is not None:
        gate = _dense_weight(spec.shared_gate)
        assert gate is not None
        gate = gate.detach().to(router.dtype).contiguous()
        keep.append(gate)
        out.shared_gate = gate.data_ptr()
    keep.append(out)
    return out


class RoutingNotes:
    """The per-expert token counts (core/layers/expert_tokens.py) of the layers whose expert FFN runs
    inside the step: before each step every counted layer's FusedMoeFfn points at its row of the
    counter's buffer, the step copies its routing there, and the layer is marked as noted after."""

    def __init__(self) -> None:
        self._layers: list[tuple[NativeMoeFfn, Any]] = []    # (structure, the FusedMoE it runs)

    def add(self, ffn: NativeMoeFfn, spec: MoeSpec) -> None:
        if spec.counted is not None:
            self._layers.append((ffn, spec.counted))

    def point(self, tokens: int) -> list[tuple[Any, int]]:
        """Point each structure at its counter's rows (or at none where the step has more tokens than
        the buffer holds); the (counter, slot) pairs the step will have noted."""
        noted = []
        for ffn, moe in self._layers:
            counter = getattr(moe, "token_counter", None)
            rows = counter.rows(moe.counter_slot) if counter is not None else None
            if rows is None or rows.shape[0] < tokens:
                ffn.noted_ids, ffn.noted_rows = None, 0
                continue
            ffn.noted_ids, ffn.noted_rows = rows.data_ptr(), rows.shape[0]
            noted.append((counter, moe.counter_slot))
        return noted


def shared_shapes_fit(spec: Optional[MoeSpec], shape: Callable[[Any], tuple[int, int]]) -> list[str]:
    """The shared expert's linears outside the step's blocks of 16 rows x 32 inputs."""
    return [f"{name} {n}x{k} outside blocks of 16 x 32" for name, layer in moe_linears(spec).items()
            for n, k in [shape(layer)] if n % ROWS or k % 32]


def route(ffn: NativeMoeFfn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's router alone on x [tokens, hidden]: (weights [tokens, top_k] float32, expert ids
    int64), select_experts' outputs (tests compare the two)."""
    from .cpu_decode_kernels import LIBRARY
    lib = LIBRARY.require()
    lib.fused_moe_route.restype = None
    lib.fused_moe_route.argtypes = [ctypes.POINTER(NativeMoeFfn), _P, _I, _P, _P]
    x = x.float().contiguous()
    ids = torch.empty((x.shape[0], ffn.top_k), dtype=torch.int64)
    weights = torch.empty((x.shape[0], ffn.top_k), dtype=torch.float32)
    lib.fused_moe_route(ctypes.byref(ffn), x.data_ptr(), x.shape[0], ids.data_ptr(), weights.data_ptr())
    return weights, ids
