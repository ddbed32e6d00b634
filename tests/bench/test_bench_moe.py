"""`tokenmill bench moe`: a small run through the CLI writes its table and JSON."""
from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.cli import main


def test_bench_moe_small_run(tmp_path, capsys):
    from tokenmill.platforms.cpu_moe import NativeMoe
    if NativeMoe.available() is not None:
        pytest.skip(NativeMoe.available())
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--hidden", "64", "--experts", "8", "--top-k", "2", "--inter", "32",
                 "--layers", "1", "--tokens", "1", "--tokens", "5", "--steps", "4", "--format", "int4",
                 "--format", "int8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["read_bandwidth_gb_s"] > 0 and data["shape"]["experts"] == 8
    assert {(r["format"], r["tokens"]) for r in data["results"]} == {("int4", 1), ("int4", 5), ("int8", 1), ("int8", 5)}
    one = next(r for r in data["results"] if r["format"] == "int8" and r["tokens"] == 1)
    assert one["expert_mb"] == pytest.approx(2 * 3 * 64 * 32 * (1 + 4 / 32) / 1e6)      # 2 experts, once each
    assert all(r["ms"] > 0 and r["fraction_of_bandwidth"] > 0 for r in data["results"])
    assert "% of read bandwidth" in capsys.readouterr().out
