"""The JSON schemas of structured outputs, read the same way whichever grammar backend compiles them.

`subschemas` walks a schema's schema objects -- under any keyword but the data ones (`const`,
`enum`, `default`, `examples`: a `$ref` or `pattern` there is a value, not a keyword), and every
value of a name -> schema map (`properties`, `$defs`, ...) whatever its name. With it:

- `check_refs` refuses a `$ref` that does not point into the schema itself ('#...'). Nothing is
  ever fetched: xgrammar let anything through where such a reference was (a warning, then an
  unconstrained value), llguidance refused it; now both refuse it, before compiling, naming it.
- `map_patterns` rewrites the regexes a schema holds (`pattern`, `patternProperties`' names):
  the guidance backend spells their class escapes out (core/ecma_regex.py).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from .errors import RequestError

_DATA = frozenset({"const", "enum", "default", "examples"})
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})
_REFS = ("$ref", "$dynamicRef")


def subschemas(schema: Any, path: str = "#") -> Iterator[tuple[str, dict]]:
    """(JSON pointer, schema object) for `schema` and every schema object inside it."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from subschemas(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key, value in schema.items():
        if key in _DATA:
            continue
        where = f"{path}/{_pointer(key)}"
        if key in _MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from subschemas(sub, f"{where}/{_pointer(name)}")
        else:
            yield from subschemas(value, where)


def check_refs(schema: Any, what: str = "the JSON schema") -> None:
    """RequestError (param structured_outputs) for a reference outside the schema."""
    for path, node in subschemas(schema):
        for key in _REFS:
            ref = node.get(key)
            if isinstance(ref, str) and not ref.startswith("#"):
                raise RequestError(
                    f"{what} has {key} {ref!r} (at {path}), which points outside the schema: schemas are "
                    f"never fetched; define it under $defs and refer to it as '#/$defs/NAME'",
                    "structured_outputs", "invalid_value")


def map_patterns(schema: Any, rewrite: Callable[[str], str]) -> Any:
    """`schema` with each regex it holds rewritten (in place: give it a schema of your own)."""
    for _, node in list(subschemas(schema)):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = rewrite(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            rewritten: dict[str, Any] = {}
            for name, sub in node["patternProperties"].items():
                name = rewrite(name)    # two spellings of one regex: a name must meet both schemas
                rewritten[name] = {"allOf": [rewritten[name], sub]} if name in rewritten else sub
            node["patternProperties"] = rewritten
    return schema


def _pointer(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")
