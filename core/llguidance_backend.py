"""A second grammar backend: llguidance (https://github.com/guidance-ai/llguidance).

Registered as `guidance` in the `tokenmill.grammar_backends` entry-point group (pyproject.toml);
chosen with `--structured-outputs-backend guidance`. The same kinds as xgrammar; a constraint is
turned into an llguidance grammar, checked once by building a prototype matcher (the compile cache
keeps it), and every sequence gets a cheap deep copy of it. `llguidance.torch` fills tokenmill's
packed int32 bitmask (plugins/parsers.py) in place -- the same layout as xgrammar's.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from tokenmill.plugins.parsers import CompiledGrammar, GrammarBackend, GrammarMatcher

from .errors import RequestError

_CACHE_SIZE = 256
_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar",
         "choice": "choice"}


class GuidanceMatcher(GrammarMatcher):
    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask
        fill_next_token_bitmask(self._m, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.consume_token(token_id)) and not self._m.is_error()

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())


class GuidanceCompiled(CompiledGrammar):
    def __init__(self, prototype: Any) -> None:
        self._prototype = prototype    # a fresh LLMatcher, never advanced: copied per sequence

    def new_matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._prototype.deep_copy())


class GuidanceBackend(GrammarBackend):
    supported_kinds = ("json", "json_object", "regex", "choice", "grammar")

    def __init__(self, tokenizer: Any, vocab_size: int = 0, stop_token_ids: Sequence[int] = ()) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import llguidance
        import llguidance.hf
        self._llg = llguidance
        eos = list(stop_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size or None, eos_token=eos)
        self.vocab_size = self._tokenizer.vocab_size
        self._cache: OrderedDict[tuple[str, str], GuidanceCompiled] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, spec: str) -> GuidanceCompiled:
        key = (kind, spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        matcher = self._llg.LLMatcher(self._tokenizer, self._grammar(kind, spec), log_level=0)
        if matcher.is_error():
            raise _refuse(f"invalid {_WHAT.get(kind, kind)} in structured_outputs: {_first_line(matcher.get_error())}")
        compiled = GuidanceCompiled(matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _grammar(self, kind: str, spec: str) -> str:
        """The llguidance grammar text for the constraint (RequestError when it cannot be built)."""
        m = self._llg.LLMatcher
        options = {"whitespace_flexible": False}   # compact JSON, as the xgrammar backend emits
        try:
            if kind == "json":
                try:
                    json.loads(spec)
                except ValueError as e:
                    raise _refuse(f"the JSON schema is not valid JSON: {e}") from None
                return m.grammar_from_json_schema(spec, defaults=options)
            if kind == "json_object":
                return m.grammar_from_json_schema('{"type": "object"}', defaults=options)
            if kind == "regex":
                return m.grammar_from_regex(spec)
            if kind == "choice":
                return self._llg.grammar_from("choice", spec)
            if kind == "grammar":
                # EBNF (GBNF) uses `::=`; anything else is taken as a Lark grammar (as with xgrammar).
                return self._llg.grammar_from("gbnf" if "::=" in spec else "lark", spec)
        except RequestError:
            raise
        except Exception as e:   # llguidance reports bad input as ValueError (and the like)
            raise _refuse(f"invalid {_WHAT.get(kind, kind)} in structured_outputs: "
                          f"{_first_line(str(e)) or type(e).__name__}") from None
        raise _refuse(f"structured output kind {kind!r} is not supported by the guidance backend")


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


def _refuse(message: str) -> RequestError:
    return RequestError(message, "structured_outputs", "invalid_value")
