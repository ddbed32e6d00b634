"""`tokenmill bench throughput`: the offline workloads, optionally beside transformers `generate()`.

Time runs from handing all requests to the engine until the last token, model load excluded,
after one untimed warm-up on other prompts (so the prefix cache starts cold).

With `--structured json|regex|choice` each workload also runs constrained, right after the free run:
every request carries the same StructuredOutputsParams (build_constraint). A constrained sequence
ends when its grammar does, so tok/s of both runs count the tokens actually produced; every
constrained output is checked, and a cold compile of the constraint is timed.

With `--baseline vllm|llamacpp` the other engine runs the very same token-id prompts after
tokenmill's runs, in its own process under its own venv's python (baselines/external.py); the
ratios tokenmill / baseline are printed and written. `--plot` draws the workloads side by side.
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from .baselines.external import DEFAULT_PYTHON, DEFAULT_VLLM_MODEL, ENGINES
from .baselines.plot import plot_results
from .bench_profile import profile_lines, start_profile
from .bench_record import cli_command, run_record
from .engine_args import add_engine_args, engine_kwargs


def add_bench_subparser(bench_subparsers) -> None:
    parser = bench_subparsers.add_parser("throughput", help="offline throughput on the standard workloads")
    parser.add_argument("--workload", default="W1",
                        help="W1, W2, W3, W4, all (= W1-W4), W5 (text, single stream), or several separated by "
                        "commas (W1,W2,W4)")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the median is reported")
    parser.add_argument("--baseline", choices=["none", "hf", "vllm", "llamacpp"], default="none",
                        help="also run Hugging Face transformers generate() on the same model (hf, in this "
                             "process), or vLLM / llama.cpp on the same token-id prompts, each in its own process "
                             "under --baseline-python, after tokenmill's runs; prints tokenmill / baseline ratios. "
                             "A baseline that fails is reported with its stderr and the exit status is 3 "
                             "(tokenmill's numbers are printed and written all the same)")
    parser.add_argument("--baseline-dtype", default=None,
                        help="hf: float32 (default); vllm: bfloat16 (default); llamacpp: unused (the GGUF's format)")
    parser.add_argument("--baseline-python", default=None, metavar="PATH",
                        help="interpreter of the venv with the other engine (default: "
                             f"{DEFAULT_PYTHON['vllm']} for vllm, {DEFAULT_PYTHON['llamacpp']} for llamacpp; "
                             "shared/baselines/setup_*.sh build them)")
    parser.add_argument("--baseline-model", default=None, metavar="PATH",
                        help=f"vllm: an HF directory (default: --model if it is one, else {DEFAULT_VLLM_MODEL}); "
                             "llamacpp: a GGUF file (default: tokenmill's model file; llama.cpp's fastest x86 "
                             "format for SmolLM2 is Q4_0, /tmp/anchors/model-extra/SmolLM2-135M-Instruct.Q4_0.gguf)")
    parser.add_argument("--baseline-threads", type=int, default=2, metavar="N",
                        help="threads for vllm (VLLM_CPU_OMP_THREADS_BIND=0-(N-1)) or llamacpp (n_threads); default 2")
    parser.add_argument("--baseline-no-extra-bufts", dest="baseline_extra_bufts", action="store_false",
                        help="llamacpp: load the weights with use_extra_bufts=False (no AMX or repacked layouts), "
                             "for llama.cpp builds whose AMX kernels die with SIGILL on this machine")
    parser.add_argument("--baseline-runner", default=None, help=argparse.SUPPRESS)   # tests: a stand-in runner
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="draw the workloads side by side (output and total tok/s of every run) into a PNG; "
                             "needs matplotlib (pip install 'tokenmill[bench]'), skipped with a message without it")
    parser.add_argument("--baseline-max-requests", type=int, default=4,
                        help="requests timed for the one-at-a-time transformers baseline (it is slow)")
    parser.add_argument("--without-prefix-caching", action="store_true",
                        help="also run each workload with prefix caching off, in the same process")
    parser.add_argument("--structured", choices=["none", "json", "regex", "choice"], default="none",
                        help="also run each workload with every request grammar-constrained (a 17-field JSON "
                             "schema, a phone-list regex, or one of a few long choices), in the same process; "
                             "reports both runs' tok/s, their ratio, output validity and the cold compile time")
    parser.add_argument("--num-requests", type=int, default=None, metavar="N",
                        help="time only the workload's first N requests (smoke tests; not comparable numbers)")
    parser.add_argument("--profile", action="store_true",
                        help="print the decode program that ran (or why the model ran eagerly), the kernels each op "
                             "kind reached, and each path's share of the forward time")
    parser.add_argument("--json", dest="json_path", default=None, help="write results to this file")
    add_engine_args(parser, model_positional=False)
    parser.set_defaults(func=run)


# --- constraints for --structured --------------------------------------------------------------
def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _str(pattern: str) -> dict[str, Any]:
    # A bounded ASCII pattern, not maxLength (xgrammar ignores it beside a pattern): the longest answer is known.
    return {"type": "string", "pattern": pattern}


def _obj(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# 20 fields (17 top-level, 3 nested), all required: ~280 characters, ~240 tokens as SmolLM2 spells it under the grammar
# (mostly 1-3 characters a token on the workloads' random prompts).
JSON_SCHEMA = _obj({
    "id": _int(1, 9999), "name": _str(r"^[A-Z][a-z]{1,7}$"), "age": _int(18, 99),
    "status": {"enum": ["active", "inactive", "pending"]},
    "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
    "verified": {"type": "boolean"}, "score": _int(0, 100),
    "tags": {"type": "array", "items": _str(r"^[a-z]{2,6}$"), "minItems": 1, "maxItems": 3},
    "address": _obj({"city": _str(r"^[A-Z][a-z]{1,9}$"), "zip": _str(r"^[0-9]{5}$"),
                     "country": {"enum": ["US", "FR", "DE", "JP"]}}),
    "plan": {"enum": ["free", "pro", "team"]}, "lang": {"enum": ["en", "fr", "de", "ja"]},
    "level": _int(1, 5), "active": {"type": "boolean"}, "year": _int(1990, 2030),
    "priority": _int(1, 3), "currency": {"enum": ["USD", "EUR", "JPY"]}, "premium": {"type": "boolean"},
})
# The longest answer is 349 characters; every token is at least one (all ASCII), plus the EOS.
JSON_MAX_TOKENS = 360
CHOICES = [
    "The order was approved and will ship from the nearest warehouse today.",
    "The order was declined because the payment method on file has expired.",
    "The order is on hold until a manager reviews the unusual shipping address.",
    "The order was merged with an earlier one placed from the same account.",
    "The order was cancelled at the customer's request before it was packed.",
]


def phone_list_repeats(output_len: int) -> int:
    """N of the regex: the longest list (10 characters an item, 8 the last, then EOS) fits in output_len."""
    return max(0, (output_len - 9) // 10)


def phone_list_regex(repeats: int) -> str:
    return rf"(\d{{3}}-\d{{4}}, ){{0,{repeats}}}\d{{3}}-\d{{4}}"


@dataclass(frozen=True)
class Constraint:
    kind: str                      # json | regex | choice
    params: Any                    # the StructuredOutputsParams every request carries
    max_tokens: int                # enough for the longest answer the grammar allows
    valid: Callable[[str], bool]   # does an output satisfy it


def _json_valid(text: str) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), JSON_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def build_constraint(kind: str, output_len: int) -> Constraint:
    from tokenmill.core.sampling_params import StructuredOutputsParams as SO
    if kind == "json":
        return Constraint(kind, SO(json=JSON_SCHEMA), JSON_MAX_TOKENS, _json_valid)
    if kind == "regex":
        n = phone_list_repeats(output_len)
        pattern = phone_list_regex(n)
        return Constraint(kind, SO(regex=pattern), 10 * n + 9, lambda t: re.fullmatch(pattern, t) is not None)
    if kind == "choice":
        return Constraint(kind, SO(choice=CHOICES), max(len(c) for c in CHOICES) + 1, lambda t: t in CHOICES)
    raise ValueError(f"structured kind must be json, regex or choice; got {kind!r}")


def cold_compile_ms(structured, constraint: Constraint, runs: int = 5) -> list[float]:
    """Times of `backend.compile(kind, spec)` (no tokenmill cache), each on a new instance of the
    engine's backend: xgrammar's compiler keeps a cache of its own, so a second compile on the same
    instance would take microseconds."""
    kind, spec = constraint.params.kind, constraint.params.spec
    backend_cls = type(structured.backend)
    times = []
    for _ in range(runs):
        backend = backend_cls(structured.tokenizer, structured.vocab_size, structured.stop_token_ids)
        start = time.perf_counter()
        backend.compile(kind, spec)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _time_engine(llm, workload, repeat: int, constraint: Optional[Constraint] = None,
                 extras: bool = False, lengths: Optional[list[int]] = None) -> dict[str, Any]:
    """Median of `repeat` timed runs. With a constraint every request carries it and each output is
    checked; `extras` (always, with a constraint) adds the tokens produced and their mean.
    `lengths`: free generation of exactly these many tokens per request (a constrained run's)."""
    from tokenmill.core.sampling_params import SamplingParams
    from .workloads import build_workload

    so = constraint.params if constraint is not None else None
    max_tokens = workload.output_len if constraint is None else max(workload.output_len, constraint.max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)
    warm = build_workload("W1").prompts[:4]     # also compiles (and caches) the constraint, untimed
    llm.generate([{"prompt_token_ids": [t + 7 for t in p[:64]]} for p in warm],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, structured_outputs=so), use_tqdm=False)
    times, produced, cached, invalid = [], [], 0, 0
    stats0 = llm.engine.stats()
    preempt0 = stats0.num_preemptions
    for _ in range(repeat):
        llm.reset_prefix_cache()
        gc.collect()            # garbage of earlier runs (and baselines) is not this run's cost
        start = time.perf_counter()
        per_request = ([SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
                       if lengths is not None else params)
        if workload.sequential:   # single stream: each request alone
            outs = [llm.generate([{"prompt_token_ids": p}], per_request if lengths is None else per_request[i],
                                 use_tqdm=False)[0] for i, p in enumerate(workload.prompts)]
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], per_request, use_tqdm=False)
        times.append(time.perf_counter() - start)
        produced_lengths = [len(o.outputs[0].token_ids) for o in outs]
        if lengths is not None:
            assert produced_lengths == lengths
        elif constraint is None:
            assert all(n == workload.output_len for n in produced_lengths)
        else:                   # ends with its grammar: fewer tokens than max_tokens, maybe
            invalid += sum(not constraint.valid(o.outputs[0].text) for o in outs)
        produced.append(sum(produced_lengths))
        cached = sum(o.num_cached_tokens for o in outs)
    elapsed = statistics.median(times)
    tokens = statistics.median(produced)
    r = {"seconds": elapsed, "output_tok_s": tokens / elapsed,
         "total_tok_s": (tokens + workload.num_prompt_tokens) / elapsed,
         "cached_prompt_tokens": cached, "preemptions": llm.engine.stats().num_preemptions - preempt0,
         "runs": times}
    stats1 = llm.engine.stats()
    drafts = stats1.spec_num_drafts - stats0.spec_num_drafts
    if drafts:                   # speculative decoding ran: how well its drafts did
        proposed = stats1.spec_num_draft_tokens - stats0.spec_num_draft_tokens
        accepted = stats1.spec_num_accepted_tokens - stats0.spec_num_accepted_tokens
        per_pos = [b - a for a, b in zip(stats0.spec_accepted_per_position, stats1.spec_accepted_per_position)]
        r["speculative"] = {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
                            "acceptance_rate": accepted / proposed if proposed else 0.0,
                            "acceptance_per_position": [n / drafts for n in per_pos]}
    if extras or constraint is not None:
        r.update(output_tokens=tokens, mean_output_len=tokens / len(workload.prompts), max_tokens=max_tokens)
    if constraint is not None:
        r.update(invalid_outputs=invalid, checked_outputs=repeat * len(workload.prompts), lengths=produced_lengths)
    return r


def _structured_run(llm, workload, kind: str, repeat: int, free: dict[str, Any]) -> dict[str, Any]:
    """The constrained run of a workload, its ratio to the free run and the cold compile time; printed."""
    constraint = build_constraint(kind, workload.output_len)
    c = _time_engine(llm, workload, repeat, constraint)
    # Constrained answers end with their grammar, at different lengths: the batch thins out at the
    # end, which costs throughput by itself. Free generation of the very same lengths isolates what
    # the constraint costs (masks, matchers): that ratio is the one to judge it by.
    same = _time_engine(llm, workload, repeat, lengths=c["lengths"])
    compile_runs = cold_compile_ms(llm.engine.structured, constraint)
    result = {"kind": kind, "backend": llm.engine.structured.backend_name,
              "ratio_output_tok_s": c["output_tok_s"] / free["output_tok_s"],
              "free_same_lengths_output_tok_s": same["output_tok_s"],
              "ratio_same_lengths_output_tok_s": c["output_tok_s"] / same["output_tok_s"],
              "grammar_compile_ms": statistics.median(compile_runs), "grammar_compile_runs_ms": compile_runs,
              "invalid_outputs": c["invalid_outputs"], "checked_outputs": c["checked_outputs"]}
    print(f"{workload.name} constrained ({kind}, {result['backend']}): {c['seconds']:.2f}s, "
          f"{c['output_tok_s']:.1f} output tok/s, {c['total_tok_s']:.1f} total tok/s, mean output "
          f"{c['mean_output_len']:.1f} tokens (free {free['mean_output_len']:.1f}, max_tokens {c['max_tokens']}), "
          f"invalid outputs {c['invalid_outputs']}/{c['checked_outputs']}, preemptions {c['preemptions']}")
    print(f"{workload.name} free, the same lengths: {same['seconds']:.2f}s, {same['output_tok_s']:.1f} output tok/s")
    print(f"{workload.name} ratio constrained / free: {result['ratio_output_tok_s']:.2f}x output tok/s, "
          f"{result['ratio_same_lengths_output_tok_s']:.2f}x against free of the same lengths; "
          f"grammar_compile_ms {result['grammar_compile_ms']:.1f} (cold, median of {len(compile_runs)})")
    return {"tokenmill_structured": c, "structured": result}


def _hf_baseline(model_path, workload, dtype_name: str, max_sequential: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.core.loaders.model_source import resolve_model_source

    source = resolve_model_source(model_path)
    dtype = getattr(torch, dtype_name)
    if source.kind == "gguf":
        import os
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path),
                                                     gguf_file=os.path.basename(source.path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    model.eval()
    n_out = workload.output_len
    kwargs = dict(do_sample=False, max_new_tokens=n_out, min_new_tokens=n_out, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([workload.prompts[0][:16]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        sequential = workload.prompts[:max_sequential]
        start = time.perf_counter()
        for p in sequential:
            model.generate(torch.tensor([p]), **kwargs)
        seq_time = time.perf_counter() - start
        seq_tokens = n_out * len(sequential)
        # One static batch, left-padded to the longest prompt.
        width = max(len(p) for p in workload.prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in workload.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts])
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, **kwargs)
        batch_time = time.perf_counter() - start
    return {"dtype": dtype_name,
            "sequential": {"requests": len(sequential), "seconds": seq_time, "output_tok_s": seq_tokens / seq_time},
            "static_batch": {"requests": len(workload.prompts), "seconds": batch_time,
                             "output_tok_s": workload.num_output_tokens / batch_time,
                             "total_tok_s": (workload.num_output_tokens + workload.num_prompt_tokens) / batch_time}}


def run(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM
    from .workloads import WORKLOAD_NAMES, build_workload, workload_names

    names = workload_names(args.workload, WORKLOAD_NAMES + ("W5",))
    if args.num_requests is not None and args.num_requests < 1:
        raise SystemExit("--num-requests must be at least 1")
    if args.baseline_threads < 1:
        raise SystemExit("--baseline-threads must be at least 1")
    structured = None if args.structured == "none" else args.structured
    kwargs = engine_kwargs(args)
    llm = LLM(**kwargs)
    engine = llm.engine
    workloads = [build_workload(n, engine.tokenizer) for n in names]   # W5 is text: the model's tokenizer
    if args.num_requests is not None:
        workloads = [replace(w, prompts=w.prompts[:args.num_requests]) for w in workloads]
    header = (f"tokenmill {engine.model_name} on {engine.platform.name}, dtype "
              f"{engine.dtype_description}, attention {engine.attention_backend_name}, "
              f"prefix caching {'on' if engine.config.cache.enable_prefix_caching else 'off'}")
    from tokenmill.core.models.transformers_impl import TransformersForCausalLM
    if isinstance(engine.bundle.model, TransformersForCausalLM):
        header += ", model implementation transformers"
    from tokenmill.core.loaders.resident import weight_memory
    memory = weight_memory(engine.bundle)
    print(header)
    print(memory["text"])
    results: dict[str, Any] = {"engine": header, **run_record(cli_command(args)), "weight_memory": memory,
                               "workloads": {}}
    if structured:
        results["structured_outputs"] = {"kind": structured, "backend": engine.structured.backend_name}
    runner = start_profile(engine) if args.profile else None
    no_cache_llm = None
    if args.without_prefix_caching and engine.config.cache.enable_prefix_caching:
        no_cache_llm = LLM(**{**kwargs, "enable_prefix_caching": False})
    for w in workloads:
        r = _time_engine(llm, w, args.repeat, extras=structured is not None)
        entry: dict[str, Any] = {"tokenmill": r}
        print(f"{w.name} ({w.description}): {len(w.prompts)} requests, {r['seconds']:.2f}s, "
              f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s, "
              f"cached prompt tokens {r['cached_prompt_tokens']}, preemptions {r['preemptions']}")
        if "speculative" in r:
            sp = r["speculative"]
            print(f"{w.name} speculative decoding: {sp['accepted_tokens']}/{sp['draft_tokens']} draft tokens accepted "
                  f"({sp['acceptance_rate']:.0%}), per position "
                  + ", ".join(f"{x:.0%}" for x in sp["acceptance_per_position"]))
        if structured:
            entry.update(_structured_run(llm, w, structured, args.repeat, r))
        if no_cache_llm is not None:
            nc = _time_engine(no_cache_llm, w, args.repeat)
            entry["tokenmill_no_prefix_caching"] = nc
            print(f"{w.name} without prefix caching: {nc['output_tok_s']:.1f} output tok/s "
                  f"(prefix caching speed-up {r['output_tok_s'] / nc['output_tok_s']:.2f}x)")
        if args.baseline == "hf":
            hf = _hf_baseline(args.model, w, args.baseline_dtype or "float32", args.baseline_max_requests)
            entry["hf"] = hf
            print(f"{w.name} transformers generate() {hf['dtype']}: one at a time "
                  f"{hf['sequential']['output_tok_s']:.1f} tok/s ({hf['sequential']['requests']} requests); "
                  f"static batch {hf['static_batch']['output_tok_s']:.1f} output tok/s")
            print(f"{w.name} ratio tokenmill / transformers: "
                  f"{r['output_tok_s'] / hf['sequential']['output_tok_s']:.2f}x vs one at a time, "
                  f"{r['output_tok_s'] / hf['static_batch']['output_tok_s']:.2f}x vs static batch")
        results["workloads"][w.name] = entry
    if runner is not None:
        results["profile"] = {"fast_path": runner.fast_path_report(), "steps": runner.profile.summary()}
        print("\n".join(profile_lines(results["profile"])))
    code = 0
    if args.baseline in ENGINES:
        prefix_caching = engine.config.cache.enable_prefix_caching
        del llm, engine, no_cache_llm       # the other engine gets the machine to itself
        gc.collect()
        code = _external_baseline(args, workloads, results, prefix_caching)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        skipped = plot_results(results, args.plot)
        print(skipped or f"plot written to {args.plot}")
    return code


def _external_baseline(args, workloads, results: dict[str, Any], prefix_caching: bool) -> int:
    """--baseline vllm|llamacpp: the same prompts in the other engine's own process; 3 if it failed."""
    from .baselines.external import BaselineResult, attach, build_spec, report_lines, resolve_model, run_baseline

    python = args.baseline_python or DEFAULT_PYTHON[args.baseline]
    try:
        model = resolve_model(args.baseline, args.baseline_model, args.model)
    except (ValueError, FileNotFoundError) as exc:
        baseline = BaselineResult(args.baseline, python, args.baseline_model or "", error=str(exc))
    else:
        spec = build_spec(args.baseline, model, workloads, repeat=args.repeat, threads=args.baseline_threads,
                          dtype=args.baseline_dtype, prefix_caching=prefix_caching, seed=args.seed,
                          extra_bufts=args.baseline_extra_bufts)
        print(f"running baseline {args.baseline} ({python}, model {model}, {args.baseline_threads} threads) ...",
              flush=True)
        baseline = run_baseline(args.baseline, python, spec, runner=args.baseline_runner)
    attach(results, baseline)
    for line in report_lines(results, baseline):
        print(line)
    return 0 if baseline.ok else 3
