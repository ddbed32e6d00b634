"""The mixture-of-experts layer (`FusedMoE`): a router picks `top_k` of `num_experts` gated MLPs per
token, their outputs weighted and summed, plus optional shared experts every token runs.

The router (`select_experts`): logits from a replicated gate Linear, softmax or sigmoid scores, the
top-k of them, optionally renormalized to sum to 1 (norm_topk_prob); or the top-k logits first, then
their softmax (GPT-OSS, Granite MoE) or sigmoid (Cohere 2 MoE); PhiMoE's sparsemixer; DeepSeek V3's grouped top-k
(experts in `num_groups` groups, only the best `topk_groups` groups eligible, groups ranked with a
per-expert correction bias that changes which experts win but not their weights) and its
routed_scaling_factor.

The experts are stacked parameters: `w13` [E, 2 * I, H] (each expert's gate rows, then its up rows)
and `w2` [E, H, I], filled one checkpoint tensor at a time (experts.{e}.gate_proj / up_proj /
down_proj, Mixtral's w1 / w3 / w2, or transformers' fused experts.gate_up_proj / down_proj whole).
Tensor parallelism splits every expert's intermediate dimension over the ranks (w13 by rows of gate
and of up, w2 by columns) and all-reduces the routed sum, as a row-parallel Linear does; with expert
parallelism (core/layers/moe_parallel.py) each rank holds whole experts instead, E / tp of them
(`expert_start` .. `expert_end`), and the weight loader skips the others'.

The computation is the op `moe(hidden, w13, w2, topk_weights, topk_ids, activation)`: a platform may
supply it (LayerKernels.moe, may return NotImplemented); `moe_reference` is the torch one. GPT-OSS's
experts add keyword arguments (given only where a layer has them): per-expert biases `w13_bias`
[E, 2 * I] and `w2_bias` [E, H], and the activation "swiglu_oai" with `swiglu_alpha` / `swiglu_limit`
(gate clamped above at limit, up to +-limit, (up + 1) * gate * sigmoid(alpha * gate)); a kernel that
does not do them returns NotImplemented.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.platforms.interface import graph_capturing
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from ..distributed import all_reduce, get_state, tp_rank, tp_size
from .linear import Linear
from .moe_parallel import local_experts, parallel_experts
from .params import plain_parameter

# Activations of a gated expert: act(gate) * up.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# Every expert activation the op takes: those, and GPT-OSS's clamped SwiGLU (its own form, _expert).
EXPERT_ACTIVATIONS = (*sorted(_ACTIVATIONS), "swiglu_oai")


def _check_activation(activation: str) -> None:
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"expert activation {activation!r} (supported: {', '.join(EXPERT_ACTIVATIONS)})")


def select_experts(logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
                   num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
                   correction_bias: Optional[torch.Tensor] = None,
                   routed_scaling_factor: float = 1.0, jitter_eps: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64), each
    token's experts in descending order of their (bias-corrected) scores. `scoring` "topk_softmax"
    (GPT-OSS, Granite MoE) / "topk_sigmoid" (Cohere 2 MoE): the top-k logits, softmax over those k
    alone / their sigmoids (renormalized if asked); "sparsemixer" (PhiMoE, top-2; `jitter_eps`)."""
    if scoring in ("topk_softmax", "topk_sigmoid", "sparsemixer"):
        if num_groups not in (None, 1) or correction_bias is not None:
            raise ValueError(f"router scoring {scoring!r} takes no expert groups or correction bias")
        if scoring == "sparsemixer":
            weights, ids = _sparsemixer(logits, top_k, jitter_eps)
        else:
            weights, ids = torch.topk(logits, top_k, dim=-1)
            weights = torch.softmax(weights.float(), dim=-1) if scoring == "topk_softmax" else weights.float().sigmoid()
            if renormalize and scoring == "topk_sigmoid":
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * routed_scaling_factor if routed_scaling_factor != 1.0 else weights, ids
    if scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"router scoring {scoring!r}: expected 'softmax', 'sigmoid', 'topk_softmax', 'topk_sigmoid' "
                         "or 'sparsemixer'")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups is not None and num_groups > 1:
        t, e = choice.shape
        if e % num_groups or not topk_groups:
            raise ValueError(f"grouped top-k: {e} experts in {num_groups} groups, {topk_groups} of them kept")
        grouped = choice.view(t, num_groups, e // num_groups)
        # A group's rank: its best expert's score, or (DeepSeek V3, with a bias) its best two's sum.
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if correction_bias is not None \
            else grouped.max(dim=-1).values
        kept = torch.zeros(t, num_groups, dtype=torch.bool, device=logits.device)
        kept.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    if correction_bias is None and choice is scores:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(choice, top_k, dim=-1).indices
        weights = scores.gather(1, ids)              # the bias picks experts; the weights are the scores
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def _sparsemixer(logits: torch.Tensor, top_k: int, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's router at inference (transformers' sparsemixer, not training): the best expert, then the
    best of the rest, each weighted by a softmax over the logits within a relative 2 * jitter_eps of
    it (the earlier picks masked out); in the logits' dtype, as transformers computes it."""
    if top_k != 2:
        raise ValueError(f"router scoring 'sparsemixer' picks 2 experts, not top_k={top_k}")
    weights, ids, remaining = [], [], logits
    for _ in range(top_k):
        best, pick = remaining.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * jitter_eps
        weights.append(torch.softmax(remaining.masked_fill(far, float("-inf")), dim=-1).gather(-1, pick))
        ids.append(pick)
        remaining = remaining.scatter(-1, pick, float("-inf"))
    return torch.cat(weights, dim=-1).float(), torch.cat(ids, dim=-1)


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str,
            b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
            alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    gate, up = F.linear(x, w13, b13).chunk(2, dim=-1)
    if activation == "swiglu_oai":          # transformers' GptOssExperts._apply_gate, op for op
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return F.linear((up + 1) * (gate * torch.sigmoid(gate * alpha)), w2, b2)
    return F.linear(_ACTIVATIONS[activation](gate) * up, w2, b2)


def moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", *, w13_bias: Optional[torch.Tensor] = None,
                  w2_bias: Optional[torch.Tensor] = None, swiglu_alpha: float = 1.702,
                  swiglu_limit: float = 7.0) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(x), in hidden's dtype: the (token, slot)
    pairs sorted by expert, each expert run once on all its tokens (experts no token picked are
    skipped), its weighted outputs added in expert order (transformers' order). A weight multiplies
    in its own dtype (float32 routing weights: in float32) before the sum in hidden's dtype.
    `w13_bias` [E, 2 * I] / `w2_bias` [E, H]: each expert's biases (GPT-OSS); `swiglu_alpha` and
    `swiglu_limit`: the "swiglu_oai" activation's constants."""
    _check_activation(activation)
    out = torch.zeros_like(hidden)
    t = topk_ids.shape[0]
    if t == 0:
        return out
    extra = (w13_bias, w2_bias, swiglu_alpha, swiglu_limit)
    if graph_capturing(hidden):
        return _dense(hidden, w13, w2, topk_weights, topk_ids, activation, *extra)
    flat = topk_ids.t().reshape(-1)                  # slot-major: entry i is token i % t, slot i // t
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens, slots = order % t, order // t
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        token, slot = tokens[start:start + n], slots[start:start + n]
        start += n
        routed = _expert(hidden[token], w13[e], w2[e], activation, *_biases(e, w13_bias, w2_bias),
                         swiglu_alpha, swiglu_limit) * topk_weights[token, slot, None]
        out.index_add_(0, token, routed.to(out.dtype))
    return out


def _biases(e: int, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor]
            ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    return (None if w13_bias is None else w13_bias[e]), (None if w2_bias is None else w2_bias[e])


def _dense(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, activation: str, w13_bias: Optional[torch.Tensor] = None,
           w2_bias: Optional[torch.Tensor] = None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The same sum without data-dependent shapes (inside a captured CUDA graph): every expert on
    every token, weighted 0 where the token did not pick it."""
    out = torch.zeros_like(hidden)
    for e in range(w13.shape[0]):
        weight = (topk_weights * (topk_ids == e)).sum(dim=-1, keepdim=True)
        expert = _expert(hidden, w13[e], w2[e], activation, *_biases(e, w13_bias, w2_bias), alpha, limit)
        out += (expert * weight).to(out.dtype)
    return out


# Checkpoint tensor names of one expert (".experts.{e}.{name}.weight") and of all experts fused.
_ONE_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.([A-Za-z0-9_]+)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)$")
HF_EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MIXTRAL_EXPERT_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}


def expert_checkpoint_target(name: str, expert_names: Mapping[str, str] = HF_EXPERT_NAMES
                             ) -> Optional[tuple[str, Any]]:
    """(parameter, shard id) for a checkpoint tensor of stacked experts, None for any other tensor:
    `...mlp.experts.3.up_proj.weight` -> (`...mlp.w13`, (3, "up")); transformers' fused
    `...mlp.experts.gate_up_proj` [E, 2 * I, H] -> (`...mlp.w13`, None), loaded whole."""
    one = _ONE_EXPERT.match(name)
    if one is not None and one.group(3) in expert_names:
        part = expert_names[one.group(3)]
        return f"{one.group(1)}.{'w2' if part == 'down' else 'w13'}", (int(one.group(2)), part)
    fused = _FUSED_EXPERTS.match(name)
    if fused is not None:
        return f"{fused.group(1)}.{'w13' if fused.group(2) == 'gate_up_proj' else 'w2'}", None
    return None


class FusedMoE(nn.Module):
    """Router, stacked experts and optional shared expert(s) of one layer: hidden [T, H] -> [T, H].

    `shared_expert`: a module every token runs (its own tensor parallelism), added to the routed
    sum, times sigmoid(`shared_expert_gate`(x)) where the layer has that gate (Qwen2-MoE), or times
    `shared_expert_scale` (Cohere 2 MoE's "average": 0.5, with routed_scaling_factor 0.5)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 dtype: Optional[torch.dtype], quant_method: Optional[QuantizationMethod] = None,
                 activation: str = "silu", scoring: str = "softmax", renormalize: bool = False,
                 num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
                 correction_bias: bool = False, routed_scaling_factor: float = 1.0,
                 weights_in_hidden_dtype: bool = False, shared_expert: Optional[nn.Module] = None,
                 shared_expert_gate: bool = False, router_bias: bool = False, expert_bias: bool = False,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, jitter_eps: float = 0.01,
                 shared_expert_scale: float = 1.0) -> None:
        """`weights_in_hidden_dtype`: the routing weights are rounded to the activations' dtype
        before they multiply (Qwen2/3-MoE, OLMoE); else they multiply in float32 (Mixtral).
        `router_bias` / `expert_bias`: the router's and each expert's biases (GPT-OSS: w13_bias
        [E, 2 * I] gate then up, w2_bias [E, H]); `swiglu_*`: the "swiglu_oai" activation's constants;
        `jitter_eps`: the "sparsemixer" router's."""
        super().__init__()
        # How the experts are kept (quantization/interface.py ExpertsMethod); the loader's post-processing calls it.
        self.quant_method = (quant_method or UnquantizedLinearMethod()).experts_method()
        if self.quant_method is None:
            assert quant_method is not None
            raise ValueError(f"quantization {quant_method.name!r} does not cover mixture-of-experts layers yet: "
                             "the experts are kept as dense stacked weights; run this model unquantized")
        _check_activation(activation)
        # Expert parallelism: this rank's whole experts; else every expert, its intermediate size split.
        self.expert_start, self.expert_end = local_experts(num_experts)
        self.expert_parallel = get_state().expert_parallel
        self.tp_rank, self.tp_size = (0, 1) if self.expert_parallel else (tp_rank(), tp_size())
        if intermediate_size % self.tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} does not divide by "
                             f"tensor_parallel_size={self.tp_size}")
        if top_k > num_experts:
            raise ValueError(f"top_k {top_k} exceeds the {num_experts} experts")
        self.num_experts, self.top_k, self.activation = num_experts, top_k, activation
        self.intermediate_size = intermediate_size // self.tp_size     # this rank's part of each expert
        self.scoring, self.renormalize = scoring, renormalize
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.routed_scaling_factor, self.jitter_eps = routed_scaling_factor, float(jitter_eps)
        self.shared_expert_scale = float(shared_expert_scale)
        self.weights_in_hidden_dtype = weights_in_hidden_dtype
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        self.gate = Linear(hidden_size, num_experts, bias=router_bias, dtype=dtype)   # the router, replicated
        if correction_bias:        # DeepSeek V3 stores it with the router: mlp.gate.e_score_correction_bias
            self.gate.e_score_correction_bias = plain_parameter(num_experts, dtype=torch.float32)
        i, local = self.intermediate_size, self.expert_end - self.expert_start
        self.w13 = nn.Parameter(torch.empty(local, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, i, dtype=dtype), requires_grad=False)
        for param, parts in ((self.w13, ("gate", "up")), (self.w2, ("down",))):
            param.weight_loader = self.weight_loader
            # What a complete checkpoint fills (core/loaders/weights.py checks): each expert's tensors.
            param.checkpoint_shards = [(e, part) for e in range(num_experts) for part in parts]
        self.quant_method.create_weights(self)        # (GGUF blocks kept: loaded as stored instead)
        self.w13_bias: Optional[nn.Parameter] = None
        self.w2_bias: Optional[nn.Parameter] = None
        if expert_bias:           # loaded whole (shard id None), this rank's part of w13_bias
            self.w13_bias = nn.Parameter(torch.empty(local, 2 * i, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(local, hidden_size, dtype=dtype), requires_grad=False)
            self.w13_bias.weight_loader = self.w2_bias.weight_loader = self.weight_loader
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden_size, 1, dtype=dtype) if shared_expert_gate else None
        self._kernel: Any = None        # a platform's moe op (core/layers/kernels.py)
        self._prepared: Any = None      # what its `prepare` made of the experts
        # Where the routed expert ids are noted for the per-expert token counts (core/layers/expert_tokens.py).
        self.token_counter: Any = None
        self.counter_slot = 0

    def use_kernel(self, kernel: Any) -> None:
        """Run the experts through `kernel(hidden, w13, w2, topk_weights, topk_ids, activation, **extra)`
        (a platform's op, moe_reference's signature; `extra` only for biased / swiglu_oai experts; it
        may return NotImplemented). None: moe_reference. A kernel with `prepare(w13, w2, forms)` packs
        the experts once here (forms: the experts method's quantized forms, None when dense) and is
        then called with `prepared=` that."""
        self._kernel = kernel
        prepare = getattr(kernel, "prepare", None)
        self._prepared = None if prepare is None else prepare(self.w13, self.w2, self.quant_method.forms(self))

    # ------------------------------------------------------------------ loading
    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Optional[tuple[int, str]] = None) -> None:
        """One expert's gate / up / down tensor into its slot (shard_id (expert, part)), or every
        expert's at once (shard_id None: a fused [E, 2 * I, H] gate_up or [E, H, I] down); at tensor
        parallelism this rank's rows of gate and up, columns of down (narrowed before reading); at
        expert parallelism this rank's experts only, whole (another rank's are not read)."""
        i, rank, full = self.intermediate_size, self.tp_rank, self.intermediate_size * self.tp_size
        first, local = self.expert_start, self.expert_end - self.expert_start
        if shard_id is None:
            if local != self.num_experts:        # [E, ...] of every expert: this rank's range of them
                loaded = self._narrow(loaded, 0, first, local, self.num_experts)
            if param is self.w2_bias:            # every rank holds it whole (rank 0 adds it, `experts`)
                loaded = loaded.materialize() if hasattr(loaded, "materialize") else loaded
            elif param is self.w13 or param is self.w13_bias:
                # This rank's rows of the gate half and of the up half.
                loaded = self._narrow(loaded, 1, 0, 2 * i, 2 * full) if self.tp_size == 1 else torch.cat(
                    [self._narrow(loaded, 1, half * full + rank * i, i, 2 * full) for half in (0, 1)], dim=1)
            else:
                loaded = self._narrow(loaded, 2, rank * i, i, full)
            target = param.data
        else:
            expert, part = shard_id
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"expert {expert} of a layer with {self.num_experts} experts")
            if not first <= expert < self.expert_end:
                return                           # another rank's expert (expert parallelism)
            expert -= first
            if part == "down":
                loaded, target = self._narrow(loaded, 1, rank * i, i, full), param.data[expert]
            else:
                offset = 0 if part == "gate" else i
                loaded, target = self._narrow(loaded, 0, rank * i, i, full), param.data[expert].narrow(0, offset, i)
        if tuple(target.shape) != tuple(loaded.shape):
            where = "" if shard_id is None else f" (expert {shard_id[0]} {shard_id[1]})"
            raise ValueError(f"shape mismatch{where}: checkpoint {tuple(loaded.shape)} vs model {tuple(target.shape)}")
        target.copy_(loaded)

    weight_loader.narrows_lazily = True      # type: ignore[attr-defined]  # reads only this rank's part

    @staticmethod
    def _narrow(loaded: Any, dim: int, start: int, length: int, full: int) -> torch.Tensor:
        """loaded[start:start + length] along `dim`, of a checkpoint tensor `full` long there (a
        lazy slice reads only that part)."""
        if loaded.dim() <= dim or loaded.shape[dim] != full:
            raise ValueError(f"checkpoint tensor {tuple(loaded.shape)}: expected {full} along dim {dim}")
        if start == 0 and length == full:
            return loaded.materialize() if hasattr(loaded, "materialize") else loaded
        return loaded.narrow(dim, start, length)

    # ------------------------------------------------------------------ forward
    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for each token."""
        bias = getattr(self.gate, "e_score_correction_bias", None)
        weights, ids = select_experts(self.gate(hidden), self.top_k, self.scoring, self.renormalize,
                                      self.num_groups, self.topk_groups, bias, self.routed_scaling_factor,
                                      self.jitter_eps)
        return (weights.to(hidden.dtype) if self.weights_in_hidden_dtype else weights), ids

    def experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial routed sum (not yet all-reduced)."""
        extra = self._extra_args()
        if self._kernel is not None:
            prepared = {"prepared": self._prepared} if hasattr(self._kernel, "prepare") else {}
            out = self._kernel(hidden, self.w13, self.w2, topk_weights, topk_ids, self.activation, **extra, **prepared)
            if out is not NotImplemented:
                return out
        if self.quant_method.resident or graph_capturing(hidden):
            w13, w2 = self.quant_method.weights(self)
            return moe_reference(hidden, w13, w2, topk_weights, topk_ids, self.activation, **extra)
        # Experts kept in another form (quantized): only those this call routes to, dequantized.
        used = torch.unique(topk_ids)
        w13, w2 = self.quant_method.weights(self, used)
        for name in ("w13_bias", "w2_bias"):
            if extra.get(name) is not None:
                extra[name] = extra[name][used]
        return moe_reference(hidden, w13, w2, topk_weights, torch.searchsorted(used, topk_ids), self.activation,
                             **extra)

    def _extra_args(self) -> dict[str, Any]:
        """The op's keyword arguments beyond the plain gated experts (none for those): the biases
        (the down bias on one rank only, so the all-reduce adds it once) and SwiGLU's constants."""
        extra: dict[str, Any] = {}
        if self.w13_bias is not None:
            extra.update(w13_bias=self.w13_bias, w2_bias=self.w2_bias if self.tp_rank == 0 else None)
        if self.activation == "swiglu_oai":
            extra.update(swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        return extra

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden)
        if self.token_counter is not None:
            self.token_counter.note(self.counter_slot, ids)
        if self.expert_parallel:
            out = parallel_experts(self, hidden, weights, ids)
        else:
            out = self.experts(hidden, weights, ids)
            if self.tp_size > 1:
                out = all_reduce(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + (shared * self.shared_expert_scale if self.shared_expert_scale != 1.0 else shared)
        return out
