"""`tokenmill bench serve` against a real `tokenmill serve` (small run), plus its prompt and summary logic."""
from __future__ import annotations

import json
import os

import pytest

from tokenmill.entrypoints.bench_serve import RequestResult, build_prompts, summarize
from tokenmill.entrypoints.cli import build_parser, main

SERVER_ARGS = ["--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "8", "--num-threads", "1",
               "--kv-cache-memory", str(32 * 1024 * 1024), "--api-key", "bench-key", "--disable-access-log"]


def test_bench_serve_end_to_end(server, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", server.url + "/v1", "--api-key", "bench-key",
                 "--random-input-len", "24", "--random-output-len", "5", "--num-prompts", "6",
                 "--max-concurrency", "3", "--request-rate", "20", "--result-json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for label in ("Request throughput", "Output token throughput", "Mean TTFT", "Median TPOT", "P99 ITL",
                  "Mean E2EL"):
        assert label in printed
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 6 * 24
    assert result["total_output_tokens"] == 6 * 5
    assert 0 < result["ttft_ms"]["mean"] <= result["e2el_ms"]["mean"]
    assert result["itl_ms"]["median"] > 0 and result["output_throughput"] > 0


def test_bench_serve_reports_failures(server, capsys):
    code = main(["bench", "serve", "--base-url", server.url, "--api-key", "wrong-key", "--model", "x",
                 "--warmup", "0", "--random-input-len", "8", "--random-output-len", "2", "--num-prompts", "2"])
    assert code == 1
    assert "HTTP 401" in capsys.readouterr().out


def test_workload_prompts():
    args = build_parser().parse_args(["bench", "serve", "--workload", "W3"])
    prompts, output_len, _ = build_prompts(args)
    assert len(prompts) == 64 and output_len == 32
    assert all(len(p) == 544 and p[:512] == prompts[0][:512] for p in prompts)
    args = build_parser().parse_args(["bench", "serve", "--random-input-len", "7", "--num-prompts", "3"])
    prompts, _, _ = build_prompts(args)
    assert [len(p) for p in prompts] == [7, 7, 7] and all(1000 <= t < 40000 for p in prompts for t in p)


def test_summary_math():
    rs = [RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
          RequestResult(ok=True, prompt_len=10, output_tokens=3, ttft=0.3, latency=0.5, itl=[0.1] * 2),
          RequestResult(ok=False, error="boom")]
    s = summarize(rs, 2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(14.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["itl_ms"]["median"] == pytest.approx(100.0)


def test_bench_serve_plot(tmp_path, capsys):
    """--plot against the fake engine: a PNG with the TTFT/ITL distributions and throughput over time."""
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
    from tokenmill.entrypoints.openai.testing import ServerProcess
    png = tmp_path / "bench.png"
    with ServerProcess(["--max-model-len", "512", "--disable-access-log"], env={"TOKENMILL_FAKE_STEP_S": "0.005"},
                       fake_engine=True) as fake:
        code = main(["bench", "serve", "--base-url", fake.url, "--random-input-len", "16", "--random-output-len",
                     "12", "--num-prompts", "24", "--max-concurrency", "6", "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert f"plot: {png}" in printed
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1500, 450) and len(data) > 30_000


def test_bench_serve_plot_without_matplotlib(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", "x.png"])
    assert code == 2 and "tokenmill[plot]" in capsys.readouterr().err


def test_engine_process_dies_with_a_killed_server(server):
    """Last in this module: SIGKILL the server (no clean-up runs); its engine process must not linger."""
    import signal
    import time
    children = server.child_pids()
    assert children
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.2)
    assert not any(alive(pid) for pid in children)
