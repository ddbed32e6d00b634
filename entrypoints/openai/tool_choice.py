"""Forced tool choice on /v1/chat/completions: `tool_choice` "required" or a named function is
enforced by a JSON schema built from the tools' parameters (as vLLM does), and the constrained
output is read back as tool calls without a `--tool-call-parser`.

- "required": a JSON array of one or more (exactly one when `parallel_tool_calls` is false) objects
  `{"name": <a tool's name>, "parameters": <that tool's parameters>}` (`anyOf` per tool, `const` name);
- `{"type": "function", "function": {"name": NAME}}`: the arguments object of that function.

`ForcedToolParser` reads the output; it plugs into ChatChoiceOutput like any tool parser.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from ...plugins.parsers import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta, ToolParser
from . import errors as E

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _functions(tools: Any) -> list[dict[str, Any]]:
    """The tools' function definitions (name, parameters); a 400 naming `tools` for a bad one."""
    if not isinstance(tools, list) or not tools:
        raise E.bad_request("tool_choice 'required' or a named function needs a non-empty 'tools' list.",
                            "tools", "invalid_value")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise E.bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}.",
                                "tools", "invalid_value")
        params = fn.get("parameters")
        if params is None:
            params = _ANY_OBJECT
        if not isinstance(params, dict):
            raise E.bad_request(f"tools[{i}].function.parameters must be a JSON schema object.",
                                "tools", "invalid_value")
        out.append({"name": fn["name"], "parameters": params})
    return out


def forced_name(tool_choice: Any) -> Optional[str]:
    """The function a named tool_choice forces (None for a string tool_choice); 400 for a bad shape."""
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise E.bad_request("A named tool_choice must be {'type': 'function', 'function': {'name': NAME}}.",
                            "tool_choice", "invalid_value")
    return fn["name"]


def is_forced(tool_choice: Any) -> bool:
    return tool_choice == "required" or isinstance(tool_choice, dict)


def forced_schema(tools: Any, tool_choice: Any, parallel_tool_calls: Optional[bool]) -> dict[str, Any]:
    """The JSON schema that enforces a "required" or named tool_choice."""
    functions = _functions(tools)
    name = forced_name(tool_choice)
    if name is not None:
        for fn in functions:
            if fn["name"] == name:
                return fn["parameters"]
        raise E.bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                            f"({', '.join(f['name'] for f in functions)}).", "tool_choice", "invalid_value")
    items = [{"type": "object", "properties": {"name": {"type": "string", "const": fn["name"]},
                                               "parameters": fn["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False} for fn in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


class ForcedToolParser(ToolParser):
    """Reads the constrained output of a forced tool choice: the named function's arguments object
    (`name` set), or the "required" array of {"name", "parameters"} objects. Streamed, a named call's
    arguments go out as they come; a "required" call's name once it is complete, then its arguments
as they come."""

    def __init__(self, tokenizer: Any, name: Optional[str] = None) -> None:
        super().__init__(tokenizer)
        self.name = name
        self.sent_args: list[int] = []   # "required": per call begun, how much of its arguments was sent
        self.started = False     # named: the call's opening delta was sent

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if self.name is not None:
            text = model_output.strip()
            try:
                ok = isinstance(json.loads(text), dict)
            except ValueError:
                ok = False
            if not ok:
                return ExtractedToolCalls(content=model_output)
            return ExtractedToolCalls(content=None, tool_calls=[ToolCall(self.name, text)])
        calls = self._complete(model_output)
        try:
            whole = json.loads(model_output)
        except ValueError:
            whole = None
        if not isinstance(whole, list) or len(calls) != len(whole) or not calls:
            return ExtractedToolCalls(content=model_output)
        return ExtractedToolCalls(content=None, tool_calls=calls)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> Optional[DeltaMessage]:
        if self.name is not None:
            piece = delta_text if self.started else current_text.lstrip()
            if not piece:
                return None
            first = not self.started
            self.started = True
            return DeltaMessage(tool_calls=[ToolCallDelta(index=0, name=self.name if first else None,
                                                          arguments=piece)])
        deltas = []
        for i, (name, args, _) in enumerate(_calls_so_far(current_text)):
            if name is None:
                break
            if i == len(self.sent_args):          # a new call: its name (and arguments so far)
                self.sent_args.append(0)
                deltas.append(ToolCallDelta(index=i, name=name, arguments=args))
            elif len(args) > self.sent_args[i]:
                deltas.append(ToolCallDelta(index=i, arguments=args[self.sent_args[i]:]))
            self.sent_args[i] = len(args)
        return DeltaMessage(tool_calls=deltas) if deltas else None

    @staticmethod
    def _complete(text: str) -> list[ToolCall]:
        """The complete {"name", "parameters"} objects at the start of the array `text`."""
        return [ToolCall(name, args) for name, args, done in _calls_so_far(text) if done and name is not None]


def _calls_so_far(text: str) -> list[tuple[Optional[str], str, bool]]:
    """The "required" array's calls in the (possibly still growing) `text`: (name, arguments, done)
    per object. The arguments are the exact text of the "parameters" value -- while it grows, the
    part written so far, which only ever grows -- so streamed fragments add up to the finished
    call's arguments. The name is None until its string is complete."""
    dec = json.JSONDecoder()
    calls: list[tuple[Optional[str], str, bool]] = []
    pos = _skip_ws(text, 0)
    if text[pos:pos + 1] != "[":
        return calls
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if text[pos:pos + 1] != "{":
            return calls
        name: Optional[str] = None
        args, pos = "", pos + 1
        while True:                            # the object's members, in the order written
            pos = _skip_ws(text, pos)
            if text[pos:pos + 1] == "}":
                calls.append((name, args or "{}", True))
                pos += 1
                break
            try:
                key, pos = dec.raw_decode(text, pos)
            except ValueError:
                calls.append((name, args, False))
                return calls
            pos = _skip_ws(text, pos)
            if text[pos:pos + 1] != ":":
                calls.append((name, args, False))
                return calls
            pos = _skip_ws(text, pos + 1)
            try:
                value, end = dec.raw_decode(text, pos)
            except ValueError:                 # the value is still being written
                if key in ("parameters", "arguments"):
                    args = text[pos:]
                calls.append((name, args, False))
                return calls
            if key == "name" and isinstance(value, str):
                name = value
            elif key in ("parameters", "arguments"):
                args = text[pos:end]
            pos = _skip_ws(text, end)
            if text[pos:pos + 1] == ",":
                pos += 1
        pos = _skip_ws(text, pos)
        if text[pos:pos + 1] != ",":
            return calls
        pos += 1


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
