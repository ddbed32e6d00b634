"""The interfaces of tool-call parsers, reasoning parsers and grammar backends.

What a plugin subclasses so the registry can check its type and API version, and the methods the
OpenAI server calls on each. A parser is constructed with the tokenizer of the model being served,
once per choice of a request (so a streaming parser may keep state on `self`).

Finished output: `ToolParser.extract_tool_calls(text)`, `ReasoningParser.extract_reasoning(text)`.
Streamed output: the `*_streaming(previous_text, current_text, delta_text)` methods, called once per
new piece of text, return a `DeltaMessage` (what to send now) or None (nothing yet: text may be held
back, e.g. a possible start of a tag). When the output is finished the server calls the finished
method on the whole text and sends what the streamed deltas had not yet sent (when they sent a
prefix of it), so a parser that implements only the finished methods streams too, in one piece at
the end; the built-in parsers (entrypoints/openai/parsers/) stream as the text arrives.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

from .kinds import GRAMMAR_BACKEND_API_VERSION, REASONING_PARSER_API_VERSION, TOOL_PARSER_API_VERSION


@dataclass
class ToolCall:
    name: str
    arguments: str            # a JSON object, as text (what the OpenAI API returns)


@dataclass
class ExtractedToolCalls:
    content: Optional[str]    # the text that is not a tool call (None when there is none)
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """One fragment of a streamed tool call: `name` (and `id`, when the parser has its own ids; the
    server makes one otherwise) in the call's first fragment, then pieces of `arguments` whose
    concatenation is the call's arguments JSON text."""
    index: int                          # which call of the output, from 0
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class DeltaMessage:
    """What a streaming parser says is new: text of the answer, of the reasoning, tool-call fragments."""
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser:
    """Finds the tool calls in a model's finished output (`--tool-call-parser NAME`)."""
    api_version: ClassVar[int] = TOOL_PARSER_API_VERSION

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> Optional[DeltaMessage]:
        """The new content and tool-call fragments now that `delta_text` was appended to
        `previous_text` (giving `current_text`). The default holds everything back until the end."""
        return None


class ReasoningParser:
    """Splits a model's finished output into reasoning and answer (`--reasoning-parser NAME`)."""
    api_version: ClassVar[int] = REASONING_PARSER_API_VERSION

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_reasoning(self, model_output: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content); either may be None."""
        raise NotImplementedError

    def extract_reasoning_streaming(self, previous_text: str, current_text: str,
                                    delta_text: str) -> Optional[DeltaMessage]:
        """The new `reasoning_content` and `content` now that `delta_text` was appended. The default
        holds everything back until the end."""
        return None

    def reasoning_ended(self, prompt_text: str, output_text: str) -> bool:
        """For structured outputs (the engine's `reasoning_parser`): True once the prompt and the
        output so far are past the reasoning part, so that a constraint applies from the next token
        on -- with an empty output, whether the answer starts at once. The default: no reasoning
        part is known, the constraint applies from the first token."""
        return True


class GrammarMatcher:
    """The state of one constrained sequence (one per sequence: n > 1 gets n of them).

    The token bitmask is tokenmill's and xgrammar's format: an int32 tensor [rows, ceil(vocab/32)]
    on the CPU; bit `t % 32` of word `t // 32` of a row set means token `t` may come next.
    """

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (every word of it)."""
        raise NotImplementedError

    def accept_token(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar does not allow it."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """True once the grammar is complete (its stop token accepted): the sequence finishes."""
        raise NotImplementedError

    # Speculative decoding verifies draft tokens against the grammar and must undo them: a matcher
    # that can sets `supports_rollback` and implements both methods (else its sequences get no drafts).
    supports_rollback: ClassVar[bool] = False

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        raise NotImplementedError

    def count_valid(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept from here (state unchanged)."""
        raise NotImplementedError


class CompiledGrammar:
    """A compiled constraint (what `GrammarBackend.compile` returns, cached by the backend)."""

    def new_matcher(self) -> GrammarMatcher:
        raise NotImplementedError


class GrammarBackend:
    """Compiles a structured-output request into matchers the sampler masks logits with.

    Constructed once per engine with the model's tokenizer, the model's vocabulary size (the
    logits' width, which may exceed the tokenizer's) and its stop (EOS) token ids. A backend
    implements `compile`: it gets a kind (one of `supported_kinds`: "json" schema text,
    "json_object", "regex", "choice" as a JSON list of strings, "grammar" EBNF or Lark,
    "structural_tag" as JSON text) and its spec; a bad spec raises
    tokenmill.core.errors.RequestError (param "structured_outputs"), never compiles to no constraint.

    The engine calls `compiled` -- `compile` behind an LRU cache keyed by (kind, spec), shared by
    every backend -- from a worker thread, so a slow compile never stalls the engine step; `cached`
    tells it without compiling whether a request can start at once.
    """
    api_version: ClassVar[int] = GRAMMAR_BACKEND_API_VERSION
    supported_kinds: ClassVar[tuple[str, ...]] = ()     # e.g. ("json", "regex")
    cache_size: ClassVar[int] = 256                     # compiled constraints kept (least recently used go)

    def __init__(self, tokenizer: Any, vocab_size: int = 0, stop_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        raise NotImplementedError

    def cached(self, kind: str, spec: str) -> Optional[CompiledGrammar]:
        """The compiled constraint if the cache has it (refreshing it), else None."""
        cache, lock = self._compile_cache()
        with lock:
            hit = cache.get((kind, spec))
            if hit is not None:
                cache.move_to_end((kind, spec))
            return hit

    def compiled(self, kind: str, spec: str) -> CompiledGrammar:
        """`compile`, cached: a repeated (kind, spec) is compiled once. Thread-safe."""
        hit = self.cached(kind, spec)
        if hit is not None:
            return hit
        result = self.compile(kind, spec)
        cache, lock = self._compile_cache()
        with lock:
            cache[(kind, spec)] = result
            while len(cache) > self.cache_size:
                cache.popitem(last=False)
        return result

    def _compile_cache(self) -> tuple["OrderedDict[tuple[str, str], CompiledGrammar]", threading.Lock]:
        # Made on first use so that a subclass's __init__ need not call ours.
        state = self.__dict__.get("_tokenmill_compile_cache")
        if state is None:
            state = self.__dict__.setdefault("_tokenmill_compile_cache", (OrderedDict(), threading.Lock()))
        return state
