"""Scanning JSON that may still be arriving: where a value ends (None: not yet), and the name and
arguments of a tool-call object `{"name": ..., "arguments"|"parameters": {...}}`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

_WS = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> Optional[int]:
    """text[i] is '"': the index after the closing quote, or None."""
    j, n = i + 1, len(text)
    while j < n:
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> Optional[int]:
    """The end (exclusive) of the JSON value starting at text[i]; None when the text ends first."""
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < n:
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i     # a number, true, false, null: ends where the next delimiter is
    while j < n and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < n else None


@dataclass
class CallScan:
    """What a (possibly incomplete) tool-call object says so far."""
    name: Optional[str] = None
    args_start: Optional[int] = None
    args_end: Optional[int] = None     # None: the arguments value is not complete yet
    name_after_args: bool = False      # the arguments came first (they cannot stream before the name)
    end: Optional[int] = None          # after the closing '}', once complete
    invalid: bool = False              # not JSON of that shape

    def arguments(self, text: str) -> str:
        """The arguments JSON text that is certain so far (a prefix of the final one; all of it once
        `end` is set). Empty until the name is known."""
        if self.name is None:
            return ""
        if self.args_start is None:
            return "{}" if self.end is not None else ""
        if text[self.args_start] == "{" and not self.name_after_args:
            return text[self.args_start:self.args_end if self.args_end is not None else len(text)]
        if self.args_end is None:
            return ""
        value = json.loads(text[self.args_start:self.args_end])
        if value is None:
            return "{}"
        if isinstance(value, str):     # arguments given as a JSON string
            return value
        return text[self.args_start:self.args_end] if isinstance(value, dict) else json.dumps(value)


def scan_call(text: str, start: int, name_keys: tuple[str, ...] = ("name",)) -> CallScan:
    """Scan the tool-call object whose '{' is text[start]; the function's name is under one of
    `name_keys` (Cohere's calls say "tool_name")."""
    res = CallScan()
    n = len(text)
    i = skip_ws(text, start + 1)
    try:
        while i < n:
            c = text[i]
            if c == "}":
                res.end = i + 1
                return res
            if c == ",":
                i = skip_ws(text, i + 1)
                continue
            if c != '"':
                res.invalid = True
                return res
            key_end = _string_end(text, i)
            if key_end is None:
                return res
            key = json.loads(text[i:key_end])
            i = skip_ws(text, key_end)
            if i >= n:
                return res
            if text[i] != ":":
                res.invalid = True
                return res
            i = skip_ws(text, i + 1)
            if i >= n:
                return res
            end = value_end(text, i)
            if key in ARGUMENT_KEYS and res.args_start is None:
                if end is not None:
                    json.loads(text[i:end])      # a complete value that is not JSON: invalid
                res.args_start, res.args_end = i, end
                res.name_after_args = res.name is None
            elif key in name_keys and end is not None:
                name = json.loads(text[i:end])
                if not isinstance(name, str):
                    res.invalid = True
                    return res
                res.name = name
            if end is None:
                return res
            i = skip_ws(text, end)
    except ValueError:
        res.invalid = True
    return res
