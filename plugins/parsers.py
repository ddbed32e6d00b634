"""The interfaces of tool-call parsers, reasoning parsers and grammar backends.

Minimal on purpose (issue 11 fleshes them out): what a plugin subclasses so the registry can
check its type and API version, and the one method the OpenAI server will call on each.
A parser is constructed with the tokenizer of the model being served.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from .kinds import GRAMMAR_BACKEND_API_VERSION, REASONING_PARSER_API_VERSION, TOOL_PARSER_API_VERSION


@dataclass
class ToolCall:
    name: str
    arguments: str            # a JSON object, as text (what the OpenAI API returns)


@dataclass
class ExtractedToolCalls:
    content: Optional[str]    # the text that is not a tool call (None when there is none)
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    """Finds the tool calls in a model's finished output (`--tool-call-parser NAME`)."""
    api_version: ClassVar[int] = TOOL_PARSER_API_VERSION

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        raise NotImplementedError


class ReasoningParser:
    """Splits a model's finished output into reasoning and answer (`--reasoning-parser NAME`)."""
    api_version: ClassVar[int] = REASONING_PARSER_API_VERSION

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_reasoning(self, model_output: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content); either may be None."""
        raise NotImplementedError


class GrammarBackend:
    """Compiles a structured-output request (a JSON schema, a regex, ...) into a token mask source."""
    api_version: ClassVar[int] = GRAMMAR_BACKEND_API_VERSION
    supported_kinds: ClassVar[tuple[str, ...]] = ()     # e.g. ("json_schema", "regex")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def compile(self, kind: str, spec: str) -> Any:
        """An object the sampler asks for the allowed next tokens (its API comes with issue 11)."""
        raise NotImplementedError
