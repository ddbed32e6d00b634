"""The built-in reasoning parsers: reasoning between `<think>` and `</think>`, then the answer."""
from __future__ import annotations

from .base import IncrementalReasoningParser, partial_tag_len

START, END = "<think>", "</think>"


class _ThinkParser(IncrementalReasoningParser):
    starts_in_reasoning = False      # the chat template already opened <think> in the prompt

    def view(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if stripped.startswith(START):
            body = len(text) - len(stripped) + len(START)
        elif not final and len(stripped) < len(START) and START.startswith(stripped):
            return "", ""                          # may still become <think>
        elif self.starts_in_reasoning:
            body = 0
        else:
            return "", text
        end = text.find(END, body)
        if end < 0:        # still thinking (or cut off while thinking: all of it is reasoning)
            reasoning = text[body:] if final else text[body:len(text) - partial_tag_len(text, END)]
            return reasoning.lstrip(), ""
        return text[body:end].lstrip(), text[end + len(END):].lstrip()

    def reasoning_ended(self, prompt_text: str, output_text: str) -> bool:
        # Reasoning is open when the prompt's template opened <think> (and did not close it), when
        # the output opened it, or (R1) always until </think>; a model that answers without
        # <think> is constrained from its first token.
        text = prompt_text + output_text
        opened = text.rfind(START)
        if opened >= 0:
            return text.find(END, opened) >= 0
        return not self.starts_in_reasoning or END in output_text


class Qwen3ReasoningParser(_ThinkParser):
    """Qwen3 (and QwQ-style) output: `<think>...</think>answer`; without the opening tag, all answer."""


class DeepSeekR1ReasoningParser(_ThinkParser):
    """DeepSeek-R1: its template opens `<think>` in the prompt, so the output may start inside the
    reasoning; everything before `</think>` is reasoning (all of it when there is no `</think>`)."""
    starts_in_reasoning = True
