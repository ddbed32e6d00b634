"""Structural tags (`structured_outputs.structural_tag`): the checks and conversions the built-in
grammar backends share.

A structural tag constrains only parts of otherwise free text, typically tool calls. In the
legacy form (vLLM's) `{"structures": [{"begin": "<function=get_weather>", "schema": {...},
"end": "</function>"}], "triggers": ["<function="]}` the output is free text until one of the
triggers appears; from there it must go on as one of the structures whose `begin` starts with
that trigger, then a JSON value matching that structure's `schema`, then its `end`; after that
it is free text again (and the next trigger starts the next structure). xgrammar's newer form
`{"type": "structural_tag", "format": {...}}` says the same and more in xgrammar's format
language (e.g. `{"type": "triggered_tags", "triggers": [...], "tags": [{"begin": ...,
"content": {"type": "json_schema", "json_schema": {...}}, "end": ...}]}`).

xgrammar compiles the `format` form itself, so `to_xgrammar` turns the legacy form into it (one
`triggered_tags` format: what xgrammar's own deprecated legacy API does). llguidance has no such
format language: it gets the list of `Tag`s -- from the legacy form (`legacy_tags`), or from the
one `format` shape that means the same (`format_tags`: `triggered_tags` of begin / JSON schema /
end tags); any other format is refused, naming what is not supported.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

from .errors import RequestError


@dataclass(frozen=True)
class Tag:
    trigger: str              # the trigger that starts it (a prefix of `begin`)
    begin: str
    schema: dict              # the JSON schema of what comes between begin and end
    ends: tuple[str, ...]     # one of these ends it


def refuse(message: str) -> RequestError:
    return RequestError(message, "structured_outputs", "invalid_value")


def load(spec: str) -> dict:
    """The structural tag of a spec (StructuredOutputsParams.spec: its JSON text)."""
    try:
        value = json.loads(spec)
    except ValueError as e:
        raise refuse(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise refuse(f"structural_tag must be a JSON object, got {type(value).__name__}")
    return value


def is_legacy(value: dict) -> bool:
    return "structures" in value or "triggers" in value


def legacy_tags(value: dict) -> list[Tag]:
    """The tags of the legacy form (`structures` + `triggers`), checked."""
    structures = value.get("structures")
    if not isinstance(structures, list) or not structures:
        raise refuse("structural_tag.structures must be a non-empty list of {begin, schema, end} objects")
    tags = []
    for i, s in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(s, dict):
            raise refuse(f"{where} must be an object with begin, schema and end")
        if not isinstance(s.get("end"), str):
            raise refuse(f"{where}.end must be a string")
        tags.append((where, s.get("begin"), _schema(s.get("schema"), f"{where}.schema"), (s["end"],)))
    return _with_triggers(value.get("triggers"), "structural_tag.triggers", tags)


def format_tags(value: dict, backend: str) -> list[Tag]:
    """The tags of a `format` that means what the legacy form does (triggered_tags of begin /
    JSON schema / end tags); RequestError naming what else it uses, which `backend` cannot do."""
    fmt = value.get("format")
    if not isinstance(fmt, dict):
        raise refuse("structural_tag.format must be an object")
    kind = fmt.get("type")

    def unsupported(what: str) -> RequestError:
        return refuse(f"the {backend} grammar backend supports structural_tag.format only as "
                      "'triggered_tags' of {begin, json_schema content, end} tags (what the legacy "
                      f"structures/triggers form says); {what} is not supported: use the xgrammar "
                      "backend (--structured-outputs-backend xgrammar) for it")
    if kind != "triggered_tags":
        raise unsupported(f"format type {kind!r}")
    for option in ("at_least_one", "stop_after_first"):
        if fmt.get(option, False) is not False:
            raise unsupported(f"triggered_tags.{option}={fmt[option]!r}")
    if fmt.get("excludes"):
        raise unsupported("triggered_tags.excludes")
    raw = fmt.get("tags")
    if not isinstance(raw, list) or not raw:
        raise refuse("structural_tag.format.tags must be a non-empty list of tags")
    tags = []
    for i, t in enumerate(raw):
        where = f"structural_tag.format.tags[{i}]"
        if not isinstance(t, dict) or t.get("type", "tag") != "tag":
            raise refuse(f"{where} must be a tag object ({{type: 'tag', begin, content, end}})")
        content = t.get("content")
        if not isinstance(content, dict) or content.get("type") != "json_schema":
            raise unsupported(f"{where}.content of type "
                              f"{content.get('type') if isinstance(content, dict) else content!r}")
        if content.get("style", "json") != "json":
            raise unsupported(f"{where}.content.style {content['style']!r}")
        for key in sorted(set(content) - {"type", "json_schema", "style"}):
            if content[key] not in (False, None, []):
                raise unsupported(f"{where}.content.{key}")
        end = t.get("end")
        ends = (end,) if isinstance(end, str) else tuple(end) if isinstance(end, list) else ()
        if not ends or not all(isinstance(e, str) for e in ends):
            raise unsupported(f"{where}.end {end!r} (a string or a list of strings is)")
        tags.append((where, t.get("begin"), _schema(content.get("json_schema"), f"{where}.content.json_schema"),
                     ends))
    return _with_triggers(fmt.get("triggers"), "structural_tag.format.triggers", tags)


def schemas(value: dict) -> Iterator[tuple[str, Any]]:
    """(where, JSON schema) for each schema in the structural tag, either form, anywhere in a
    `format`; unchecked (one given as JSON text that does not parse is left out: the backends say so)."""
    if is_legacy(value):
        found = [(f"structural_tag.structures[{i}].schema", s.get("schema"))
                 for i, s in enumerate(value.get("structures") or []) if isinstance(s, dict)]
    else:
        found = list(_format_schemas(value.get("format"), "structural_tag.format"))
    for where, schema in found:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                continue
        yield where, schema


def _format_schemas(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _format_schemas(item, f"{where}[{i}]")
    elif isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield f"{where}.json_schema", node["json_schema"]
            return
        for key, value in node.items():
            yield from _format_schemas(value, f"{where}.{key}")


def to_xgrammar(value: dict) -> str:
    """The structural tag as xgrammar's `format` form (JSON text); the legacy form converted."""
    if not is_legacy(value):
        return json.dumps(value)
    tags = legacy_tags(value)
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": value["triggers"],
        "tags": [{"type": "tag", "begin": t.begin, "content": {"type": "json_schema", "json_schema": t.schema},
                  "end": t.ends[0]} for t in tags]}})


def _schema(schema: Any, where: str) -> dict:
    if schema is None:
        raise refuse(f"{where} is missing: a JSON schema is needed")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise refuse(f"{where} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise refuse(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    return schema


def _with_triggers(triggers: Any, where: str, tags: list[tuple[str, Any, dict, tuple[str, ...]]]) -> list[Tag]:
    if (not isinstance(triggers, list) or not triggers
            or not all(isinstance(t, str) and t for t in triggers)):
        raise refuse(f"{where} must be a non-empty list of non-empty strings")
    out = []
    for tag_where, begin, schema, ends in tags:
        if not isinstance(begin, str):
            raise refuse(f"{tag_where}.begin must be a string")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise refuse(f"{tag_where}.begin {begin!r} does not start with any of the triggers {triggers!r}")
        out.append(Tag(trigger, begin, schema, ends))
    return out
