"""Activations: gated ones over a fused [gate | up] projection, and the plain ones of MLPs
without a gate (StarCoder2's GELU-tanh, Apertus' xIELU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .params import plain_parameter

# HF `hidden_act` / `hidden_activation` names -> our activation kinds.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu": "relu", "xielu": "xielu",
               "relu2": "relu2"}


def activation_kind(name: str) -> str:
    """Our kind for an HF activation name; ValueError naming it where there is none."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


def _elementwise(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "gelu":
        return F.gelu(x)
    if kind == "relu":
        return F.relu(x)
    if kind == "relu2":        # squared ReLU (Nemotron-H)
        return F.relu(x).square()
    raise ValueError(f"activation kind {kind!r} has no elementwise form")


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def __init__(self) -> None:
        super().__init__()
        self._kernel = None

    def use_kernel(self, kernel) -> None:
        """Run through `kernel(x)` (a platform's fused op); it may return NotImplemented. None: torch."""
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            out = self._kernel(x)
            if out is not NotImplemented:
                return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GatedActivation(nn.Module):
    """x = [gate | up] -> act(gate) * up for another activation (Gemma's GeGLU: gelu_tanh)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self._kernel = None

    def use_kernel(self, kernel) -> None:
        """A platform's fused GELU-tanh-and-multiply `kernel(x)` (it may return NotImplemented),
        used where this activation is GELU-tanh. None: torch."""
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and self.kind == "gelu_tanh":
            out = self._kernel(x)
            if out is not NotImplemented:
                return out
        gate, up = x.chunk(2, dim=-1)
        return _elementwise(self.kind, gate) * up


class Activation(nn.Module):
    """act(x) for an MLP without a gate."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _elementwise(self.kind, x)


class XIELU(nn.Module):
    """xIELU (Apertus): learned alpha_p / alpha_n (checkpoint parameters, softplus-reparametrized);
    beta 0.5 and eps -1e-6 are the constants transformers fixes."""

    def __init__(self, dtype: torch.dtype, beta: float = 0.5, eps: float = -1e-6) -> None:
        super().__init__()
        self.alpha_p = plain_parameter(1, dtype=dtype)
        self.alpha_n = plain_parameter(1, dtype=dtype)
        self.beta, self.eps = beta, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        eps = torch.tensor(self.eps, dtype=x.dtype)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + self.beta * x)


def activation_constants(act: nn.Module) -> tuple[float, ...]:
    """What a decode program needs besides the activation's kind: xIELU's (alpha_p, alpha_n, beta,
    eps) as its forward applies them; () for the parameter-free ones."""
    if not isinstance(act, XIELU):
        return ()
    with torch.no_grad():
        alpha_p = float(F.softplus(act.alpha_p.float()))
        alpha_n = act.beta + float(F.softplus(act.alpha_n.float()))
    return (alpha_p, alpha_n, act.beta, act.eps)
