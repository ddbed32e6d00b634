"""`tokenmill attention-matrix`: which attention backends work here, for which configurations,
and how far each is from `reference`.

For every registered backend (entry-point group `tokenmill.attention_backends`, built-in and
third-party alike) and every configuration of the grid, the harness (attention_grid.py) builds
the backend's own KV cache (its `kv_cache_shape`, the configuration's KV dtype), runs two steps
through the backend's own `forward` -- a prefill of the cached context, then a batch mixing
decodes with prefill chunks (from position 0 and after cached context), contexts ending
mid-block and at block boundaries, block tables shuffled so that no sequence's blocks are
contiguous -- and compares both steps' outputs with `reference` run on the same inputs.

Each cell is `pass` (max abs error), `FAIL` (max error and where), or `unsupported` (the
backend's own reasons from `validate`). Exit status 1 when any supported case fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from .attention_grid import TOLERANCES, CellResult, attention_config, build_grid, run_matrix
from .attention_report import environment_info, format_text, summarize, write_markdown


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("attention-matrix", help="check every attention backend against the reference",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", default=None,
                   help="only this backend (repeatable); an explicitly named backend that cannot run is an error")
    p.add_argument("--grid", choices=["quick", "full"], default="quick", help="quick (default) or full grid")
    p.add_argument("--device", default="cpu", help="device to judge backends on (default cpu)")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--markdown", default=None, help="write the matrix as a Markdown document")
    p.add_argument("--include-json", action="append", default=[],
                   help="add another run's --json output (e.g. from another venv or a GPU) to the Markdown")
    p.add_argument("--notes", default=None, help="append this Markdown file's text to the --markdown output")
    p.add_argument("--title", default=None, help="label for this run in the Markdown (default: the machine)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def load_backends() -> tuple[dict[str, type], dict[str, str]]:
    """Every registered attention backend (name -> class), and those refused (name -> why)."""
    from tokenmill.plugins import discovery
    return discovery.attention_backend_classes(), discovery.attention_backend_errors()


def _command_line() -> str:
    argv = list(sys.argv)
    if "attention-matrix" in argv:
        argv = argv[argv.index("attention-matrix") + 1:]
    else:   # python -m tokenmill.entrypoints.attention_matrix ...
        argv = argv[1:]
    env = " ".join(f"{k}={os.environ[k]}" for k in ("TRITON_INTERPRET", "PJRT_DEVICE") if os.environ.get(k))
    return (env + " " if env else "") + "tokenmill attention-matrix " + " ".join(argv)


def run(args) -> int:
    device = args.device
    if device == "cpu":
        # Triton kernels can only run on CPU tensors through the interpreter; must be set before
        # triton decorates any kernel.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch  # noqa: F401
    backends, load_errors = load_backends()
    if args.backend:
        chosen = {}
        for name in args.backend:
            if name not in backends:
                why = load_errors.get(name)
                print(f"error: attention backend {name!r} " + (f"failed to load: {why}" if why else
                      f"is unknown; known: {sorted(backends)}"), file=sys.stderr)
                return 2
            chosen[name] = backends[name]
        backends = {"reference": backends.get("reference"), **chosen} if "reference" in backends else chosen
    cases = build_grid(args.grid, device)
    if args.backend:   # an explicitly requested backend that can run no case here is an error
        from collections import OrderedDict
        for name in args.backend:
            if name == "reference":
                continue
            all_reasons: "OrderedDict[str, None]" = OrderedDict()
            ok = False
            for case in cases:
                reasons = backends[name].validate(attention_config(case, device))
                if not reasons:
                    ok = True
                    break
                for r in reasons:
                    all_reasons[r] = None
            if not ok:
                print(f"error: attention backend {name!r} cannot run here: " + "; ".join(all_reasons),
                      file=sys.stderr)
                return 2
    for name, err in load_errors.items():
        print(f"warning: backend {name} failed to load: {err}", file=sys.stderr)

    def progress(res: CellResult) -> None:
        if res.status != "unsupported":
            print(f"  {res.backend:<14} {res.case.label}: {res.status}"
                  + (f" ({res.max_abs_error:.2e})" if res.max_abs_error is not None else "")
                  + f" [{res.seconds:.1f}s]", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = run_matrix(backends, cases, device=device, full=args.grid == "full", seed=args.seed, progress=progress)
    dicts = [r.as_dict() for r in results]
    print(format_text(dicts))
    summ = summarize(dicts)
    print("\nsummary: " + ", ".join(f"{b}: {s['pass']} pass / {s['fail']} fail / {s['unsupported']} unsupported"
                                    for b, s in summ.items()) + f"  ({time.perf_counter() - t0:.0f}s)")
    run_record = {
        "title": args.title,
        "command": _command_line(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "grid": args.grid, "seed": args.seed, "environment": environment_info(device),
        "tolerances": TOLERANCES, "load_errors": load_errors, "results": dicts,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run_record, f, indent=1)
    if args.markdown:
        runs = [run_record]
        for path in args.include_json:
            with open(path) as f:
                runs.append(json.load(f))
        notes_text = ""
        if args.notes:
            with open(args.notes) as f:
                notes_text = f.read()
        write_markdown(args.markdown, runs, notes_text)
    return 1 if any(r.status == "fail" for r in results) else 0


def main(argv: Optional[list[str]] = None) -> int:   # python -m tokenmill.entrypoints.attention_matrix
    parser = argparse.ArgumentParser(prog="attention-matrix")
    sub = parser.add_subparsers(dest="command")
    add_subparser(sub)
    args = parser.parse_args(["attention-matrix", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
