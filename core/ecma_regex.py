"""ECMA-262 regexes made explicit for llguidance, whose regexes are the Rust regex crate's.

Regexes reach the grammar backends in ECMA-262's dialect: OpenAI's and JSON Schema's `pattern`
and `patternProperties` are ECMA-262, and the `regex` constraint and a Lark grammar's /.../
terminals are read the same way, so that one request accepts one language whichever backend
runs it. The dialects disagree on the class escapes: Rust's `\\d`, `\\w` and `\\s` are Unicode
(`\\d` takes "١" and "🯸"), ECMA-262's are [0-9], [0-9A-Za-z_] and ECMA's whitespace set.
xgrammar reads them as ECMA-262 does (checked code point by code point); the guidance backend
hands llguidance `explicit_classes(regex)`: each class escape spelled as the class it means, in
brackets too (`[\\d-]` -> `[0-9\\-]`; a complement becomes a nested class, which Rust reads as a
union: `[a\\D]` -> `[a[^0-9]]`), and within brackets what Rust reads as class-set syntax but
ECMA-262 as literals quoted (`[`, `&`, `~`, a `-` that makes no range; ECMA's `[]` and `[^]`).
The rest passes as it is: Rust refuses most of what else differs (lookarounds, `\\cX`, `[\\b]`).
"""
from __future__ import annotations

import re

_DIGIT = "0-9"
_WORD = "0-9A-Za-z_"
# ECMA-262's \s: WhiteSpace (TAB VT FF SP NBSP ZWNBSP and the Zs category) and LineTerminator (LF CR LS PS).
_SPACE = r"\t\n\x0B\x0C\r\x20\xA0\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}"
_CLASSES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_NOTHING, _ANYTHING = r"[^\x00-\x{10FFFF}]", r"[\x00-\x{10FFFF}]"   # ECMA's [] and [^]
_ESCAPE_END = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u\{[0-9A-Fa-f]+\}|u[0-9A-Fa-f]{4}|[pP]\{[^}]*\}|c[A-Za-z]|.)",
                         re.DOTALL)
# A Lark grammar's strings and comments (kept as they are) and its /regex/ terminals (group 1).
_LARK_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|(?://|#)[^\n]*|/((?:\\.|[^/\\\n])+)/')


def explicit_classes(regex: str) -> str:
    """`regex` (ECMA-262) with its class escapes spelled out, for llguidance."""
    out: list[str] = []
    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        if ch == "\\" and i + 1 < n:
            name = regex[i + 1]
            members = _CLASSES.get(name.lower()) if name in "dDwWsS" else None
            out.append(regex[i:i + 2] if members is None else f"[^{members}]" if name.isupper() else f"[{members}]")
            i += 2          # the rest of a longer escape (\x41, \p{L}) has no backslash: copied as it comes
        elif ch == "[":
            i = _bracket(regex, i, out)
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def lark_regexes(grammar: str) -> str:
    """A Lark grammar with each /regex/ terminal made explicit (strings and comments untouched)."""
    return _LARK_TOKEN.sub(lambda m: m[0] if m[1] is None else f"/{explicit_classes(m[1])}/", grammar)


def _bracket(regex: str, start: int, out: list[str]) -> int:
    """Append the class at regex[start] ('['), made explicit; the index after its ']'. An
    unterminated class is copied as it is (llguidance refuses it)."""
    i, n = start + 1, len(regex)
    negated = regex.startswith("^", i)
    i += negated
    atoms: list[tuple[str, bool, bool]] = []   # (Rust text, one character (may bound a range), an unescaped '-')
    while i < n and regex[i] != "]":
        if regex[i] == "\\":
            m = _ESCAPE_END.match(regex, i)
            if m is None:                      # a trailing backslash
                break
            name = m[0][1]
            members = _CLASSES.get(name.lower()) if name in "dDwWsS" else None
            if members is not None:
                atoms.append((f"[^{members}]" if name.isupper() else members, False, False))
            else:
                atoms.append((m[0], name not in "pP", False))
            i = m.end()
        else:
            ch = regex[i]
            atoms.append(("\\" + ch if ch in "[&~-" else ch, True, ch == "-"))
            i += 1
    if i >= n:
        out.append(regex[start:])
        return n
    if not atoms:
        out.append(_ANYTHING if negated else _NOTHING)
        return i + 1
    parts, j = [], 0
    while j < len(atoms):
        text, single, _ = atoms[j]
        # ECMA-262: a '-' between two single characters is a range; anywhere else it is itself.
        if j + 2 < len(atoms) and atoms[j + 1][2] and single and atoms[j + 2][1]:
            parts.append(f"{text}-{atoms[j + 2][0]}")
            j += 3
        else:
            parts.append(text)
            j += 1
    out.append(f"[{'^' if negated else ''}{''.join(parts)}]")
    return i + 1
