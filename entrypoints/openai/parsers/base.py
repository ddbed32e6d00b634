"""Incremental parsing by re-reading: a parser says, for the text so far, what is already certain
(the content text, and per tool call its name and a prefix of its arguments JSON); the base class
sends what grew since the last call. As long as that view only ever grows (each part a prefix of
its later self), the streamed deltas add up exactly to the finished extraction, which is the same
view of the whole text. Held back meanwhile: a possible start of a tag at the end of the text, a
name or an argument not complete yet."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ....plugins.parsers import (DeltaMessage, ExtractedToolCalls, ReasoningParser, ToolCall, ToolCallDelta,
                                 ToolParser)


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class PartialCall:
    name: Optional[str]      # None: not known yet (nothing of the call can be sent)
    arguments: str           # the certain prefix of the arguments JSON text (all of it once done)
    done: bool = False


@dataclass
class ToolView:
    content: str                        # the certain content text so far
    calls: list[PartialCall]
    failed: bool = False                # finished text that is not valid tool-call syntax


class IncrementalToolParser(ToolParser):
    """Subclasses implement `view(text, final)`."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._sent_content = 0
        self._sent_args: list[int] = []

    def view(self, text: str, final: bool) -> ToolView:
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        v = self.view(model_output, final=True)
        if v.failed or any(c.name is None or not c.done for c in v.calls):
            return ExtractedToolCalls(model_output if model_output.strip() else None, [])
        content = v.content if v.content.strip() else None
        return ExtractedToolCalls(content, [ToolCall(c.name, c.arguments) for c in v.calls])  # type: ignore[arg-type]

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> Optional[DeltaMessage]:
        v = self.view(current_text, final=False)
        out = DeltaMessage()
        content = v.content if v.content.strip() else ""     # whitespace alone may yet be no content at all
        if len(content) > self._sent_content:
            out.content = content[self._sent_content:]
            self._sent_content = len(content)
        for i, call in enumerate(v.calls):
            if call.name is None:
                break
            if i == len(self._sent_args):
                self._sent_args.append(len(call.arguments))
                out.tool_calls.append(ToolCallDelta(i, name=call.name, arguments=call.arguments))
            elif len(call.arguments) > self._sent_args[i]:
                out.tool_calls.append(ToolCallDelta(i, arguments=call.arguments[self._sent_args[i]:]))
                self._sent_args[i] = len(call.arguments)
        return out if out.content is not None or out.tool_calls else None


class IncrementalReasoningParser(ReasoningParser):
    """Subclasses implement `view(text, final) -> (reasoning so far, content so far)`."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._sent = [0, 0]

    def view(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError

    def extract_reasoning(self, model_output: str) -> tuple[Optional[str], Optional[str]]:
        reasoning, content = self.view(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(self, previous_text: str, current_text: str,
                                    delta_text: str) -> Optional[DeltaMessage]:
        reasoning, content = self.view(current_text, final=False)
        out = DeltaMessage()
        if len(reasoning) > self._sent[0]:
            out.reasoning_content = reasoning[self._sent[0]:]
            self._sent[0] = len(reasoning)
        if len(content) > self._sent[1]:
            out.content = content[self._sent[1]:]
            self._sent[1] = len(content)
        return out if out.content is not None or out.reasoning_content is not None else None
