"""The attention-matrix harness: quick grid for every CPU-runnable backend (Triton under
its interpreter), the deliberately broken plugin backend reported as failing, CLI behaviour."""
from __future__ import annotations

import importlib.util
import json

import pytest

from tokenmill.entrypoints import attention_grid as am
from tokenmill.entrypoints.attention_matrix import load_backends
from tokenmill.entrypoints.cli import main as cli_main


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_quick_grid_covers_every_dimension():
    cases = am.build_grid("quick", "cpu")
    assert {c.head_size for c in cases} == set(am.HEAD_SIZES)
    assert {c.gqa_ratio for c in cases} == set(am.GQA_RATIOS)
    assert {c.block_size for c in cases} == set(am.BLOCK_SIZES)
    assert {"float32", "bfloat16"} <= {c.dtype for c in cases}
    assert {c.kv_cache_dtype for c in cases} == {"auto", "fp8"}
    full = am.build_grid("full", "cpu")
    assert len(full) > len(cases) and {c.batch for c in full} == {"mixed", "decode"}


def test_inputs_mix_prefill_and_decode_with_shuffled_mid_block_contexts():
    case = am.build_grid("quick", "cpu")[0]
    inputs = am.make_inputs(case, full=True, seed=0, device="cpu")
    md = inputs.step2[0]
    kinds = [k for _, _, k in inputs.seqs2]
    assert {"decode", "prefill", "chunk"} <= set(kinds) and md.num_decodes == kinds.count("decode")
    assert kinds[:md.num_decodes] == ["decode"] * md.num_decodes
    assert any(s % case.block_size for s in md.seq_lens_cpu)          # ends mid-block
    assert any(s % case.block_size == 0 for s in md.seq_lens_cpu)     # and on a boundary
    for i, s in enumerate(md.seq_lens_cpu):
        table = md.block_tables[i, :(s + case.block_size - 1) // case.block_size].tolist()
        assert all(b - a != 1 for a, b in zip(table, table[1:])), table


def test_quick_grid_every_cpu_backend_passes():
    backends, errors = load_backends()
    assert not errors                       # every built-in backend loads everywhere
    cpu = {n: c for n, c in backends.items() if n in ("reference", "cpu_sdpa", "triton_paged")}
    if importlib.util.find_spec("triton") is None:
        cpu.pop("triton_paged", None)
    results = am.run_matrix(cpu, am.build_grid("quick", "cpu"), device="cpu")
    by = {}
    for r in results:
        by.setdefault(r.backend, []).append(r)
    assert set(by) == set(cpu) - {"reference"}
    for name, rows in by.items():
        assert not [r for r in rows if r.status == "fail"], [(r.case.label, r.max_abs_error, r.where) for r in rows]
        assert any(r.status == "pass" for r in rows), name
    if "triton_paged" in by:   # fp8 KV is unsupported under the interpreter, with its own reason
        unsup = [r for r in by["triton_paged"] if r.status == "unsupported" and not r.case.mla]
        assert unsup and all(r.case.kv_cache_dtype == "fp8" for r in unsup)
        assert all("interpreter" in "; ".join(r.reasons) for r in unsup)


def test_broken_plugin_backend_is_reported_failing(test_plugins):
    cls = load_backends()[0]["broken_lastblock"]
    cases = [c for c in am.build_grid("quick", "cpu") if c.kv_cache_dtype == "auto"][:2]
    results = am.run_matrix({"broken_lastblock": cls}, cases, device="cpu")
    assert results and all(r.status == "fail" for r in results)
    assert all(r.max_abs_error > 0.05 and "seq" in r.where for r in results)


def test_cli_reports_broken_backend_and_exits_nonzero(test_plugins, tmp_path, capsys):
    out = tmp_path / "m.json"
    md = tmp_path / "m.md"
    code = cli_main(["attention-matrix", "--backend", "broken_lastblock", "--json", str(out), "--markdown", str(md)])
    assert code == 1
    text = capsys.readouterr().out
    assert "broken_lastblock" in text and "FAIL" in text
    data = json.loads(out.read_text())
    assert any(r["status"] == "fail" and r["where"] for r in data["results"])
    assert "**FAIL**" in md.read_text()


def test_without_the_test_plugins_only_real_backends_are_listed():
    backends, errors = load_backends()
    assert not errors and not {"broken_lastblock", "testcpu_paged"} & set(backends)
    assert {"reference", "cpu_sdpa", "triton_paged"} <= set(backends)


def test_cli_one_backend_json_and_markdown(tmp_path, capsys):
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    code = cli_main(["attention-matrix", "--backend", "cpu_sdpa", "--json", str(out), "--markdown", str(md)])
    assert code == 0
    data = json.loads(out.read_text())
    assert {r["backend"] for r in data["results"]} == {"cpu_sdpa"}
    # every case but the multi-head latent attention rows, which cpu_sdpa refuses
    assert all(r["status"] == ("unsupported" if r["case"]["mla"] else "pass") for r in data["results"])
    assert data["environment"]["torch"] and data["tolerances"]["bfloat16"]
    doc = md.read_text()
    assert "cpu_sdpa" in doc and "tolerance" in doc and "torch" in doc
    # another run's JSON joins the same document
    code = cli_main(["attention-matrix", "--backend", "cpu_sdpa", "--markdown", str(md), "--include-json", str(out)])
    assert code == 0 and md.read_text().count("## ") == 2


def test_cli_explicit_backend_that_cannot_run_is_an_error(capsys):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed")
    assert cli_main(["attention-matrix", "--backend", "flash_attn"]) == 2
    err = capsys.readouterr().err
    assert "cannot run here" in err and "flash_attn is not importable" in err and "device 'cpu'" in err
    assert cli_main(["attention-matrix", "--backend", "no_such_backend"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_third_party_backend_joins_the_matrix(test_plugins):
    backends, _ = load_backends()
    assert backends["testcpu_paged"].__module__ == "tokenmill_testplatform.attention"
    cases = am.build_grid("quick", "cpu")[:2]
    results = am.run_matrix({"testcpu_paged": backends["testcpu_paged"]}, cases, device="cpu")
    assert results and all(r.status in ("pass", "unsupported") for r in results)
    assert any(r.status == "pass" for r in results)


def test_dispatch_key_decides_support():
    from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
    from tokenmill.attention_backends.reference import ReferenceAttention
    case = am.build_grid("quick", "cpu")[0]
    inputs = am.make_inputs(case, full=False, seed=0, device="cpu")
    # Tensors on the CPU, judged for a platform whose key cpu_sdpa does not list; reference runs anywhere.
    cell = am.check_cell("cpu_sdpa", CpuSdpaAttention, case, inputs, None, "cpu", dispatch_key="myaccel")
    assert cell.status == "unsupported" and "device 'myaccel' not supported" in cell.reasons[0]
    assert not ReferenceAttention.validate(am.attention_config(case, "myaccel"))


def test_bench_attention_command_runs(tmp_path, capsys):
    out = tmp_path / "b.json"
    code = cli_main(["bench", "attention", "--backend", "cpu_sdpa", "--scenario", "single", "--scenario", "mixed",
                     "--iters", "1", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["backend"] for r in rows} == {"reference", "cpu_sdpa"}
    assert all(r["max_abs_diff"] is None or r["max_abs_diff"] < 0.05 for r in rows)
