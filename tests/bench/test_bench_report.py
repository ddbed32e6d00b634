"""docs/benchmarks.md is generated from docs/bench/*.json (`tokenmill bench report`): the tables,
the newest-wins rule, the command lines, and the checked-in page equal to what the results give."""
from __future__ import annotations

import json
from pathlib import Path

from tokenmill.entrypoints import bench_record
from tokenmill.entrypoints.bench_report import render, throughput_rows, used_files
from tokenmill.entrypoints.bench_results import load_results, parse_mode
from tokenmill.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[2]
EPYC = {"cpu": "AMD EPYC 9R14", "isa": ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"], "cores": 2}
XEON = {"cpu": "Intel Xeon Platinum 8488C", "isa": ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                                                    "amx_bf16", "amx_int8"], "cores": 2}
HEADER = ("tokenmill SmolLM2-135M-Instruct.Q4_1 on cpu, dtype float32, quantization int4, KV cache float8_e4m3fn, "
          "attention cpu_sdpa, prefix caching on")


def _entry(output_tok_s: float, total_tok_s: float) -> dict:
    return {"output_tok_s": output_tok_s, "total_tok_s": total_tok_s, "runs": [1.0, 1.1, 0.9]}


def _throughput(path: Path, *, host, date, ours, theirs=None, command=None, engine=HEADER, workloads=("W1",)):
    data: dict = {"engine": engine, "host": host, "date": date, "workloads": {}}
    if command:
        data["command"] = command
    for w in workloads:
        data["workloads"][w] = {"tokenmill": _entry(ours, 2 * ours)}
        if theirs is not None:
            data["workloads"][w]["baseline"] = {"engine": "vllm 0.32.0", **_entry(theirs, 2 * theirs)}
    if theirs is not None:
        data["baseline"] = {"engine": "vllm 0.32.0", "engine_version": "0.32.0", "dtype": "bfloat16",
                            "python": "/tmp/anchors/vllm-venv/bin/python", "model": "/tmp/anchors/smollm2-hf"}
    path.write_text(json.dumps(data))


def _row_lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| W") and needle in line]


def test_newest_result_per_host_workload_mode_and_engine_wins(tmp_path):
    _throughput(tmp_path / "old.json", host=EPYC, date="2026-12-01", ours=500.0, theirs=400.0)
    _throughput(tmp_path / "new.json", host=EPYC, date="2026-12-03T10:00:00+00:00", ours=900.0, theirs=600.0,
                command="tokenmill bench throughput --workload W1 --quantization int4 --kv-cache-dtype fp8_e4m3 "
                        "--baseline vllm --json docs/bench/new.json")
    _throughput(tmp_path / "amx.json", host=XEON, date="2026-11-01", ours=700.0, theirs=1000.0)
    results, others = load_results(tmp_path)
    assert others == []
    text = render(results)

    epyc = "## AMD EPYC, 2 cores: AVX-512 (VNNI + BF16), no AMX"
    xeon = "## Intel Xeon, 2 cores: AVX-512 (VNNI + BF16) with AMX"
    assert epyc in text and xeon in text
    epyc_part = text[text.index(epyc):text.index(xeon)]
    rows = _row_lines(epyc_part, "vLLM")
    assert rows == ["| W1 (output tok/s) | `--quantization int4 --kv-cache-dtype fp8_e4m3` | 900.0 "
                    "| vLLM 0.32.0 bfloat16 | 600.0 | 1.50× | 2026-12-03 | [1] |"]
    assert "old.json" not in text and used_files(results) == {"new.json", "amx.json"}
    # a recorded command is shown as it is, with the file it wrote
    assert ("# [1] docs/bench/new.json (2026-12-03)\ntokenmill bench throughput --workload W1 --quantization int4 "
            "--kv-cache-dtype fp8_e4m3 --baseline vllm --json docs/bench/new.json") in epyc_part
    assert ("| W1 (output tok/s) | `--quantization int4 --kv-cache-dtype fp8_e4m3` | 700.0 | vLLM 0.32.0 bfloat16 "
            "| 1000.0 | 0.70× | 2026-11-01 | [1] |") in text[text.index(xeon):]


def test_a_command_the_file_did_not_record_is_derived_and_marked(tmp_path):
    _throughput(tmp_path / "r.json", host=EPYC, date="2026-12-02", ours=300.0, theirs=200.0,
                workloads=("W1", "W2", "W3", "W4"))
    gguf = HEADER.replace("SmolLM2-135M-Instruct.Q4_1", "smollm2-Q4_0").replace(
        "quantization int4, KV cache float8_e4m3fn", "quantization gguf")
    data = {"engine": gguf, "host": EPYC, "date": "2026-12-02", "provenance": "host added by hand",
            "workloads": {"W2": {"tokenmill": _entry(250.0, 375.0),
                                 "baseline": {"engine": "llama.cpp", **_entry(200.0, 300.0)}}},
            "baseline": {"engine": "llama.cpp (llama-cpp-python 0.3.36)", "engine_version": "0.3.36",
                         "python": "/tmp/llamacpp-noamx/bin/python", "model": "/tmp/gguf/smollm2-Q4_0.gguf",
                         "extra_bufts": False}}
    (tmp_path / "gguf.json").write_text(json.dumps(data))
    (tmp_path / "gguf.png").write_bytes(b"")
    (tmp_path / "notes.json").write_text(json.dumps({"something": "else"}))
    results, others = load_results(tmp_path)
    assert others == ["notes.json"]
    by_file = {r.file: r for r in results}
    assert by_file["r.json"].derived and by_file["r.json"].command == (
        "tokenmill bench throughput --workload all --repeat 3 --quantization int4 --kv-cache-dtype fp8_e4m3 "
        "--baseline vllm --json docs/bench/r.json")
    assert by_file["gguf.json"].command == (
        "tokenmill bench throughput --model /tmp/gguf/smollm2-Q4_0.gguf --workload W2 --repeat 3 --quantization gguf "
        "--baseline llamacpp --baseline-python /tmp/llamacpp-noamx/bin/python --baseline-no-extra-bufts "
        "--json docs/bench/gguf.json --plot docs/bench/gguf.png")
    text = render(results, others)
    assert "(2026-12-02, command derived from the file's fields, note 1, plot docs/bench/gguf.png)" in text
    assert "Note 1: host added by hand." in text
    assert "`notes.json`" in text
    assert _row_lines(text, "llama.cpp") == [
        "| W2 (output tok/s) | `--quantization gguf` on the Q4_0 file | 250.0 | llama.cpp 0.3.36 (Q4_0 file, without "
        "its repacked weight buffers) | 200.0 | 1.25× | 2026-12-02 | [2] |"]
    assert _row_lines(text, "| W4 (total tok/s)") == [      # W4 is shown in total tok/s
        "| W4 (total tok/s) | `--quantization int4 --kv-cache-dtype fp8_e4m3` | 600.0 | vLLM 0.32.0 bfloat16 | 400.0 "
        "| 1.50× | 2026-12-02 | [1] |"]


def test_tokenmills_own_newer_figure_is_shown_beside_the_last_comparison(tmp_path):
    _throughput(tmp_path / "a.json", host=EPYC, date="2026-12-01", ours=500.0, theirs=400.0)
    _throughput(tmp_path / "b.json", host=EPYC, date="2026-12-02", ours=800.0)
    rows = throughput_rows(load_results(tmp_path)[0])
    assert [(r.value, r.engine, r.source.file) for r in rows] == [(800.0, None, "b.json"),
                                                                  (500.0, "vLLM 0.32.0 bfloat16", "a.json")]
    # once the comparison is the newest, tokenmill's figure is not repeated on a row of its own
    _throughput(tmp_path / "c.json", host=EPYC, date="2026-12-03", ours=900.0, theirs=450.0)
    rows = throughput_rows(load_results(tmp_path)[0])
    assert [(r.value, r.engine) for r in rows] == [(900.0, "vLLM 0.32.0 bfloat16")]


def test_modes_and_host_classes():
    mode = parse_mode("tokenmill smollm2-Q8_0 on cpu, dtype float32, quantization gguf, attention cpu_sdpa, "
                      "prefix caching off")
    assert mode.label == "`--quantization gguf --no-enable-prefix-caching` on the Q8_0 file"
    assert parse_mode(HEADER.replace("quantization int4, KV cache float8_e4m3fn", "").replace(", ,", ",")).flags \
        == ["--dtype", "float32"]
    assert bench_record.host_class(XEON) == "Intel Xeon, 2 cores: AVX-512 (VNNI + BF16) with AMX"
    assert bench_record.host_class({"cpu": "AMD Ryzen 7", "isa": ["avx2"], "cores": 16}) == \
        "AMD Ryzen, 16 cores: AVX2, no AVX-512"
    assert bench_record.host_class({"gpu": "NVIDIA H200", "gpus": 1, "cpu": "x"}) == "NVIDIA H200"
    assert bench_record.host_class(None) == "host not recorded"


def test_results_record_their_command_host_and_date(monkeypatch):
    record = bench_record.run_record("tokenmill bench gemm --json x.json")
    assert record["command"] == "tokenmill bench gemm --json x.json"
    assert record["host"]["cpu"] and isinstance(record["host"]["isa"], list) and record["host"]["cores"] >= 1
    assert record["date"][:2] == "20"
    seen: dict[str, str] = {}
    from tokenmill.entrypoints import bench_report
    monkeypatch.setattr(bench_report, "run", lambda args: seen.update(command=bench_record.cli_command(args)) or 0)
    assert main(["bench", "report", "--out", "some file.md"]) == 0
    assert seen["command"] == "tokenmill bench report --out 'some file.md'"


def test_report_check_exits_1_when_the_page_differs(tmp_path, capsys):
    _throughput(tmp_path / "r.json", host=EPYC, date="2026-12-02", ours=300.0)
    out = tmp_path / "page.md"
    assert main(["bench", "report", "--results", str(tmp_path), "--out", str(out)]) == 0
    assert main(["bench", "report", "--results", str(tmp_path), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert main(["bench", "report", "--results", str(tmp_path), "--out", str(out), "--check"]) == 1
    assert "edited by hand" in capsys.readouterr().out


def test_checked_in_page_is_what_the_results_generate():
    results, others = load_results(ROOT / "docs" / "bench")
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == render(results, others), "docs/benchmarks.md is stale: run `make bench-report`"
