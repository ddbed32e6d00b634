"""The built-in tool-call parsers. Each reads the whole text so far into a `ToolView` (base.py);
the finished and the streamed extraction are the same reading, so they agree."""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

from .base import IncrementalToolParser, PartialCall, ToolView, partial_tag_len
from .json_scan import CallScan, scan_call, skip_ws


def _call(scan: CallScan, text: str) -> PartialCall:
    return PartialCall(scan.name, scan.arguments(text), scan.end is not None)


def _valid(scan: CallScan, text: str, start: int) -> bool:
    """A complete call object that is JSON with a string name."""
    if scan.end is None or scan.invalid or scan.name is None:
        return False
    try:
        obj = json.loads(text[start:scan.end])
        json.loads(scan.arguments(text))
    except ValueError:
        return False
    return isinstance(obj, dict)


class HermesToolParser(IncrementalToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with text around them
    (Hermes 2/3, Qwen2.5/Qwen3)."""
    start_tag, end_tag = "<tool_call>", "</tool_call>"

    def view(self, text: str, final: bool) -> ToolView:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while True:
            at = text.find(self.start_tag, pos)
            if at < 0:
                rest = text[pos:]
                rest = rest if final else rest[:len(rest) - partial_tag_len(rest, self.start_tag)]
                if not calls or rest.strip():     # whitespace alone between or after calls is no content
                    content.append(rest)
                break
            if not calls or text[pos:at].strip():
                content.append(text[pos:at])
            i = skip_ws(text, at + len(self.start_tag))
            if i >= len(text):
                break
            if text[i] != "{":
                return ToolView("".join(content), calls, failed=True)
            scan = scan_call(text, i)
            if scan.invalid or (final and not _valid(scan, text, i)):
                return ToolView("".join(content), calls, failed=True)
            calls.append(_call(scan, text))
            if scan.end is None:
                break
            close = text.find(self.end_tag, scan.end)
            if close < 0:
                if final and text[scan.end:].strip():
                    return ToolView("".join(content), calls, failed=True)
                break
            pos = close + len(self.end_tag)
        return ToolView("".join(content), calls)


class _JsonObjectsParser(IncrementalToolParser):
    """Call objects after a marker (or at the very start, with `bare_start`), separated by `sep`,
    optionally in a list, optionally closed by `end_marker`. A marker that is not followed by the
    calls' opener is ordinary text."""
    markers: tuple[str, ...] = ()
    sep = ","
    in_list = False
    bare_start = True                  # calls at the very start of the output need no marker
    end_marker = ""                    # after the calls (optional: the output may end first)
    name_keys: tuple[str, ...] = ("name",)

    @property
    def opener(self) -> str:
        return "[" if self.in_list else "{"

    def _marker_start(self, text: str, final: bool) -> Optional[tuple[int, Optional[int]]]:
        """The first marker followed by the opener: (where the marker is, where the opener is, or
        None when the text ends after the marker)."""
        best: Optional[tuple[int, Optional[int]]] = None
        for marker in self.markers:
            pos = 0
            while (at := text.find(marker, pos)) >= 0:
                j = skip_ws(text, at + len(marker))
                if (j < len(text) and text[j] == self.opener) or (j >= len(text) and not final):
                    if best is None or at < best[0]:
                        best = (at, j if j < len(text) else None)
                    break
                pos = at + 1
        return best

    def _held(self, text: str, final: bool) -> int:
        """How much of the end of `text` may still become a marker."""
        return 0 if final else max((partial_tag_len(text, m) for m in self.markers), default=0)

    def _start(self, text: str, final: bool) -> tuple[str, Optional[int]]:
        """(content before the calls, where the calls start; None: no calls, or not known yet)."""
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        found = self._marker_start(text, final)
        if self.bare_start and stripped.startswith(self.opener) and (found is None or found[0] > lead):
            return "", lead           # the calls start the output (a marker comes later, if at all)
        if found is not None:
            return text[:found[0]], found[1]
        if not final and (not stripped or any(partial_tag_len(stripped, m) == len(stripped) for m in self.markers)):
            return "", None           # could still become the marker or the opener
        return text[:len(text) - self._held(text, final)], None

    def view(self, text: str, final: bool) -> ToolView:
        content, i = self._start(text, final)
        calls: list[PartialCall] = []
        if i is None:
            return ToolView(content, calls)
        i = skip_ws(text, i)
        if self.in_list:
            if i >= len(text):
                return ToolView(content, calls, failed=final)
            if text[i] != "[":
                return ToolView(content, calls, failed=True)
            i = skip_ws(text, i + 1)
        n = len(text)
        while i < n:
            if text[i] != "{":
                return ToolView(content, calls, failed=True)
            scan = scan_call(text, i, self.name_keys)
            if scan.invalid or (final and not _valid(scan, text, i)):
                return ToolView(content, calls, failed=True)
            calls.append(_call(scan, text))
            if scan.end is None:
                return ToolView(content, calls)
            i = skip_ws(text, scan.end)
            if i < n and text[i] == self.sep:
                i = skip_ws(text, i + 1)
                continue
            if self.in_list and i < n and text[i] == "]":
                i += 1
            break
        else:
            return ToolView(content, calls, failed=final)
        if self.end_marker:
            i = skip_ws(text, i)
            if text.startswith(self.end_marker, i):
                i += len(self.end_marker)
            elif not final and self.end_marker.startswith(text[i:]):
                i = n
        if text[i:].strip():          # text after the calls
            return ToolView(content, calls, failed=True)
        return ToolView(content, calls)


class Llama3JsonToolParser(_JsonObjectsParser):
    """Llama 3.1/3.2 JSON tool calls: `<|python_tag|>` (optional), then `{"name": ..., "parameters":
    {...}}` objects separated by `;`. Text that does not start with them is content."""
    markers = ("<|python_tag|>",)
    sep = ";"


class MistralToolParser(_JsonObjectsParser):
    """Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`. The marker is a
    special token, dropped unless skip_special_tokens is false, so a list at the start of the output
    without it is read as tool calls too."""
    markers = ("[TOOL_CALLS]",)
    in_list = True


# ------------------------------------------------------------------------------------------ pythonic
_IDENT = re.compile(r"[A-Za-z_][\w.]*")
_KWARG = re.compile(r"([A-Za-z_]\w*)\s*=\s*")
_PARTIAL_KWARG = re.compile(r"[A-Za-z_]\w*\s*")
_MAYBE_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")     # what a call list looks like before its '('
_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


def _py_value_end(text: str, i: int) -> Optional[int]:
    """Where the Python literal at text[i] ends (at a top-level ',' or ')'); None: not yet."""
    depth, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "\"'":
            triple = text.startswith(ch * 3, i)
            quote = ch * 3 if triple else ch
            j = i + len(quote)
            while True:
                if j >= n:
                    return None
                if text[j] == "\\":
                    j += 2
                    continue
                if text.startswith(quote, j):
                    break
                j += 1
            i = j + len(quote)
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return i if ch == ")" else None
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return None


def _json_arg(key: str, value: Any) -> str:
    return f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False, allow_nan=False)}"


class PythonicToolParser(IncrementalToolParser):
    """A Python list of calls with keyword arguments, `[get_weather(city="Paris"), now()]` (Llama 3.2
    and 4's pythonic format, ToolACE, Gemma 3 prompted for it): the whole output is the list, or it
    is all content. Gemma also fences its calls: "```tool_code" then the list or bare calls (one or
    more) then "```", with any text before the fence as content (a fence the output ends inside of,
    after complete calls, still counts)."""
    fence = "```tool_code"

    def view(self, text: str, final: bool) -> ToolView:
        stripped = text.lstrip()
        i = len(text) - len(stripped)
        if _START.match(stripped):
            calls, end, failed = self._calls(text, i + 1, final, bracket=True)
            if end is None or failed:
                return ToolView("", calls, failed=failed)
            return ToolView("", calls, failed=bool(text[end:].strip()))
        at = text.find(self.fence)
        if at >= 0:
            return self._fenced(text, at, final)
        m = _MAYBE_START.match(stripped)
        if not final and (not stripped or (m is not None and m.end() == len(stripped))):
            return ToolView("", [])
        return ToolView(text[:len(text) - (0 if final else partial_tag_len(text, self.fence))], [])

    def _fenced(self, text: str, at: int, final: bool) -> ToolView:
        content, n = text[:at], len(text)
        j = at + len(self.fence)
        line_end = text.find("\n", j)
        if line_end < 0 or text[j:line_end].strip():      # the fence line holds nothing else
            return ToolView(content, [], failed=final or bool(text[j:].strip()))
        i = skip_ws(text, line_end + 1)
        if i >= n:
            return ToolView(content, [], failed=final)
        bracket = text[i] == "["
        calls, end, failed = self._calls(text, i + 1 if bracket else i, final, bracket)
        if end is None or failed:
            return ToolView(content, calls, failed=failed)
        k = skip_ws(text, end)
        if text.startswith("```", k):
            k += 3
        elif not final and "```".startswith(text[k:]):
            k = n
        return ToolView(content, calls, failed=bool(text[k:].strip()))

    def _calls(self, text: str, i: int, final: bool, bracket: bool) -> tuple[list[PartialCall], Optional[int], bool]:
        """The calls from text[i] on (after the '[' when `bracket`): (calls so far, where the list
        ends -- after its ']', or where bare calls stop -- or None when the text ends first, failed)."""
        calls: list[PartialCall] = []
        n = len(text)
        i = skip_ws(text, i)
        while i < n:
            m = _IDENT.match(text, i)
            if m is None:
                return calls, None, True
            j = skip_ws(text, m.end())
            if j >= n:
                break
            if text[j] != "(":
                return calls, None, True
            call = PartialCall(m.group(0), "{")     # reported once it is seen to take keyword arguments
            parts: list[str] = []
            j = skip_ws(text, j + 1)
            while j < n:
                if text[j] == ")":
                    call.done = True
                    j += 1
                    break
                kw = _KWARG.match(text, j)
                if kw is None:
                    if _PARTIAL_KWARG.fullmatch(text, j):
                        return calls, None, final
                    return calls, None, True     # a positional argument
                if not calls or calls[-1] is not call:
                    calls.append(call)
                end = _py_value_end(text, kw.end())
                if end is None:
                    break
                try:     # a Python literal that JSON has (not bytes, sets, complex, inf)
                    parts.append(_json_arg(kw.group(1), ast.literal_eval(text[kw.end():end].strip())))
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    return calls, None, True
                call.arguments = "{" + ", ".join(parts)
                j = skip_ws(text, end + 1 if text[end] == "," else end)
            if not call.done:
                return calls, None, final
            if not calls or calls[-1] is not call:
                calls.append(call)
            call.arguments += "}"
            i = skip_ws(text, j)
            if i < n and text[i] == ",":
                i = skip_ws(text, i + 1)
                continue
            if bracket:
                if i < n and text[i] == "]":
                    return calls, i + 1, False
                if i < n:
                    return calls, None, True
                break
            if i >= n:
                return calls, (n if final else None), False
            if text[i] == "`":
                return calls, i, False
        return calls, None, final
