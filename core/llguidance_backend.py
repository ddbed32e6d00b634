"""A second grammar backend: llguidance (https://github.com/guidance-ai/llguidance).

Registered as `guidance` in the `tokenmill.grammar_backends` entry-point group (pyproject.toml);
chosen with `--structured-outputs-backend guidance`. The same kinds as xgrammar; a constraint is
turned into an llguidance grammar, checked once by building a prototype matcher (the compile cache
keeps it), and every sequence gets a cheap deep copy of it. `llguidance.torch` fills tokenmill's
packed int32 bitmask (plugins/parsers.py) in place -- the same layout as xgrammar's.

Regexes -- the `regex` constraint, a schema's `pattern` / `patternProperties`, a Lark grammar's
/.../ terminals -- mean what they mean on xgrammar, ECMA-262's `\\d` `\\w` `\\s` (ASCII digits and word
characters, ECMA's whitespace), not llguidance's Unicode ones: core/ecma_regex.py spells them out.

A structural tag (core/structural_tag.py: free text in which each trigger starts a begin / JSON
schema / end structure) becomes a Lark grammar: `start: (tag_0 | ...)* TAG_TEXT`, each trigger a
lazy lexeme (free text up to the trigger's first occurrence) followed by the alternatives of its
structures (`"rest of begin" %json {schema} "end"`); a trigger that is a special token of the
tokenizer is matched as that token. xgrammar's `format` form has no llguidance equivalent beyond
the shape the legacy form has (triggered_tags of JSON-schema tags): anything else is refused.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Sequence

import torch

from tokenmill.plugins.parsers import CompiledGrammar, GrammarBackend, GrammarMatcher

from . import ecma_regex, json_schema, structural_tag
from .errors import RequestError

_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar",
         "choice": "choice", "structural_tag": "structural tag"}


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

    supports_rollback = True

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def count_valid(self, token_ids: Sequence[int]) -> int:
        return int(self._m.validate_tokens(list(token_ids)))   # consuming a refused token would be an error state


class GuidanceCompiled(CompiledGrammar):
    def __init__(self, prototype: Any) -> None:
        self._prototype = prototype    # a fresh LLMatcher, never advanced: copied per sequence

    def new_matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._prototype.deep_copy())


class GuidanceBackend(GrammarBackend):
    supported_kinds = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

    def __init__(self, tokenizer: Any, vocab_size: int = 0, stop_token_ids: Sequence[int] = ()) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import llguidance
        import llguidance.hf
        self._llg = llguidance
        eos = list(stop_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size or None, eos_token=eos)
        self.vocab_size = self._tokenizer.vocab_size

    def compile(self, kind: str, spec: str) -> GuidanceCompiled:
        matcher = self._llg.LLMatcher(self._tokenizer, self._grammar(kind, spec), log_level=0)
        if matcher.is_error():
            raise _refuse(f"invalid {_WHAT.get(kind, kind)} in structured_outputs: {_first_line(matcher.get_error())}")
        # llguidance builds its lexer lazily, at the first mask (seconds for a large grammar); the
        # copies share what it built, so build it here, on the compile thread, not in a step.
        from llguidance.torch import fill_next_token_bitmask
        scratch = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        fill_next_token_bitmask(matcher.deep_copy(), scratch, 0)
        return GuidanceCompiled(matcher)

    def _grammar(self, kind: str, spec: str) -> str:
        """The llguidance grammar text for the constraint (RequestError when it cannot be built)."""
        m = self._llg.LLMatcher
        options = {"whitespace_flexible": False}   # compact JSON, as the xgrammar backend emits
        try:
            if kind == "json":
                try:
                    schema = json.loads(spec)
                except ValueError as e:
                    raise _refuse(f"the JSON schema is not valid JSON: {e}") from None
                explicit = _ecma_patterns(schema)   # the text as it came when there is nothing to spell out
                return m.grammar_from_json_schema(spec if explicit == schema else json.dumps(explicit),
                                                  defaults=options)
            if kind == "json_object":
                return m.grammar_from_json_schema('{"type": "object"}', defaults=options)
            if kind == "regex":
                return m.grammar_from_regex(ecma_regex.explicit_classes(spec))
            if kind == "choice":
                return self._llg.grammar_from("choice", spec)
            if kind == "grammar":
                # EBNF (GBNF) uses `::=`; anything else is taken as a Lark grammar (as with xgrammar),
                # its /regex/ terminals read as xgrammar reads them (core/ecma_regex.py).
                if "::=" in spec:
                    return self._llg.grammar_from("gbnf", spec)
                return self._llg.grammar_from("lark", ecma_regex.lark_regexes(spec))
            if kind == "structural_tag":
                return self._llg.grammar_from("lark", self._structural_tag_lark(spec))
        except RequestError:
            raise
        except Exception as e:   # llguidance reports bad input as ValueError (and the like)
            raise _refuse(f"invalid {_WHAT.get(kind, kind)} in structured_outputs: "
                          f"{_first_line(str(e)) or type(e).__name__}") from None
        raise _refuse(f"structured output kind {kind!r} is not supported by the guidance backend")

    def _structural_tag_lark(self, spec: str) -> str:
        value = structural_tag.load(spec)
        tags = (structural_tag.legacy_tags(value) if structural_tag.is_legacy(value)
                else structural_tag.format_tags(value, "guidance"))
        by_trigger: dict[str, list[structural_tag.Tag]] = {}
        for tag in tags:
            by_trigger.setdefault(tag.trigger, []).append(tag)
        lines = ["%llguidance {}",
                 f"start: ({' | '.join(f'tag_{i}' for i in range(len(by_trigger)))})* TAG_TEXT",
                 r"TAG_TEXT: /(.|\n)*/"]
        for i, (trigger, group) in enumerate(by_trigger.items()):
            bodies = " | ".join(f"{_lit(t.begin[len(trigger):])} %json {json.dumps(_ecma_patterns(t.schema))} "
                                f"{_alts(t.ends)}" for t in group)
            special = self._special_token(trigger)
            if special is not None:   # text never spells a special token: it ends the free text itself
                lines.append(f"tag_{i}: TAG_TEXT <[{special}]> ({bodies})")
            else:                     # lazy: the free text ends at the trigger's first occurrence
                lines.append(f"tag_{i}_trig[lazy]: TAG_TEXT {_lit(trigger)}")
                lines.append(f"tag_{i}: tag_{i}_trig ({bodies})")
        return "\n".join(lines) + "\n"

    def _special_token(self, text: str) -> Any:
        """The id of the special token spelled `text`, or None."""
        try:
            tid = self.tokenizer.convert_tokens_to_ids(text)
            if (isinstance(tid, int) and 0 <= tid < self.vocab_size
                    and self.tokenizer.convert_ids_to_tokens(tid) == text and self._tokenizer.is_special_token(tid)):
                return tid
        except Exception:   # a tokenizer without these lookups: the trigger is text
            pass
        return None


def _ecma_patterns(schema: Any) -> Any:
    """A copy of the schema with its regexes' class escapes spelled out: llguidance reads a
    pattern's \\d and \\w as ECMA-262 does but its \\s as Unicode's (core/ecma_regex.py)."""
    return json_schema.map_patterns(copy.deepcopy(schema), ecma_regex.explicit_classes)


def _lit(text: str) -> str:
    """A Lark string literal matching `text` (nothing for an empty one)."""
    return json.dumps(text) if text else ""


def _alts(texts: tuple[str, ...]) -> str:
    """One of the strings (any may be empty)."""
    if len(texts) == 1:
        return _lit(texts[0])
    alts = " | ".join(_lit(t) for t in texts if t)
    return f"({alts})" + ("?" if "" in texts else "") if alts else ""


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


def _refuse(message: str) -> RequestError:
    return RequestError(message, "structured_outputs", "invalid_value")
