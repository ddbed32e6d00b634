"""The built-in grammar backend: xgrammar (https://github.com/mlc-ai/xgrammar).

Registered as `xgrammar` in the `tokenmill.grammar_backends` entry-point group (pyproject.toml).
It compiles a structured-output constraint (the base class caches it per (kind, spec)) and hands
out one matcher per sequence; the matchers fill tokenmill's packed int32 bitmask (the format of
plugins/parsers.py, which is xgrammar's own) in place.

A structural tag (free text in which each trigger starts a begin / JSON schema / end structure:
core/structural_tag.py) goes to `compile_structural_tag`: xgrammar's newer `format` form as it
is, vLLM's legacy `structures` / `triggers` form converted to the `triggered_tags` format.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

import torch

from tokenmill.plugins.parsers import CompiledGrammar, GrammarBackend, GrammarMatcher

from . import structural_tag
from .errors import RequestError

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")   # "[12:37:15] /project/cpp/x.cc:94: "
_XGR_CHECK = re.compile(r"^Check failed: \(.*?\) is false: ")   # "Check failed: (ok) is false: "
_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
         "structural_tag": "structural tag"}


class XGrammarMatcher(GrammarMatcher):
    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    supports_rollback = True

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def count_valid(self, token_ids: Sequence[int]) -> int:
        kept = 0                   # xgrammar's accept_token leaves the state as it was on refusal
        for token in token_ids:
            if self._m.is_terminated() or not self._m.accept_token(token):
                break
            kept += 1
        if kept:
            self._m.rollback(kept)
        return kept


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def new_matcher(self) -> XGrammarMatcher:
        import xgrammar
        return XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled))


class XGrammarBackend(GrammarBackend):
    supported_kinds = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

    def __init__(self, tokenizer: Any, vocab_size: int = 0, stop_token_ids: Sequence[int] = ()) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import xgrammar
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size or None, stop_token_ids=list(stop_token_ids) or None)
        self.vocab_size = info.vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, kind: str, spec: str) -> XGrammarCompiled:
        return XGrammarCompiled(self._compile(kind, spec))

    def _compile(self, kind: str, spec: str) -> Any:
        c, xgr = self._compiler, self._xgr
        try:
            if kind == "json":
                try:
                    json.loads(spec)
                except ValueError as e:
                    raise _refuse(f"the JSON schema is not valid JSON: {e}") from None
                return c.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                # Any JSON *object* (the builtin JSON grammar would also allow arrays and scalars).
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                alts = " | ".join(_ebnf_string(s) for s in json.loads(spec))
                return c.compile_grammar(f"root ::= {alts}")
            if kind == "grammar":
                # xgrammar's EBNF (GBNF) uses `::=`; anything else is taken as a Lark grammar.
                grammar = xgr.Grammar.from_ebnf(spec) if "::=" in spec else xgr.Grammar.from_lark(spec)
                return c.compile_grammar(grammar)
            if kind == "structural_tag":
                return c.compile_structural_tag(structural_tag.to_xgrammar(structural_tag.load(spec)))
        except RequestError:
            raise
        except Exception as e:   # xgrammar reports bad input as RuntimeError / ValueError / its own types
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            detail = _XGR_CHECK.sub("", _XGR_PREFIX.sub("", detail))
            raise _refuse(f"invalid {_WHAT.get(kind, kind)} in structured_outputs: {detail}") from None
        raise _refuse(f"structured output kind {kind!r} is not supported by the xgrammar backend")


def _refuse(message: str) -> RequestError:
    return RequestError(message, "structured_outputs", "invalid_value")


def _ebnf_string(text: str) -> str:
    """A double-quoted EBNF string literal matching `text` exactly."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
