"""`tokenmill bench moe`: the cpu platform's mixture-of-experts op against this machine's memory
bandwidth.

A layer shaped like Qwen3-MoE's by default (hidden 1024, 64 experts, top-8, expert FFN 256), several
copies of it (`--layers`, so the experts do not stay in the caches between steps), random routings
(softmax top-k over random logits, renormalized). For each weight format (bf16 pairs; int8 and int4
experts as --quantization int8 / int4 keep them) and token count, the median time of one layer's
op (platforms/cpu_moe.py, one native call), the bytes of the experts that step had to read (each
distinct expert once: its matrices in the format's size, scales included), and those bytes over the
time as a fraction of the measured read bandwidth (a large tensor summed: the rate a weight stream
can reach). The torch op (core/layers/moe.py moe_reference) runs the same steps for comparison: on
bf16 weights for bf16, on the dequantized float32 weights otherwise.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

# Bytes per weight, scales included: bf16; int8 with a float32 scale per row (K >= 256 inputs,
# rounded to 1/32 per weight); 4-bit groups of 32 with fp16 scale and low.
BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0 + 4 / 32, "int4": 0.5 + 4 / 32}


def add_bench_subparser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("moe", help="the native MoE op vs this machine's memory bandwidth",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--inter", type=int, default=256, help="each expert's FFN size (moe_intermediate_size)")
    p.add_argument("--layers", type=int, default=4, help="copies of the layer cycled through (beyond the caches)")
    p.add_argument("--tokens", type=int, action="append", default=None, help="tokens per step (default 1, 4, 32)")
    p.add_argument("--format", action="append", choices=sorted(BYTES_PER_WEIGHT), default=None,
                   help="expert weight format (repeatable; default all)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per case")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


def read_bandwidth(megabytes: int = 256) -> float:
    """GB/s of summing a float32 tensor of `megabytes` (best of 5)."""
    import torch
    a = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - start)
    return a.numel() * 4 / best / 1e9


def _median_seconds(call: Callable[[int], Any], steps: int) -> float:
    for i in range(3):
        call(i)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_case(kernel: Any, reference: Callable[..., Any], layers: list, xs: list, routes: list,
               steps: int) -> tuple[float, float]:
    """Median seconds of the native op and of the torch op over the steps (layer copies cycled)."""
    def native(step: int) -> Any:
        w13, w2, prepared = layers[step % len(layers)][:3]
        return kernel(xs[step], w13, w2, *routes[step], prepared=prepared)

    def torch_op(step: int) -> Any:
        return reference(xs[step], *layers[step % len(layers)][3:], *routes[step])
    return _median_seconds(native, steps), _median_seconds(torch_op, max(3, steps // 4))


def run(args) -> int:
    import torch
    from torch import nn

    from tokenmill.core.layers.moe import moe_reference, select_experts
    from tokenmill.platforms.cpu_moe import NativeMoe
    from tokenmill.quantization.cpu_int4 import Int4Experts
    from tokenmill.quantization.int8 import Int8Experts

    if args.threads:
        torch.set_num_threads(args.threads)
    why = NativeMoe.available()
    if why is not None:
        print(f"the native MoE op cannot run here: {why}")
        return 1
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({torch.get_num_threads()} threads); layer: hidden {h}, {e} experts, "
          f"top-{k}, expert FFN {i}, {args.layers} copies")
    g = torch.Generator().manual_seed(0)
    kernel, results = NativeMoe(), []
    for fmt in args.format or sorted(BYTES_PER_WEIGHT):
        if fmt == "bf16" and NativeMoe.available("bf16") is not None:
            print(f"{fmt}: skipped ({NativeMoe.available('bf16')})")
            continue
        layers = []
        for _ in range(args.layers):
            layer = nn.Module()
            layer.w13 = nn.Parameter(torch.randn(e, 2 * i, h, generator=g) * 0.02, requires_grad=False)
            layer.w2 = nn.Parameter(torch.randn(e, h, i, generator=g) * 0.02, requires_grad=False)
            if fmt == "bf16":
                w13, w2 = layer.w13.to(torch.bfloat16), layer.w2.to(torch.bfloat16)
                layers.append((w13, w2, kernel.prepare(w13, w2, None), w13, w2))
                continue
            method = Int8Experts() if fmt == "int8" else Int4Experts()
            method.process_weights_after_loading(layer)
            dense = method.weights(layer)
            layers.append((layer.w13, layer.w2, kernel.prepare(layer.w13, layer.w2, method.forms(layer)), *dense))
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        for tokens in args.tokens or [1, 4, 32]:
            xs = [torch.randn(tokens, h, generator=g).to(dtype) for _ in range(args.steps)]
            routes = [select_experts(torch.randn(tokens, e, generator=g), k, renormalize=True)
                      for _ in range(args.steps)]
            active = statistics.mean(len(set(r[1].flatten().tolist())) for r in routes)
            weight_bytes = active * 3 * h * i * BYTES_PER_WEIGHT[fmt]
            seconds, torch_seconds = _time_case(kernel, moe_reference, layers, xs, routes, args.steps)
            row = {"format": fmt, "tokens": tokens, "ms": seconds * 1e3, "torch_ms": torch_seconds * 1e3,
                   "expert_mb": weight_bytes / 1e6, "gb_s": weight_bytes / seconds / 1e9,
                   "fraction_of_bandwidth": weight_bytes / seconds / 1e9 / bandwidth}
            results.append(row)
            print(f"{fmt:5s} {tokens:4d} tokens: {row['ms']:7.3f} ms/layer (torch op {row['torch_ms']:7.3f}), "
                  f"experts {row['expert_mb']:6.2f} MB -> {row['gb_s']:5.1f} GB/s = "
                  f"{100 * row['fraction_of_bandwidth']:3.0f}% of read bandwidth")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_bandwidth_gb_s": bandwidth, "threads": torch.get_num_threads(),
                       "shape": {"hidden": h, "experts": e, "top_k": k, "inter": i, "layers": args.layers},
                       "results": results}, f, indent=2)
    return 0
