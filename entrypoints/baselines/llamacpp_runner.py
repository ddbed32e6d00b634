#!/usr/bin/env python3
"""llama.cpp baseline runner (llama-cpp-python's low-level API) for `tokenmill bench throughput --baseline llamacpp`.

Runs under the interpreter of a venv where llama-cpp-python is installed, never tokenmill's: it
imports no tokenmill module (only the standard library, numpy and llama_cpp).

    python llamacpp_runner.py SPEC.json OUT.json

SPEC (written by tokenmill.entrypoints.baselines.external): model (a GGUF file), threads, repeat,
n_batch, extra_bufts (false: load the weights with use_extra_bufts=False, without llama.cpp's AMX
or repacked layouts), and workloads: [{name, prompts, warmup_prompts, output_len}] with token-id prompts.
All requests of a workload run together, each as its own sequence (seq_id) in shared
llama_batch-es (llama-batched-bench style, one KV stream per sequence, llama.cpp's default):
the prompts packed into n_batch-token batches, then one decode step per output token for all
sequences; greedy = argmax of the logits, so EOS cannot end a sequence. W2 (one request) is a
single stream. llama.cpp has no prefix cache here: the KV cache is cleared before every run.
One untimed warm-up on warmup_prompts (same shapes, other token ids), then `repeat` timed runs,
the median reported. OUT is rewritten after every workload.
"""
import json
import multiprocessing
import os
import statistics
import sys
import time

# The script's own directory (tokenmill's baselines package) must not shadow the engine's modules.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import numpy as np  # noqa: E402

ENV_PREFIXES = ("OMP_", "GGML_", "LLAMA_")


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class BatchedContext:
    """One llama.cpp context with room for `n_seq` sequences of `per_seq` tokens each."""

    def __init__(self, llama_cpp, model, n_seq, per_seq, n_batch, threads):
        self.ll = llama_cpp
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_seq * (((per_seq + 255) // 256) * 256)
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = threads
        self.n_ctx = cp.n_ctx
        self.ctx = llama_cpp.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {cp.n_ctx}, n_seq_max {n_seq})")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.n_batch = n_batch
        self.cap = max(n_batch, n_seq)
        self.batch = llama_cpp.llama_batch_init(self.cap, 0, 1)
        b = self.batch
        self.tok = np.ctypeslib.as_array(b.token, shape=(self.cap,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(self.cap,))
        self.n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(self.cap,))
        self.want = np.ctypeslib.as_array(b.logits, shape=(self.cap,))
        self.n_seq_id[:] = 1

    def decode(self, entries):
        """entries: (token, pos, seq_id, want_logits) tuples; returns {seq_id: greedy next token}."""
        b = self.batch
        wanted = []
        for i, (t, p, s, want) in enumerate(entries):
            self.tok[i], self.pos[i], self.want[i] = t, p, 1 if want else 0
            b.seq_id[i][0] = s
            if want:
                wanted.append((i, s))
        b.n_tokens = len(entries)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return {s: int(np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())
                for i, s in wanted}

    def clear(self):
        self.ll.llama_memory_clear(self.mem, True)

    def generate(self, prompts, n_out):
        n = len(prompts)
        first, pending = {}, []
        for s, p in enumerate(prompts):
            for j, t in enumerate(p):
                pending.append((t, j, s, j == len(p) - 1))
                if len(pending) == self.n_batch:
                    first.update(self.decode(pending))
                    pending = []
        if pending:
            first.update(self.decode(pending))
        outs = [[first[s]] for s in range(n)]
        pos = [len(p) for p in prompts]
        for _ in range(n_out - 1):
            nxt = self.decode([(outs[s][-1], pos[s], s, True) for s in range(n)])
            for s in range(n):
                outs[s].append(nxt[s])
                pos[s] += 1
        return outs

    def close(self):
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)


def main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    import llama_cpp
    from llama_cpp import _logger
    _logger.set_verbose(False)                    # llama.cpp's log lines: errors only
    llama_cpp.llama_backend_init()
    threads, n_batch = int(spec["threads"]), int(spec.get("n_batch", 512))
    t0 = time.perf_counter()
    mp = llama_cpp.llama_model_default_params()
    extra_bufts = bool(spec.get("extra_bufts", True))
    if not extra_bufts:                           # no AMX / repacked weight layouts: plain CPU buffers
        mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(spec["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file failed for {spec['model']}")
    load_s = time.perf_counter() - t0
    system_info = llama_cpp.llama_print_system_info()
    if isinstance(system_info, bytes):
        system_info = system_info.decode(errors="replace").strip()
    out = {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "engine_version": llama_cpp.__version__,
           "model": spec["model"], "mode": "batched (low-level API, one KV stream per sequence)",
           "threads": threads, "n_batch": n_batch, "extra_bufts": extra_bufts, "load_s": round(load_s, 2),
           "cpu_count": multiprocessing.cpu_count(),
           "system_info": system_info,
           "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
           "workloads": {}}
    write_json(out_path, out)

    for w in spec["workloads"]:
        n_out = int(w["output_len"])
        prompts = [[int(t) for t in p] for p in w["prompts"]]
        warm = [[int(t) for t in p] for p in w["warmup_prompts"]]
        per_seq = max(len(p) for p in prompts + warm) + n_out
        ctx = BatchedContext(llama_cpp, model, len(prompts), per_seq, n_batch, threads)
        try:
            ctx.clear()
            start = time.perf_counter()
            ctx.generate(warm, n_out)                 # untimed: same shapes, other token ids
            warm_s = time.perf_counter() - start
            runs, outs = [], None
            for _ in range(int(spec["repeat"])):
                ctx.clear()                           # no KV left from the last run
                start = time.perf_counter()
                outs = ctx.generate(prompts, n_out)
                runs.append(time.perf_counter() - start)
        finally:
            ctx.clear()
            ctx.close()
        lengths = [len(o) for o in outs]
        assert all(n == n_out for n in lengths), f"{w['name']}: output lengths {sorted(set(lengths))} != {n_out}"
        n_prompt = sum(len(p) for p in prompts)
        n_gen = sum(lengths)
        seconds = statistics.median(runs)
        out["workloads"][w["name"]] = {
            "requests": len(prompts), "prompt_tokens": n_prompt, "output_tokens": n_gen,
            "seconds": seconds, "runs": runs, "warmup_seconds": warm_s, "n_ctx": ctx.n_ctx,
            "output_tok_s": n_gen / seconds, "total_tok_s": (n_prompt + n_gen) / seconds,
            "cached_prompt_tokens": 0, "first_output_ids": outs[0][:8],
        }
        write_json(out_path, out)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: llamacpp_runner.py SPEC.json OUT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
