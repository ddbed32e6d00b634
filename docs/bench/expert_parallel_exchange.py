"""Time one mixture-of-experts layer (core/layers/moe.py FusedMoE) over 2 gloo ranks on this CPU: the
tensor-parallel split (every expert's intermediate size halved, one all-reduce) against expert
parallelism's two exchanges (core/layers/moe_parallel.py: all_reduce, all_to_all), and one rank alone,
at decode- and prefill-sized token counts. Each rank runs one thread; the numbers are the median
milliseconds of a forward (router, experts, collectives) on rank 0.

    python docs/bench/expert_parallel_exchange.py                       # Qwen3-MoE-shaped: 48 experts of 384, top-8
    python docs/bench/expert_parallel_exchange.py --experts 8 --expert-size 1024 --top-k 2     # Mixtral-shaped
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from tokenmill.core import distributed
from tokenmill.core.layers.moe import FusedMoE


def _layer(args: argparse.Namespace) -> FusedMoE:
    g = torch.Generator().manual_seed(0)
    e, i, h = args.experts, args.expert_size, args.hidden
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05
    layer = FusedMoE(h, i, e, args.top_k, torch.float32, renormalize=True)
    layer.gate.weight.data.copy_(torch.randn(e, h, generator=g))
    layer.weight_loader(layer.w13, w13)
    layer.weight_loader(layer.w2, w2)
    return layer


def _time(layer: FusedMoE, tokens: int, repeat: int, sync) -> float:
    x = torch.randn(tokens, layer.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
    times = []
    with torch.inference_mode():
        for _ in range(repeat + 2):
            sync()
            start = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def _rank(rank: int, port: int, mode: str, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    distributed.init_parallel_state(rank, 2, 1, "gloo", f"tcp://127.0.0.1:{port}",
                                    expert_parallel=mode != "tp", expert_exchange=mode)
    import torch.distributed as dist
    layer = _layer(args)
    result = {t: _time(layer, t, args.repeat, dist.barrier) for t in args.tokens}
    if rank == 0:
        queue.put(result)
    distributed.destroy_parallel_state()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--expert-size", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {"1 rank": {t: _time(_layer(args), t, args.repeat, lambda: None) for t in args.tokens}}
    ctx = multiprocessing.get_context("fork")
    for mode, label in (("tp", "tp 2 (experts' intermediate split)"), ("all_reduce", "ep 2, all_reduce"),
                        ("all_to_all", "ep 2, all_to_all")):
        queue = ctx.Queue()
        port = distributed.free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, mode, args, queue)) for r in range(2)]
        for p in procs:
            p.start()
        rows[label] = queue.get(timeout=600)
        for p in procs:
            p.join()
    print(f"{args.experts} experts of {args.expert_size} over hidden {args.hidden}, top-{args.top_k}, float32; "
          f"ms per forward (median of {args.repeat}), rank 0")
    print(f"{'':38s}" + "".join(f"{t:>10d} tok" for t in args.tokens))
    for label, result in rows.items():
        print(f"{label:38s}" + "".join(f"{result[t]:14.2f}" for t in args.tokens))


if __name__ == "__main__":
    main()
