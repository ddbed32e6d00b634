"""tokenmill: an LLM inference and serving engine with platform plugins."""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "LoRARequest", "__version__"]

if TYPE_CHECKING:
    from .core.config import EngineConfig
    from .core.lora.request import LoRARequest
    from .core.sampling_params import SamplingParams, StructuredOutputsParams
    from .entrypoints.llm import LLM


def __getattr__(name: str):
    # Lazy, so `import tokenmill` stays cheap for CLI tools that never build an engine.
    if name == "LLM":
        from .entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from .core.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from .core.sampling_params import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "LoRARequest":
        from .core.lora.request import LoRARequest
        return LoRARequest
    if name == "EngineConfig":
        from .core.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
