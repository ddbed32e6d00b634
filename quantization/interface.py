"""What a quantization method is, and the registry that finds one by name.

A leaf module: it imports nothing else of tokenmill's, so plugins can register methods
without pulling in the engine.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch


class QuantizationMethod:
    """Turns a checkpoint's stored tensor into a runtime weight.

    Methods that keep weights quantized at run time would also supply a matmul; the
    methods we ship so far dequantize at load, so `dequantize` is the whole contract.
    """
    name: ClassVar[str] = ""

    def supported_types(self) -> list[str]:
        """Names of the storage formats this method can read."""
        raise NotImplementedError

    def dequantize(self, data: Any, qtype: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """Stored `data` of format `qtype` -> a float32 tensor of `shape` (torch order)."""
        raise NotImplementedError


_METHODS: dict[str, type[QuantizationMethod]] = {}


def register_quantization_method(name: str, cls: type[QuantizationMethod]) -> None:
    """Make `cls` available under `name`. Re-registering the same class is a no-op."""
    existing = _METHODS.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"quantization method {name!r} is already registered as {existing.__qualname__}")
    _METHODS[name] = cls


def get_quantization_method(name: str) -> QuantizationMethod:
    """A fresh instance of the method registered as `name`; ValueError listing the known ones."""
    if name not in _METHODS:
        _import_builtins()
    if name not in _METHODS:
        raise ValueError(f"unknown quantization method {name!r}; registered: {sorted(_METHODS)}")
    return _METHODS[name]()


def registered_quantization_methods() -> list[str]:
    _import_builtins()
    return sorted(_METHODS)


def _import_builtins() -> None:
    # The builtin methods register themselves on import; importing lazily keeps this
    # module free of their (heavier) dependencies.
    from . import gguf  # noqa: F401
