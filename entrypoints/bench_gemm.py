"""`tokenmill bench gemm`: the cpu platform's matmul paths against this CPU's measured int8 peak.

For the default model's matmul shapes (SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, LM head 49152x576) and a few row counts, times (best of 5 repeats):
  int_mm        torch._int_mm, int8 x int8 -> int32 (oneDNN), operands ready
  int8_per_tok  quantization="int4"'s path for 8+ rows: quantize the rows (16 outlier channels
                in float32), int_mm, dequantize (quantization/cpu_int4.py)
  fused_q4      the fused decode step's 4-bit x int8 matmul (platforms/cpu_decode_kernels.py)
  q8_head       the LM head kernel under quantization="int4" (int8 groups x int8)
  f32, bf16     F.linear in float32 and bfloat16
and prints GOP/s (a multiply-add counts 2) and the fraction of the peak: register-only
AVX512-VNNI dot products over the same threads (`vnni_peak_gops`).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def add_bench_subparser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("gemm", help="matmul paths vs this CPU's int8 (VNNI) peak",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, action="append", default=None,
                   help="row counts (tokens) to time (repeatable; default 1, 8, 64, 512)")
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), default=None,
                   help="matmul shape (repeatable; default all)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


def _best_seconds(fn, min_time: float = 0.1) -> float:
    fn()
    iters = 1
    while True:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        if time.perf_counter() - start >= min_time / 5 or iters >= 1 << 14:
            break
        iters *= 2
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def _candidates(n: int, k: int, rows: int, name: str):
    import torch
    import torch.nn.functional as F

    from tokenmill.platforms import cpu_decode_kernels as native
    from tokenmill.platforms import cpu_kernels
    from tokenmill.quantization.cpu_int4 import CpuInt4Quantization, int8_matmul_per_token, quantize_int8_per_channel

    torch.manual_seed(0)
    weight = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k)
    out = {"f32": lambda: F.linear(x, weight)}
    wb, xb = weight.bfloat16(), x.bfloat16()
    out["bf16"] = lambda: F.linear(xb, wb)
    int8_weight, channel_scale = quantize_int8_per_channel(weight)
    xq = torch.randint(-127, 127, (rows, k), dtype=torch.int8)
    if rows > 16:                                   # torch._int_mm wants more than 16 rows
        out["int_mm"] = lambda: torch._int_mm(xq, int8_weight)
        kernels = {}
        if cpu_kernels.available() is None:
            kernels = {"quantize_rows_int8": cpu_kernels.quantize_rows_int8,
                       "dequantize_int32": cpu_kernels.dequantize_int32}
        by_channel = weight.t().contiguous().t()
        out["int8_per_tok"] = lambda: int8_matmul_per_token(x, int8_weight, channel_scale, by_channel, 16, None,
                                                            kernels)
    if native.NativeHeadKernel.available() is None:
        lib = native.LIBRARY.require()
        y = torch.empty(rows, n)
        if name == "lm_head":            # the kernel itself, at every row count (the layer caps it)
            linear, tensors = native.NativeHeadKernel("q8").prepare(weight)
            out["q8_head"] = lambda: (lib.fused_matmul(ctypes.byref(linear), x.data_ptr(), rows, y.data_ptr()),
                                      tensors)
        else:
            q, scale, low = CpuInt4Quantization.quantize(weight, bf16_params=True)
            packed = native.pack_q4(q.to(torch.uint8), scale, low)
            linear = native.NativeLinear(kind=native.Q4, n=n, k=k, weight=packed[0].data_ptr(),
                                   scales=packed[1].data_ptr(), lows=packed[2].data_ptr(), bias=None)
            out["fused_q4"] = lambda: (lib.fused_matmul(ctypes.byref(linear), x.data_ptr(), rows, y.data_ptr()),
                                       packed)
    return out


def run(args) -> int:
    import torch

    from tokenmill.platforms import cpu_decode_kernels as native

    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = args.rows or [1, 8, 64, 512]
    shapes = args.shape or list(SHAPES)
    peak = max(native.vnni_peak_gops() for _ in range(3)) if native.NativeHeadKernel.available() is None else None
    print(f"threads {torch.get_num_threads()}; measured AVX512-VNNI int8 peak: "
          + (f"{peak:.0f} GOP/s" if peak else "unavailable (no VNNI kernels here)"))
    from .bench_record import cli_command, run_record
    results = {**run_record(cli_command(args)), "threads": torch.get_num_threads(), "vnni_peak_gops": peak,
               "rows": []}
    print(f"{'shape':>8} {'rows':>5} " + " ".join(f"{c:>20}" for c in
                                                 ("f32", "bf16", "int_mm", "int8_per_tok", "fused_q4/q8_head")))
    for name in shapes:
        n, k = SHAPES[name]
        for rows in rows_list:
            cells, entry = [], {"shape": name, "n": n, "k": k, "rows": rows}
            for path, fn in _candidates(n, k, rows, name).items():
                gops = 2 * rows * n * k / _best_seconds(fn) / 1e9
                entry[path] = round(gops, 1)
            for path in ("f32", "bf16", "int_mm", "int8_per_tok", "fused_q4" if name != "lm_head" else "q8_head"):
                if path in entry:
                    frac = f" ({entry[path] / peak:4.0%})" if peak and path not in ("f32", "bf16") else ""
                    cells.append(f"{entry[path]:8.1f} GOP/s{frac}")
                else:
                    cells.append("-")
            results["rows"].append(entry)
            print(f"{name:>8} {rows:5d} " + " ".join(f"{c:>20}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
