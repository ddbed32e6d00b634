"""The assistant message of one chat choice, as the client sees it, when a reasoning parser and/or
a tool-call parser read the model's text (`--reasoning-parser`, `--tool-call-parser` with
`--enable-auto-tool-choice`).

The reasoning parser sees the model's text; the tool parser sees the reasoning parser's content (or
the whole text). Streamed, `feed(text)` returns the OpenAI delta fields for each new piece and
`finish()` what the streamed deltas had not yet sent of the finished extraction; not streamed,
`message(text)` is the finished message. A parser that fails on some text falls back to plain
content (its finished extraction says so), and the streamed text is never taken back.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Optional

from ...plugins.parsers import DeltaMessage, ReasoningParser, ToolParser

logger = logging.getLogger("tokenmill.serve")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(call: Any) -> dict[str, Any]:
    return {"id": tool_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatChoiceOutput:
    def __init__(self, tool_parser: Optional[ToolParser], reasoning_parser: Optional[ReasoningParser],
                 parallel_tool_calls: bool = True) -> None:
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.parallel = parallel_tool_calls
        self.text = ""            # the model's text so far
        self.inner = ""           # what the tool parser reads: the content the reasoning parser passed on
        self.sent_reasoning = ""
        self.sent_content = ""
        self.sent_calls: list[list[str]] = []    # per call sent: [name, arguments so far]
        self.called = False       # a tool call was reported (finish_reason "tool_calls")

    # -------------------------------------------------------------------------------- streamed
    def feed(self, delta_text: str) -> dict[str, Any]:
        """The delta fields for the next piece of the model's text (empty: nothing to send yet)."""
        if not delta_text:
            return {}
        previous, self.text = self.text, self.text + delta_text
        out: dict[str, Any] = {}
        content_piece = delta_text
        if self.reasoning_parser is not None:
            d = self._safely(self.reasoning_parser.extract_reasoning_streaming, previous, self.text, delta_text)
            content_piece = ""
            if d is not None:
                if d.reasoning_content:
                    self.sent_reasoning += d.reasoning_content
                    out["reasoning_content"] = d.reasoning_content
                content_piece = d.content or ""
        if content_piece:
            self._content_piece(content_piece, out)
        return out

    def _content_piece(self, piece: str, out: dict[str, Any]) -> None:
        if self.tool_parser is None:
            self.sent_content += piece
            out["content"] = out.get("content", "") + piece
            return
        previous, self.inner = self.inner, self.inner + piece
        d = self._safely(self.tool_parser.extract_tool_calls_streaming, previous, self.inner, piece)
        if d is None:
            return
        if d.content:
            self.sent_content += d.content
            out["content"] = out.get("content", "") + d.content
        calls = []
        for tc in d.tool_calls:
            if tc.index > len(self.sent_calls) or (tc.index == len(self.sent_calls) and tc.name is None):
                continue          # a fragment of a call whose start was not seen: the parser's mistake
            if not self.parallel and tc.index > 0:
                continue
            if tc.index == len(self.sent_calls):
                self.sent_calls.append([tc.name or "", tc.arguments])
                self.called = True
                calls.append({"index": tc.index, "id": tc.id or tool_call_id(), "type": "function",
                              "function": {"name": tc.name, "arguments": tc.arguments}})
            elif tc.arguments:
                self.sent_calls[tc.index][1] += tc.arguments
                calls.append({"index": tc.index, "function": {"arguments": tc.arguments}})
        if calls:
            out["tool_calls"] = calls

    def finish(self) -> dict[str, Any]:
        """At the end of a stream: what the finished extraction has that the deltas did not send."""
        out: dict[str, Any] = {}
        reasoning, content = self._split(self.text)
        if reasoning and reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            out["reasoning_content"] = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        if self.tool_parser is None:
            rest = self._rest(content or "", self.sent_content)
            if rest:
                out["content"] = rest
            return out
        extracted = self._extract(content or "")
        if extracted is None:
            return out
        rest = self._rest(extracted.content or "", self.sent_content)
        if rest:
            out["content"] = rest
        calls = []
        for i, call in enumerate(extracted.tool_calls[:None if self.parallel else 1]):
            if i < len(self.sent_calls):
                name, args = self.sent_calls[i]
                if name == call.name and call.arguments.startswith(args) and len(call.arguments) > len(args):
                    calls.append({"index": i, "function": {"arguments": call.arguments[len(args):]}})
                    self.sent_calls[i][1] = call.arguments
            elif i == len(self.sent_calls):
                self.sent_calls.append([call.name, call.arguments])
                self.called = True
                calls.append({"index": i, **_tool_call(call)})
        if calls:
            out["tool_calls"] = calls
        return out

    @staticmethod
    def _rest(full: str, sent: str) -> str:
        return full[len(sent):] if full.startswith(sent) else ""

    # -------------------------------------------------------------------------------- finished
    def message(self, text: str) -> dict[str, Any]:
        """The finished assistant message for the whole `text`."""
        reasoning, content = self._split(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_parser is not None:
            msg["reasoning_content"] = reasoning
        if self.tool_parser is not None:
            extracted = self._extract(content or "")
            if extracted is not None and extracted.tool_calls:
                calls = extracted.tool_calls[:None if self.parallel else 1]
                msg["content"] = extracted.content
                msg["tool_calls"] = [_tool_call(c) for c in calls]
                self.called = True
        return msg

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """OpenAI's "tool_calls" for a choice that stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self.called else reason

    # -------------------------------------------------------------------------------- helpers
    def _split(self, text: str) -> tuple[Optional[str], Optional[str]]:
        if self.reasoning_parser is None:
            return None, text
        try:
            return self.reasoning_parser.extract_reasoning(text)
        except Exception:
            logger.exception("reasoning parser %s failed", type(self.reasoning_parser).__name__)
            return None, text

    def _extract(self, content: str) -> Any:
        try:
            return self.tool_parser.extract_tool_calls(content) if self.tool_parser is not None else None
        except Exception:
            logger.exception("tool parser %s failed", type(self.tool_parser).__name__)
            return None

    @staticmethod
    def _safely(method: Any, *args: Any) -> Optional[DeltaMessage]:
        try:
            return method(*args)
        except Exception:
            logger.exception("%s failed", getattr(method, "__qualname__", method))
            return None


def parser_class(kind: str, name: Optional[str]) -> Optional[type]:
    """The registered `kind` ("tool_parser" or "reasoning_parser") called `name` (None: none); an
    unknown name is a ValueError that lists the known ones (and why any were refused)."""
    if name is None:
        return None
    from ...plugins import discovery, registry
    found = discovery.tool_parsers() if kind == "tool_parser" else discovery.reasoning_parsers()
    if name in found:
        return found[name]
    flag = "--tool-call-parser" if kind == "tool_parser" else "--reasoning-parser"
    refused = registry.refused(kind)
    why = f" ({name!r} was refused: {refused[name]})" if name in refused else ""
    raise ValueError(f"{flag} {name!r} is not a registered {kind.replace('_', ' ')}{why}; known: "
                     f"{', '.join(sorted(found)) or '(none)'}")
