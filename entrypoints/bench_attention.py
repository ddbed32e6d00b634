"""`tokenmill bench attention`: time one attention layer per backend on engine-shaped batches.

Scenarios (SmolLM2-135M shapes by default: 9 heads, 3 KV heads, head size 64, bfloat16):
  decode   W1-like: 64 sequences decoding at 256-token contexts (one query token each)
  single   W2-like: one sequence decoding at a 256-token context
  prefill  W4-like: one 512-token chunk of a 2048-token prompt, after 1536 cached tokens
  mixed    48 decodes plus one 256-token prefill chunk from position 0
Block tables are shuffled, so no sequence's blocks are contiguous. Each forward includes the
backend's KV write, as in the engine. Reports ms per layer call and the speedup over `reference`.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

SCENARIOS = ("decode", "single", "prefill", "mixed")


def add_bench_subparser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("attention", help="time attention backends on engine-shaped batches",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", default=None,
                   help="backend name (repeatable; default: every backend that can run here)")
    p.add_argument("--scenario", action="append", choices=SCENARIOS, default=None,
                   help="scenario (repeatable; default: all)")
    p.add_argument("--batch", type=int, default=64, help="decode batch size for 'decode' (default 64)")
    p.add_argument("--context", type=int, default=256, help="context length for decodes (default 256)")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=0,
                   help="timed iterations per repeat (default: about 0.2 s); the best of 5 repeats is reported")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


def _device_platform(device: str):
    """The platform that owns `device` ("cuda:0" -> cuda), for its synchronize(); the device
    APIs stay behind the platform interface."""
    from tokenmill.plugins.discovery import resolve_platform

    return resolve_platform(device.split(":")[0])


def _scenario_batch(name: str, args):
    """(query_lens, seq_lens) for a scenario."""
    if name == "decode":
        return [1] * args.batch, [args.context] * args.batch
    if name == "single":
        return [1], [args.context]
    if name == "prefill":
        return [512], [2048]
    if name == "mixed":
        return [1] * 48 + [256], [args.context] * 48 + [256]
    raise ValueError(name)


def _make_case(name: str, args, torch, iface):
    import random
    q_lens, s_lens = _scenario_batch(name, args)
    bs = args.block_size
    need = [(s + bs - 1) // bs for s in s_lens]
    total = sum(need) + 1
    ids = list(range(1, total))
    random.Random(0).shuffle(ids)
    tables, p = [], 0
    for n in need:
        tables.append(ids[p:p + n])
        p += n
    md = iface.build_metadata(q_lens, s_lens, tables, bs, device=args.device)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    t = sum(q_lens)
    h, hkv, d = args.num_heads, args.num_kv_heads, args.head_size
    q = torch.randn(t, h, d, generator=g).to(dtype).to(args.device)
    k = torch.randn(t, hkv, d, generator=g).to(dtype).to(args.device)
    v = torch.randn(t, hkv, d, generator=g).to(dtype).to(args.device)
    return md, q, k, v, total, s_lens


def _time(fn, iters: int, sync, repeats: int = 5) -> float:
    """Best of `repeats` runs of `iters` calls, ms per call (the best resists a noisy shared machine)."""
    import time
    fn()
    fn()
    sync()
    if iters <= 0:
        t0 = time.perf_counter()
        fn()
        sync()
        one = max(time.perf_counter() - t0, 1e-6)
        iters = int(min(max(0.2 / one, 2), 200))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / iters * 1e3)
    return best


def run(args) -> int:
    import torch

    from tokenmill.attention_backends import interface as iface
    from tokenmill.entrypoints.attention_matrix import load_backends

    if args.threads:
        torch.set_num_threads(args.threads)
    backends, load_errors = load_backends()
    for name, err in load_errors.items():
        print(f"# backend {name!r} failed to load: {err}", file=sys.stderr)
    dtype = getattr(torch, args.dtype)
    cfg = iface.AttentionConfig(head_size=args.head_size, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                                dtype=dtype, block_size=args.block_size, device=args.device)
    names = args.backend or sorted(backends, key=lambda n: (n != "reference", n))
    if "reference" not in names:
        names = ["reference"] + list(names)
    chosen = {}
    for name in names:
        if name not in backends:
            print(f"error: unknown attention backend {name!r}; known: {sorted(backends)}", file=sys.stderr)
            return 2
        reasons = backends[name].validate(cfg)
        if reasons:
            if args.backend and name in args.backend:
                print(f"error: attention backend {name!r} cannot run here: " + "; ".join(reasons), file=sys.stderr)
                return 2
            continue
        chosen[name] = backends[name]
    sync = _device_platform(args.device).synchronize
    scenarios = args.scenario or list(SCENARIOS)
    results = []
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"heads {args.num_heads}/{args.num_kv_heads}, head size {args.head_size}, block size {args.block_size}")
    print(f"{'scenario':<9} {'backend':<14} {'ms/layer':>10} {'vs reference':>13}  max|diff|")
    for sc in scenarios:
        md, q, k, v, nblocks, _ = _make_case(sc, args, torch, iface)
        ref_ms, ref_out = None, None
        for name, cls in chosen.items():
            be = cls(args.num_heads, args.head_size, args.head_size ** -0.5, args.num_kv_heads)
            cache = torch.zeros(cls.kv_cache_shape(nblocks, args.block_size, args.num_kv_heads, args.head_size),
                                dtype=dtype, device=args.device)
            # fill the cached context (positions before this step's tokens) with random values
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
            ms = _time(functools.partial(be.forward, q, k, v, cache, md), args.iters, sync)
            out = be.forward(q, k, v, cache, md).float()
            diff = None
            if name == "reference":
                ref_ms = ms
                ref_out = out
            else:
                # caches differ by layout; compare only where layouts agree (default layout) else skip
                if cls.kv_cache_shape(1, 2, 3, 4) == iface.AttentionBackend.kv_cache_shape(1, 2, 3, 4):
                    diff = (out - ref_out).abs().max().item()
            speedup = ref_ms / ms if ref_ms else None
            results.append({"scenario": sc, "backend": name, "ms_per_layer": ms, "speedup_vs_reference": speedup,
                            "max_abs_diff": diff, "num_seqs": md.num_seqs, "num_tokens": md.num_tokens})
            print(f"{sc:<9} {name:<14} {ms:>10.3f} {('%.1fx' % speedup) if speedup else '-':>13}  "
                  f"{'-' if diff is None else '%.3g' % diff}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
                       "results": results}, f, indent=2)
    return 0
