"""`tokenmill bench throughput --structured`: the constraints it uses, and a small end-to-end run."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill.entrypoints import bench_throughput as bt
from tokenmill.entrypoints.cli import build_parser, main

# The longest answer JSON_SCHEMA allows: every integer at its widest, every string and array at its
# longest, every enum at its longest member, false for booleans.
LONGEST_JSON = {"id": 9999, "name": "Aaaaaaaa", "age": 99, "status": "inactive", "role": "editor",
                "verified": False, "score": 100, "tags": ["aaaaaa"] * 3,
                "address": {"city": "Aaaaaaaaaa", "zip": "00000", "country": "US"},
                "plan": "free", "lang": "en", "level": 5, "active": False, "year": 2030,
                "priority": 3, "currency": "USD", "premium": False}


def _properties(schema):
    for name, sub in schema.get("properties", {}).items():
        yield name, sub
        yield from _properties(sub)


def test_json_schema_shape_and_token_budget():
    schema = bt.JSON_SCHEMA
    props = dict(_properties(schema))
    assert len(props) == 20          # the compile target is for a 20-field schema
    assert props["address"]["type"] == "object" and props["address"]["required"]
    assert props["tags"]["type"] == "array" and props["tags"]["items"]["type"] == "string"
    assert any("enum" in p for p in props.values())
    assert any("minimum" in p and "maximum" in p for p in props.values())
    assert schema["required"] == list(schema["properties"])
    jsonschema.validate(LONGEST_JSON, schema)
    for bigger in ({**LONGEST_JSON, "id": 10000}, {**LONGEST_JSON, "name": "Aaaaaaaaa"},
                   {**LONGEST_JSON, "tags": ["aaaaaa"] * 4}, {**LONGEST_JSON, "extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bigger, schema)
    # Every token is at least one ASCII character; the grammar's stop token comes last.
    assert len(json.dumps(LONGEST_JSON)) + 1 <= bt.JSON_MAX_TOKENS
    c = bt.build_constraint("json", 128)
    assert c.max_tokens == bt.JSON_MAX_TOKENS and c.params.kind == "json"
    assert c.valid(json.dumps(LONGEST_JSON))
    assert not c.valid(json.dumps(LONGEST_JSON)[:-1]) and not c.valid(json.dumps({**LONGEST_JSON, "age": 5}))


@pytest.mark.parametrize("output_len", [5, 9, 19, 32, 128, 256])
def test_regex_longest_match_fits_max_tokens(output_len):
    c = bt.build_constraint("regex", output_len)
    n = bt.phone_list_repeats(output_len)
    longest = "123-4567, " * n + "123-4567"
    assert c.valid(longest) and not c.valid(longest + ", 123-4567") and not c.valid("123-456")
    assert re.fullmatch(c.params.regex, longest)
    assert len(longest) + 1 == c.max_tokens
    assert c.max_tokens <= max(output_len, 9)     # as many items as output_len has room for
    assert n == 0 or len(longest) + 11 > output_len


def test_choice_constraint():
    c = bt.build_constraint("choice", 32)
    assert c.params.choice == bt.CHOICES and len(bt.CHOICES) >= 4
    assert c.max_tokens == max(map(len, bt.CHOICES)) + 1
    assert all(c.valid(s) for s in bt.CHOICES) and not c.valid(bt.CHOICES[0][:-1])
    with pytest.raises(ValueError):
        bt.build_constraint("grammar", 32)


def test_help_documents_the_options():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["bench"]
    throughput = next(a for a in sub._actions if a.dest == "bench_command").choices["throughput"]
    text = throughput.format_help()
    assert "--structured" in text and "--num-requests" in text


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_bench_structured_end_to_end(kind, tmp_path, capsys):
    out = tmp_path / "r.json"
    # One thread: on a shared 2-core machine two spin-waiting threads run several times slower.
    code = main(["bench", "throughput", "--workload", "W3", "--num-requests", "2", "--structured", kind,
                 "--device", "cpu", "--num-threads", "1", "--max-model-len", "1024",
                 "--kv-cache-memory", str(128 << 20), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert re.search(r"^W3 \(shared prefix \(prefix caching\)\): 2 requests, .* output tok/s, .* total tok/s, "
                     r"cached prompt tokens \d+, preemptions \d+$", printed, re.M), printed
    assert f"W3 constrained ({kind}, " in printed and "W3 ratio constrained / free: " in printed
    result = json.loads(out.read_text())
    assert result["structured_outputs"]["kind"] == kind
    entry = result["workloads"]["W3"]
    free, constrained, summary = entry["tokenmill"], entry["tokenmill_structured"], entry["structured"]
    assert free["output_tokens"] == 2 * 32 and free["mean_output_len"] == 32
    assert free["output_tok_s"] > 0 and constrained["output_tok_s"] > 0
    assert 0 < constrained["mean_output_len"] <= constrained["max_tokens"]
    assert constrained["output_tokens"] == 2 * constrained["mean_output_len"]
    assert summary["ratio_output_tok_s"] == pytest.approx(constrained["output_tok_s"] / free["output_tok_s"])
    assert summary["invalid_outputs"] == 0 and summary["checked_outputs"] == 2
    assert constrained["invalid_outputs"] == 0
    assert summary["grammar_compile_ms"] > 0 and len(summary["grammar_compile_runs_ms"]) == 5
