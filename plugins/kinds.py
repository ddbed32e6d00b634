"""The extension points: one named entry-point group each, one API version each.

The expected API version of a kind is the constant of the interface module that defines it
(platforms, attention backends, quantization methods: the leaves); model architectures live in
the core, above this layer, and parsers and grammar backends have no module of their own yet, so
their versions are defined here. An extension states the version it was built for as an
`api_version` class attribute; one that states another version is refused. Model classes are the
one exception: a model that omits `api_version` is taken as version 1 (tokenmill's own models
predate the attribute and third-party ones usually subclass them).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Optional

MODEL_API_VERSION = 1
TOOL_PARSER_API_VERSION = 1
REASONING_PARSER_API_VERSION = 1
GRAMMAR_BACKEND_API_VERSION = 1


@dataclass(frozen=True)
class Kind:
    """One extension point."""
    name: str                     # "platform", as `tokenmill plugins` shows it
    group: str                    # its entry-point group
    base: str                     # "module:Class" every extension must subclass
    version: str                  # "module:CONSTANT" holding the expected API version
    default_api_version: Optional[int] = None   # taken when the class states none (models only)

    def expected_api_version(self) -> int:
        module, _, attr = self.version.partition(":")
        # 1 while an interface module predates its constant (quantization/interface.py).
        return int(getattr(importlib.import_module(module), attr, 1))

    def check(self, obj: Any) -> tuple[Optional[int], Optional[str]]:
        """(the api_version obj states, why it is refused or None)."""
        base = _load(self.base)
        if not (inspect.isclass(obj) and issubclass(obj, base)):
            return None, f"not a {base.__module__}.{base.__qualname__} subclass (got {obj!r})"
        stated = getattr(obj, "api_version", self.default_api_version)
        if stated is None:
            return None, f"states no api_version (this tokenmill speaks {self.name} API version " \
                         f"{self.expected_api_version()})"
        expected = self.expected_api_version()
        if stated != expected:
            return stated, (f"built for {self.name} API version {stated}; this tokenmill speaks "
                            f"version {expected}")
        return stated, None


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("platform", "tokenmill.platforms", "tokenmill.platforms.interface:Platform",
         "tokenmill.platforms.interface:PLATFORM_API_VERSION"),
    Kind("attention_backend", "tokenmill.attention_backends",
         "tokenmill.attention_backends.interface:AttentionBackend",
         "tokenmill.attention_backends.interface:ATTENTION_API_VERSION"),
    Kind("quantization_method", "tokenmill.quantization_methods",
         "tokenmill.quantization.interface:QuantizationMethod",
         "tokenmill.quantization.interface:QUANTIZATION_API_VERSION"),
    Kind("model_architecture", "tokenmill.model_architectures", "torch.nn:Module",
         "tokenmill.plugins.kinds:MODEL_API_VERSION", default_api_version=MODEL_API_VERSION),
    Kind("tool_parser", "tokenmill.tool_parsers", "tokenmill.plugins.parsers:ToolParser",
         "tokenmill.plugins.kinds:TOOL_PARSER_API_VERSION"),
    Kind("reasoning_parser", "tokenmill.reasoning_parsers", "tokenmill.plugins.parsers:ReasoningParser",
         "tokenmill.plugins.kinds:REASONING_PARSER_API_VERSION"),
    Kind("grammar_backend", "tokenmill.grammar_backends", "tokenmill.plugins.parsers:GrammarBackend",
         "tokenmill.plugins.kinds:GRAMMAR_BACKEND_API_VERSION"),
)}

# pluggy hook implementations (lifecycle subscribers, config validators): plugins/hooks.py.
HOOK_GROUP = "tokenmill.hooks"
# The group every general plugin used before each extension point had its own; read only to
# tell the authors of what is still registered there where it belongs now.
RETIRED_GROUP = "tokenmill.plugins"

