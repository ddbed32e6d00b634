"""The built-in reasoning parsers: reasoning between `<think>` and `</think>` (Qwen3, DeepSeek-R1, GLM-4.5),
Granite's thought-process markers, Cohere's `<|START_THINKING|>` block; then the answer."""
from __future__ import annotations

import re

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


class Glm45ReasoningParser(_ThinkParser):
    """GLM-4.5 / 4.6: `<think>...</think>answer`, as Qwen3 (with thinking off, the template closes an
    empty `<think></think>` in the prompt, and the output is all answer)."""


def _hold_partial(text: str, tags: tuple[str, ...]) -> str:
    """`text` less an end that may still become one of `tags`."""
    return text[:len(text) - max(partial_tag_len(text, t) for t in tags)]


def _may_become(stripped: str, tags: tuple[str, ...]) -> bool:
    return not stripped or any(t.startswith(stripped) for t in tags)


class GraniteReasoningParser(IncrementalReasoningParser):
    """Granite 3.2 with `thinking`: "Here is my thought process: ... Here is my response: ..." ("Here's"
    too); Granite 3.3: `<think>...</think>` then the answer, optionally inside `<response>...</response>`
    (the tags are dropped). Output that starts otherwise is all answer; output that ends while
    thinking is all reasoning."""
    think_starts = ("Here is my thought process:", "Here's my thought process:")
    response_starts = ("Here is my response:", "Here's my response:")

    def view(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        opener = next((s for s in self.think_starts + (START,) if stripped.startswith(s)), None)
        if opener is None:
            if not final and _may_become(stripped, self.think_starts + (START,)):
                return "", ""
            return "", text
        closers = (END,) if opener == START else self.response_starts
        body = lead + len(opener)
        ends = [(at, c) for c in closers if (at := text.find(c, body)) >= 0]
        if not ends:
            reasoning = text[body:] if final else _hold_partial(text[body:], closers)
            return reasoning.strip(), ""
        at, closer = min(ends)
        answer = text[at + len(closer):].lstrip()
        if opener == START:
            answer = self._unwrap(answer, final)
        return text[body:at].strip(), answer

    @staticmethod
    def _unwrap(answer: str, final: bool) -> str:
        """The answer without its `<response>` tags."""
        if not answer.startswith("<response>"):
            return "" if not final and "<response>".startswith(answer) else answer
        body = answer[len("<response>"):]
        close = body.find("</response>")
        if close >= 0:
            return body[:close]
        return body if final else _hold_partial(body, ("</response>",))

    def reasoning_ended(self, prompt_text: str, output_text: str) -> bool:
        # Granite's template never opens the thought process in the prompt: a constraint applies
        # from the first token, or after the response marker of an output that opened it.
        stripped = output_text.lstrip()
        opener = next((s for s in self.think_starts + (START,) if stripped.startswith(s)), None)
        if opener is None:
            return True
        closers = (END,) if opener == START else self.response_starts
        return any(c in stripped[len(opener):] for c in closers)


COHERE_THINK_START, COHERE_THINK_END = "<|START_THINKING|>", "<|END_THINKING|>"
COHERE_ANSWER_TAGS = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>")
_COHERE_ANSWER_TAG = re.compile("|".join(re.escape(t) for t in COHERE_ANSWER_TAGS))


class CohereCommand3ReasoningParser(IncrementalReasoningParser):
    """Cohere's Command 3 format (Command R7B, Command A): `<|START_THINKING|>plan<|END_THINKING|>`
    is the reasoning; the answer loses its `<|START_RESPONSE|>` / `<|END_RESPONSE|>` (or `_TEXT|>`)
    markers, and an action block (`<|START_ACTION|>...`) is left for the `cohere_command3` tool
    parser. The markers are special tokens: the parser sees them with `skip_special_tokens: false`."""

    def view(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if not stripped.startswith(COHERE_THINK_START):
            if not final and _may_become(stripped, (COHERE_THINK_START,)):
                return "", ""
            return "", self._answer(text, final)
        body = len(text) - len(stripped) + len(COHERE_THINK_START)
        end = text.find(COHERE_THINK_END, body)
        if end < 0:
            reasoning = text[body:] if final else _hold_partial(text[body:], (COHERE_THINK_END,))
            return reasoning.strip(), ""
        return text[body:end].strip(), self._answer(text[end + len(COHERE_THINK_END):], final)

    @staticmethod
    def _answer(text: str, final: bool) -> str:
        text = text if final else _hold_partial(text, COHERE_ANSWER_TAGS)
        return _COHERE_ANSWER_TAG.sub("", text).lstrip()

    def reasoning_ended(self, prompt_text: str, output_text: str) -> bool:
        text = prompt_text + output_text
        opened = text.rfind(COHERE_THINK_START)
        return opened < 0 or text.find(COHERE_THINK_END, opened) >= 0
