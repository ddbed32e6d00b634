#!/usr/bin/env python
"""GPU check for the cuda platform: run once on a machine with an NVIDIA GPU and a CUDA torch.

    python ci/gpu_check.py [--model PATH] [--dtypes float32,bfloat16] [--skip-matrix]

Sections (each runs even if an earlier one failed; each is pass / fail / error / skip):
  environment      torch, CUDA, the device
  probe            every discovered platform; cuda must be available
  graph_runner     CudaGraphRunner on the real torch.cuda graph API with a toy paged "model":
                   padded replays must equal the eager forward bit for bit, KV cache untouched
  generate_<dtype> tokenmill.LLM(device="cuda") greedy generation with CUDA graphs on, then with
                   enforce_eager=True: identical tokens (float32 is the strict check; bfloat16 is
                   reported); the memory profiler's block count against mem_get_info
  tensor_parallel_2 -tp 2 over two GPUs (NCCL; CUDA graphs in each rank): tokens equal -tp 1 (skipped
                   with fewer than 2 GPUs)
  attention_matrix `tokenmill attention-matrix --device cuda --grid quick` in a subprocess

Prints a concise report; writes JSON to $OUT/gpu_report.json when OUT is set (and to --json).
Exit status 0 when every strict check passed.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time

# ci/ is the script's directory, so its helper module imports as a top-level one.
from gpu_check_lib import GiB, PROMPTS, REPORT, SkipSection, _Capture, finish, make_tiny_llama, section

# ------------------------------------------------------------------------------------ sections

@section("environment")
def environment() -> dict:
    import torch
    import tokenmill
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "tokenmill": tokenmill.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(device=props.name, capability=f"sm_{props.major}{props.minor}",
                    total_gib=round(total / GiB, 2), free_gib=round(free / GiB, 2),
                    device_count=torch.cuda.device_count())
    import importlib.metadata
    try:
        info["tokenmill_installed"] = importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        info["tokenmill_installed"] = ("NO: platforms are found through entry points; run "
                                       "`pip install --no-deps --no-build-isolation -e .` in the repository")
    for pkg in ("stevedore", "pluggy", "gguf", "triton", "flash_attn", "flashinfer"):
        try:
            mod = __import__(pkg)
            info[pkg] = getattr(mod, "__version__", "present")
        except Exception as exc:
            info[pkg] = f"absent ({type(exc).__name__})"
    return {"info": info}


@section("probe")
def probe() -> dict:
    from tokenmill.plugins import discovery
    reports = {r.name: {"origin": r.origin, "available": r.available, "reason": r.reason,
                        "load_error": r.load_error} for r in discovery.discover_platforms()}
    backends = sorted(discovery.attention_backend_classes())
    errors = discovery.attention_backend_errors()
    cuda = reports.get("cuda", {})
    assert cuda.get("available"), f"cuda platform unavailable: {cuda.get('reason') or cuda.get('load_error')}"
    auto = discovery.resolve_platform("auto").name
    return {"platforms": reports, "auto": auto, "attention_backends": backends, "backend_errors": errors,
            "reason": None if auto == "cuda" else f"auto picked {auto}, not cuda"}


@section("graph_runner")
def graph_runner() -> dict:
    """The real torch.cuda graph API under CudaGraphRunner, with a toy model that reads its context
    through block tables from device tensors only (what a capturable backend must do)."""
    import torch
    from tokenmill.attention_backends.interface import AttentionMetadata
    from tokenmill.platforms.cuda_graphs import CudaGraphProgram

    dev = torch.device("cuda")
    bs, width, nblocks = 4, 4, 64

    def make_forward(kv):
        def forward(ids, pos, meta):
            kv.view(-1).index_copy_(0, meta.slot_mapping, (ids * 1000 + pos).to(kv.dtype))
            p = torch.arange(meta.block_tables.shape[1] * bs, device=dev)
            slots = meta.block_tables.long()[:, p // bs] * bs + p % bs
            vals = kv.view(-1)[slots] * (p < meta.seq_lens.unsqueeze(1).long())
            return torch.stack([vals.sum(1), ids.to(kv.dtype), pos.to(kv.dtype)], dim=1)
        return forward

    class Runner:
        max_num_seqs, block_size, max_blocks_per_seq, device = 16, bs, width, dev
        pad_slot_id, attention_backend = None, None

    kv_g = torch.randint(0, 100, (nblocks * bs,), device=dev).double()
    kv_e = kv_g.clone()
    wrapped = CudaGraphProgram().build(make_forward(kv_g), Runner())
    eager = make_forward(kv_e)
    g = torch.Generator().manual_seed(0)
    checked = []
    for n in (3, 5, 1, 16, 7, 2):
        perm = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()
        seq_lens = [int(x) for x in torch.randint(1, width * bs + 1, (n,), generator=g)]
        tables, slots, used = [], [], 0
        for L in seq_lens:
            nb = -(-L // bs)
            t = perm[used:used + nb]
            used += nb
            tables.append(t + [0] * (width - nb))
            slots.append(t[(L - 1) // bs] * bs + (L - 1) % bs)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, device=dev), num_decodes=n, max_query_len=1,
            max_seq_len=max(seq_lens), block_size=bs, query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=seq_lens)
        ids = torch.arange(100, 100 + n, device=dev)
        pos = torch.tensor([L - 1 for L in seq_lens], device=dev)
        got, want = wrapped(ids, pos, meta), eager(ids, pos, meta)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"batch of {n}: graph replay differs from eager"
        live = sorted({b for t in tables for b in t if b})
        assert torch.equal(kv_g.view(nblocks, bs)[live], kv_e.view(nblocks, bs)[live]), f"batch {n}: KV differs"
        checked.append(n)
    assert wrapped.num_replays == len(checked), f"replays {wrapped.num_replays} != {len(checked)}"
    return {"batches": checked, "sizes": wrapped.sizes, "replays": wrapped.num_replays}


def _build_and_generate(args, dtype: str, enforce_eager: bool, profilers: list) -> dict:
    import torch
    from tokenmill import LLM, SamplingParams

    on_cuda = args.device == "cuda"
    profilers.clear()
    baseline_free, total = torch.cuda.mem_get_info() if on_cuda else (0, 0)
    t0 = time.time()
    llm = LLM(model=args.model, device=args.device, dtype=dtype, enforce_eager=enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
              max_num_seqs=16, seed=0)
    build_s = time.time() - t0
    engine = llm.engine
    runner = engine.runner
    engine.platform.synchronize()
    free_after_alloc = torch.cuda.mem_get_info()[0] if on_cuda else 0
    # Decreasing lengths: the decode batch shrinks 5 -> 1, exercising padded sizes 8, 4, 2, 1.
    lengths = [args.max_tokens - 4 * i for i in range(len(PROMPTS))]
    params = [SamplingParams(max_tokens=max(1, m), temperature=0.0, ignore_eos=True) for m in lengths]
    t0 = time.time()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    engine.platform.synchronize()
    gen_s = time.time() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    fw = runner.forward
    result = {
        "dtype": dtype, "enforce_eager": enforce_eager, "build_s": round(build_s, 1), "generate_s": round(gen_s, 2),
        "attention_backend": getattr(engine, "attention_backend_name", None),
        "forward": type(fw).__name__, "graph_replays": getattr(fw, "num_replays", None),
        "graph_eager_calls": getattr(fw, "num_eager", None),
        "graph_capture_failed": getattr(fw, "capture_failed", None),
        "graph_sizes": (getattr(fw, "sizes", None) or [None])[-1:],
        "num_blocks": runner.num_blocks, "bytes_per_block": runner.bytes_per_block,
        "total_gib": round(total / GiB, 3), "free_before_build_gib": round(baseline_free / GiB, 3),
        "free_after_kv_alloc_gib": round(free_after_alloc / GiB, 3),
        "tokens": tokens, "texts": [o.outputs[0].text for o in outputs],
    }
    budget = profilers[-1].last_budget if profilers and profilers[-1].last_budget else None
    if budget is not None:
        kv_alloc = runner.num_blocks * runner.bytes_per_block
        expected_free = budget.free_now - kv_alloc
        result["memory"] = {
            "logged": budget.summary(), "profiler_blocks": budget.num_blocks,
            "requested_gib": round(budget.requested / GiB, 3), "peak_torch_gib": round(budget.peak_allocated / GiB, 3),
            "non_torch_gib": round(budget.non_torch / GiB, 3), "reserve_gib": round(budget.reserve / GiB, 3),
            "kv_gib": round(kv_alloc / GiB, 3), "free_at_profile_gib": round(budget.free_now / GiB, 3),
            "free_after_kv_alloc_gib": round(free_after_alloc / GiB, 3),
            "free_after_minus_expected_mib": round((free_after_alloc - expected_free) / (1 << 20), 1),
            # What this engine holds now + its activation peak, against total * utilization.
            "engine_used_gib": round((total - free_after_alloc - (total - baseline_free)) / GiB, 3),
        }
    del outputs, fw, runner, engine, llm
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return result


def generation(args, dtype: str, profilers: list) -> dict:
    on = _build_and_generate(args, dtype, False, profilers)
    off = _build_and_generate(args, dtype, True, profilers)
    same = on["tokens"] == off["tokens"]
    first_diff = None
    if not same:
        for i, (a, b) in enumerate(zip(on["tokens"], off["tokens"])):
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if j is not None or len(a) != len(b):
                first_diff = {"prompt": i, "token": j}
                break
    problems = []
    on_cuda = args.device == "cuda"
    if not same:
        problems.append(f"tokens differ with graphs on vs enforce_eager (first at {first_diff})")
    if on_cuda and (on["forward"] != "CudaGraphRunner" or not on["graph_replays"]):
        problems.append(f"CUDA graphs were not used (forward={on['forward']}, replays={on['graph_replays']}, "
                        f"capture_failed={on['graph_capture_failed']}, backend={on['attention_backend']})")
    mem = on.get("memory")
    if mem is None and on_cuda:
        problems.append("memory profiler did not run (num_gpu_blocks_override set, or the engine bypassed it)")
    elif mem is not None:
        if mem["profiler_blocks"] != on["num_blocks"]:
            problems.append(f"runner has {on['num_blocks']} blocks, profiler logged {mem['profiler_blocks']}")
        if mem["kv_gib"] > mem["free_at_profile_gib"] + 1e-3:
            problems.append("KV cache larger than the memory free at profiling")
        if abs(mem["free_after_minus_expected_mib"]) > 1024:
            problems.append(f"free memory after KV allocation is {mem['free_after_minus_expected_mib']} MiB off "
                            f"the profiler's figure")
    for run in (on, off):
        run["tokens_head"] = [t[:8] for t in run.pop("tokens")]
        run["texts"] = [t[:60] for t in run["texts"]]
    result = {"identical_tokens": same, "graphs_on": on, "graphs_off": off,
              "speedup_generate": round(off["generate_s"] / on["generate_s"], 2) if on["generate_s"] else None}
    if problems:
        result["status"] = "fail"
        result["reason"] = "; ".join(problems)
    return result


@section("tensor_parallel_2")
def tensor_parallel_2(args) -> dict:
    """-tp 2 over two GPUs (NCCL, CUDA graphs in each rank's runner): greedy tokens equal -tp 1."""
    import torch
    from tokenmill import LLM, SamplingParams

    if args.device != "cuda" or torch.cuda.device_count() < 2:
        raise SkipSection(f"needs 2 GPUs, found {torch.cuda.device_count() if args.device == 'cuda' else 0}")
    model = make_tiny_llama(args.tiny_dir)        # 4 heads: splits over 2 ranks (the default model's 9 do not)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kw = dict(model=model, device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_model_len=512, seed=0)
    single = LLM(**kw)
    expected = [list(o.outputs[0].token_ids) for o in single.generate(PROMPTS, params, use_tqdm=False)]
    del single
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.time()
    llm = LLM(tensor_parallel_size=2, **kw)
    build_s = time.time() - t0
    got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    readies = llm.engine.executor.readies
    result = {"build_s": round(build_s, 1), "backend": llm.engine.platform.distributed_backend(),
              "rank_forward": [r.forward for r in readies], "rank_param_bytes": [r.parameter_bytes for r in readies],
              "identical_tokens": got == expected, "tokens_head": [t[:8] for t in got]}
    llm.engine.executor.shutdown()
    problems = []
    if got != expected:
        problems.append("tokens at -tp 2 differ from -tp 1")
    if result["backend"] != "nccl":
        problems.append(f"distributed backend {result['backend']!r}, expected nccl")
    if any(f != "CudaGraphRunner" for f in result["rank_forward"]):
        problems.append(f"a rank runs without CUDA graphs: {result['rank_forward']}")
    if problems:
        result.update(status="fail", reason="; ".join(problems))
    return result


@section("attention_matrix", strict=False)
def attention_matrix(args) -> dict:
    if args.skip_matrix:
        raise SkipSection("--skip-matrix")
    out_dir = os.environ.get("OUT") or "."
    path = os.path.join(out_dir, "attention_matrix_cuda.json")
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.attention_matrix", "--device", "cuda", "--grid", "quick",
           "--json", path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.matrix_timeout)
    except subprocess.TimeoutExpired:
        return {"status": "fail", "reason": f"timed out after {args.matrix_timeout}s"}
    result = {"returncode": proc.returncode, "stdout_tail": proc.stdout[-3000:], "stderr_tail": proc.stderr[-1500:],
              "json": path if os.path.exists(path) else None}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
            result["summary"] = data.get("summary", None) if isinstance(data, dict) else None
        except Exception as exc:
            result["summary"] = f"unreadable: {exc}"
    if proc.returncode != 0:
        result["status"] = "fail"
        result["reason"] = f"exit {proc.returncode}"
    return result


# ---------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="model path; 'tiny' = build a small random Llama in --tiny-dir (default: the engine's "
                             "default model if it loads here, else tiny)")
    parser.add_argument("--tiny-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenmill_tiny_llama"))
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu = dry run of the plumbing")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; float32 is the strict one")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--skip-matrix", action="store_true")
    parser.add_argument("--matrix-timeout", type=int, default=240)
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    capture = _Capture(level=logging.INFO)
    tm_logger = logging.getLogger("tokenmill")
    tm_logger.setLevel(logging.INFO)
    tm_logger.addHandler(capture)

    environment()
    if args.device == "cuda":
        probe()
        graph_runner()
    if args.model is None:
        try:
            from tokenmill.core.loaders.model_source import default_model_path
            default_model_path()                     # raises when the default GGUF is not installed
        except Exception as exc:
            print(f"default model unavailable ({exc}); using a tiny random Llama")
            args.model = "tiny"
    if args.model == "tiny":
        args.model = make_tiny_llama(args.tiny_dir)
    REPORT["model"] = args.model or "default"

    profilers: list = []
    try:
        from tokenmill.platforms import cuda as cuda_platform
        original = cuda_platform.CudaPlatform.memory_profiler

        def recording(self):
            profiler = original(self)
            profilers.append(profiler)
            return profiler
        cuda_platform.CudaPlatform.memory_profiler = recording
    except Exception as exc:
        print(f"could not hook the memory profiler: {exc}")
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        section(f"generate_{dtype}", strict=(dtype == "float32"))(generation)(args, dtype, profilers)
    tensor_parallel_2(args)
    attention_matrix(args)

    strict_ok = finish(args)
    return 0 if strict_ok else 1


if __name__ == "__main__":
    sys.exit(main())
