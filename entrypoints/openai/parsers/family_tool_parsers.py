"""Tool-call parsers for the Granite, Phi-4-mini, GLM-4.5 and Cohere Command (R7B, A) formats, under
vLLM's names. Each reads the whole text so far into a `ToolView` (base.py), as tool_parsers.py's do."""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

from .base import IncrementalToolParser, PartialCall, ToolView, partial_tag_len
from .tool_parsers import _JsonObjectsParser, _json_arg


class GraniteToolParser(_JsonObjectsParser):
    """Granite 3.x: `<|tool_call|>` (3.0; the string `<tool_call>` in 3.1+) then a JSON list of
    `{"name": ..., "arguments": {...}}`. `<|tool_call|>` is a special token, dropped unless
    skip_special_tokens is false, so a list at the start of the output without it is read as tool
    calls too."""
    markers = ("<|tool_call|>", "<tool_call>")
    in_list = True


class Phi4MiniJsonToolParser(_JsonObjectsParser):
    """Phi-4-mini: `functools[{"name": ..., "arguments"|"parameters": {...}}, ...]`. `functools` is
    plain text, so a list without it is content, and so is the word where no list follows it."""
    markers = ("functools",)
    in_list = True
    bare_start = False


_COHERE_BARE_START = re.compile(r'\[\s*\{\s*"(?:tool_call_id|tool_name)"')
_COHERE_BARE_PREFIXES = ('[{"tool_call_id"', '[{"tool_name"')


class CohereCommand3ToolParser(_JsonObjectsParser):
    """Cohere's Command 3 format (Command R7B, Command A): `<|START_ACTION|>[{"tool_call_id": "0",
    "tool_name": ..., "parameters": {...}}, ...]<|END_ACTION|>`, the text before it content. The
    action markers are special tokens: when they were skipped, a list whose first object starts
    with "tool_call_id" or "tool_name" is the action block, wherever it starts."""
    markers = ("<|START_ACTION|>",)
    end_marker = "<|END_ACTION|>"
    in_list = True
    bare_start = False
    name_keys = ("tool_name",)

    def _start(self, text: str, final: bool) -> tuple[str, Optional[int]]:
        found = self._marker_start(text, final)
        m = _COHERE_BARE_START.search(text, 0, found[0] if found is not None else len(text))
        if m is not None:
            return text[:m.start()], m.start()
        if found is not None:
            return text[:found[0]], found[1]
        held = self._held(text, final)
        at = text.rfind("[")
        if not final and at >= 0 and _may_start_action_list(text[at:]):
            held = max(held, len(text) - at)
        return text[:len(text) - held], None


def _may_start_action_list(tail: str) -> bool:
    """Whether `tail` (from a '[') may still become the start of a Cohere action list."""
    compact = ""
    for ch in tail:
        if not ch.isspace():
            compact += ch
            if len(compact) > max(map(len, _COHERE_BARE_PREFIXES)):
                return False
    return any(p.startswith(compact) for p in _COHERE_BARE_PREFIXES)


# ------------------------------------------------------------------------------------------ GLM-4.5
_GLM_START, _GLM_END = "<tool_call>", "</tool_call>"
_KEY_OPEN, _KEY_CLOSE = "<arg_key>", "</arg_key>"
_VALUE_OPEN, _VALUE_CLOSE = "<arg_value>", "</arg_value>"


def glm_value(text: str) -> Any:
    """An `<arg_value>`: JSON when it reads as JSON, a Python literal for a container or
    True/False/None, else the string itself. (The chat template writes strings bare and everything
    else as JSON; without the tools' schemas, a string that reads as JSON -- "42" -- becomes JSON.)"""
    text = text.strip()
    candidates = [json.loads]
    if (text and text[0] in "[{(") or text in ("True", "False", "None"):
        candidates.append(ast.literal_eval)
    for read in candidates:
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return text


class Glm45ToolParser(IncrementalToolParser):
    """GLM-4.5 / 4.6 (and 4.7, whose name may run straight into the first `<arg_key>`):
    `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`, any number,
    with text around them. Arguments stream one key/value pair at a time."""

    def view(self, text: str, final: bool) -> ToolView:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while True:
            at = text.find(_GLM_START, pos)
            if at < 0:
                rest = text[pos:]
                rest = rest if final else rest[:len(rest) - partial_tag_len(rest, _GLM_START)]
                if not calls or rest.strip():     # whitespace alone between or after calls is no content
                    content.append(rest)
                return ToolView("".join(content), calls)
            if not calls or text[pos:at].strip():
                content.append(text[pos:at])
            call, end, failed = self._call(text, at + len(_GLM_START), final)
            if call is not None:
                calls.append(call)
            if failed or end is None:
                return ToolView("".join(content), calls, failed=failed)
            pos = end

    @staticmethod
    def _call(text: str, i: int, final: bool) -> tuple[Optional[PartialCall], Optional[int], bool]:
        """The call whose body starts at text[i]: (the call, or None while its name is not known;
        where it ends, or None when the text ends first; failed)."""
        while i < len(text) and text[i].isspace():
            i += 1
        stops = [k for k in (text.find("\n", i), text.find(_KEY_OPEN, i), text.find(_GLM_END, i)) if k >= 0]
        if not stops:     # the name so far: fails once it cannot be a name followed by a tag
            lt = text.find("<", i)
            tag_may_follow = lt < 0 or _KEY_OPEN.startswith(text[lt:]) or _GLM_END.startswith(text[lt:])
            return None, None, final or not tag_may_follow
        name = text[i:min(stops)].strip()
        if not name or any(c.isspace() or c in "<>" for c in name):
            return None, None, True
        call = PartialCall(name, "{")
        parts: list[str] = []
        j = min(stops)
        while True:
            while j < len(text) and text[j].isspace():
                j += 1
            rest = text[j:]
            if rest.startswith(_GLM_END):
                call.arguments = "{" + ", ".join(parts) + "}"
                call.done = True
                return call, j + len(_GLM_END), False
            if rest.startswith(_KEY_OPEN):
                key_end = text.find(_KEY_CLOSE, j)
                if key_end < 0:
                    return call, None, final
                key = text[j + len(_KEY_OPEN):key_end].strip()
                v = key_end + len(_KEY_CLOSE)
                while v < len(text) and text[v].isspace():
                    v += 1
                if not text.startswith(_VALUE_OPEN, v):
                    return call, None, final or not _VALUE_OPEN.startswith(text[v:])
                value_end = text.find(_VALUE_CLOSE, v)
                if value_end < 0:
                    return call, None, final
                parts.append(_json_arg(key, glm_value(text[v + len(_VALUE_OPEN):value_end])))
                call.arguments = "{" + ", ".join(parts)
                j = value_end + len(_VALUE_CLOSE)
                continue
            waiting = not final and (_GLM_END.startswith(rest) or _KEY_OPEN.startswith(rest))
            return call, None, not waiting
