"""Where a one-sequence decode step's time goes: the native call(s) versus everything else
(Python and dispatch: scheduling, input tensors, sampling, detokenizing, outputs).

    python docs/bench/decode_overhead.py --quantization int4 --kv-cache-dtype bfloat16
    python docs/bench/decode_overhead.py --dtype bfloat16
    python docs/bench/decode_overhead.py --quantization int4 --profile    # + cProfile of the rest

One request (128 prompt tokens, greedy, EOS ignored) decodes 256 tokens; every engine step is
timed, and so is every call into native code that a step makes (the fused decode step and the
LM head kernel). Medians over the decode steps; 'overhead' = step - native.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from tokenmill import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top entries")
    args = parser.parse_args()
    llm = LLM(quantization=args.quantization, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    runner = engine.runner
    step = getattr(runner.forward, "fused_step", None)
    if step is None:
        raise SystemExit("this engine does not run the fused decode step (see its log for why)")
    native: list[float] = []
    lib = step._lib
    real_step, real_matmul = lib.fused_decode_step, lib.fused_matmul

    def timed(fn):
        def call(*a):
            t = time.perf_counter()
            fn(*a)
            native.append(time.perf_counter() - t)
        return call

    lib.fused_decode_step, lib.fused_matmul = timed(real_step), timed(real_matmul)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    engine.add_request("overhead", prompt, params)
    engine.step()                                          # the prefill
    steps, natives = [], []
    profile = cProfile.Profile() if args.profile else None
    while engine.has_unfinished_requests():
        native.clear()
        if profile:
            profile.enable()
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        if profile:
            profile.disable()
        natives.append(sum(native))
    over = [s - n for s, n in zip(steps, natives)]
    def ms(v):
        return statistics.median(v) * 1e3

    print(f"{len(steps)} decode steps: step {ms(steps):.2f} ms (median), native {ms(natives):.2f} ms, "
          f"overhead (Python and dispatch) {ms(over):.3f} ms median, {min(over) * 1e3:.3f} ms min; "
          f"{1 / statistics.median(steps):.1f} tok/s")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
