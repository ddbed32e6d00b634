"""One tool parser, one reasoning parser and one grammar backend, small but real."""
from __future__ import annotations

import json
import re

from tokenmill.plugins.parsers import (ExtractedToolCalls, GrammarBackend, ReasoningParser, ToolCall,
                                       ToolParser)


class JsonToolParser(ToolParser):
    """Tool calls written as `<tool>{"name": ..., "arguments": {...}}</tool>`."""

    def extract_tool_calls(self, model_output):
        calls = [json.loads(m) for m in re.findall(r"<tool>(.*?)</tool>", model_output, re.S)]
        rest = re.sub(r"<tool>.*?</tool>", "", model_output, flags=re.S).strip()
        return ExtractedToolCalls(rest or None, [ToolCall(c["name"], json.dumps(c.get("arguments", {})))
                                                 for c in calls])


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning between `<think>` and `</think>`."""

    def extract_reasoning(self, model_output):
        match = re.search(r"<think>(.*?)</think>", model_output, re.S)
        if not match:
            return None, model_output
        return match.group(1).strip(), (model_output[match.end():].strip() or None)


class RegexGrammarBackend(GrammarBackend):
    supported_kinds = ("regex",)

    def compile(self, kind, spec):
        return re.compile(spec)
