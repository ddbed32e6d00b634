"""`tokenmill attention-matrix`: which attention backends work here, for which configurations,
and how far each is from `reference`.

For every backend (built-in and plugin-contributed) and every configuration of the grid, the
harness builds the backend's own KV cache (its `kv_cache_shape`, the configuration's KV dtype),
runs two steps through the backend's own `forward` -- a prefill of the cached context, then a
batch mixing decodes with prefill chunks (from position 0 and after cached context), contexts
ending mid-block and at block boundaries, block tables shuffled so that no sequence's blocks are
contiguous -- and compares both steps' outputs with `reference` run on the same inputs.

Each cell is `pass` (max abs error), `FAIL` (max error and where), or `unsupported` (the
backend's own reasons from `validate`). Exit status 1 when any supported case fails.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform as _platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

# Built-in backends, used where plugin discovery does not (yet) provide them.
BUILTIN_BACKENDS = {
    "reference": "tokenmill.attention_backends.reference:ReferenceAttention",
    "cpu_sdpa": "tokenmill.attention_backends.cpu_sdpa:CpuSdpaAttention",
    "triton_paged": "tokenmill.attention_backends.triton_paged:TritonPagedAttention",
    "flash_attn": "tokenmill.attention_backends.flash_attn:FlashAttentionBackend",
    "flashinfer": "tokenmill.attention_backends.flashinfer:FlashInferBackend",
    "ipex": "tokenmill.attention_backends.ipex:IpexPagedAttention",
    "pallas": "tokenmill.attention_backends.pallas:PallasPagedAttention",
}

HEAD_SIZES = (64, 80, 128, 256)
GQA_RATIOS = (1, 3, 4, 8)
BLOCK_SIZES = (16, 32)
KV_DTYPES = ("auto", "fp8")

# Max |out - ref| allowed: atol + rtol * |ref|, per compute dtype (fp8 KV: same, both read the same cache).
TOLERANCES = {
    "float32": (1e-4, 1e-4),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}


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


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------
def _load_target(target: Any):
    if isinstance(target, str):
        import importlib
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


def _plugin_entry_point_backends(errors: dict) -> dict:
    """Fallback while discovery does not cover plugins: call `tokenmill_attention_backends` on
    each object in the `tokenmill.plugins` entry-point group."""
    found: dict = {}
    try:
        from importlib.metadata import entry_points
        eps = entry_points(group="tokenmill.plugins")
    except Exception as exc:  # pragma: no cover
        errors["<entry points>"] = repr(exc)
        return found
    for ep in eps:
        try:
            obj = ep.load()
            hook = getattr(obj, "tokenmill_attention_backends", None)
            if hook is None:
                continue
            found.update(_normalize_contribution(hook()))
        except Exception as exc:
            errors[f"plugin {ep.name}"] = f"{type(exc).__name__}: {exc}"
    return found


def _normalize_contribution(contrib) -> dict:
    """A hook result -> {name: class or "module:Class"}; accepts dicts, lists, or nested lists."""
    out: dict = {}
    if contrib is None:
        return out
    if isinstance(contrib, dict):
        for name, target in contrib.items():
            out[name] = target
        return out
    if isinstance(contrib, (str, type)):
        contrib = [contrib]
    for item in contrib:
        if isinstance(item, (list, tuple, dict)) and not isinstance(item, str):
            out.update(_normalize_contribution(item))
            continue
        cls = _load_target(item)
        out[getattr(cls, "name", None) or cls.__name__] = cls
    return out


def load_backends(extra: Optional[dict] = None) -> tuple[dict, dict]:
    """Every attention backend class known here, and the ones that failed to load (name -> error).

    From plugin discovery (built-ins plus plugin-contributed backends, so these join
    automatically); built-ins discovery does not list are loaded directly, and where discovery
    is unavailable `tokenmill.plugins` entry points are asked directly. `extra` (name -> class or
    "module:Class") adds backends programmatically.
    """
    backends: dict = {}
    errors: dict = {}
    discovered_plugins = False
    try:
        from tokenmill.plugins import discovery
        backends.update(discovery.attention_backend_classes())
        if hasattr(discovery, "attention_backend_errors"):
            errors.update(discovery.attention_backend_errors())
            discovered_plugins = hasattr(discovery, "plugin_manager")
    except Exception as exc:   # discovery not ready or broken: fall back to the built-ins
        errors["<discovery>"] = f"{type(exc).__name__}: {exc}"
    targets: dict = {n: t for n, t in BUILTIN_BACKENDS.items() if n not in backends and n not in errors}
    if not discovered_plugins:
        for name, target in _plugin_entry_point_backends(errors).items():
            if name not in backends:
                targets[name] = target
    for name, target in (extra or {}).items():
        targets[name] = target
    for name, target in targets.items():
        try:
            backends[name] = _load_target(target)
            errors.pop(name, None)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return backends, errors


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    head_size: int
    gqa_ratio: int
    block_size: int
    dtype: str
    kv_cache_dtype: str
    num_kv_heads: int
    batch: str = "mixed"       # "mixed": decodes + prefill chunks; "decode": decodes only

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.gqa_ratio

    @property
    def label(self) -> str:
        return (f"D{self.head_size} H{self.num_heads}/{self.num_kv_heads} bs{self.block_size} "
                f"{self.dtype} kv:{self.kv_cache_dtype} {self.batch}")

    def as_dict(self) -> dict:
        return {"head_size": self.head_size, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "gqa_ratio": self.gqa_ratio, "block_size": self.block_size, "dtype": self.dtype,
                "kv_cache_dtype": self.kv_cache_dtype, "batch": self.batch}


def device_dtypes(device: str) -> list[str]:
    import torch
    dts = ["float32", "bfloat16"]
    if device.startswith("cuda") or device in ("xpu",):
        dts.append("float16")
    elif device == "cpu":
        try:   # float16 matmul/softmax kernels exist on this CPU build
            a = torch.ones(2, 2, dtype=torch.float16)
            torch.softmax(a @ a, -1)
            dts.append("float16")
        except Exception:
            pass
    return dts


def build_grid(kind: str, device: str) -> list[Case]:
    dtypes = device_dtypes(device)
    if kind == "full":
        cases = []
        for d, r, bs, dt, kv in itertools.product(HEAD_SIZES, GQA_RATIOS, BLOCK_SIZES, dtypes, KV_DTYPES):
            cases.append(Case(d, r, bs, dt, kv, num_kv_heads=2 if r < 8 else 1))
        cases += [Case(64, 3, 16, dt, "auto", 3, batch="decode") for dt in dtypes]
        return cases
    # quick: every value of every dimension at least once, every dtype x kv dtype, small batches
    quick = [
        (64, 3, 16, "float32", "auto"),
        (80, 1, 32, "bfloat16", "auto"),
        (128, 4, 16, "bfloat16", "auto"),
        (256, 8, 32, "float32", "auto"),
        (64, 1, 32, "float32", "fp8"),
        (128, 3, 16, "bfloat16", "fp8"),
    ]
    if "float16" in dtypes:
        quick += [(64, 4, 16, "float16", "auto"), (80, 8, 16, "float16", "fp8")]
    return [Case(d, r, bs, dt, kv, num_kv_heads=2 if r < 8 else 1) for d, r, bs, dt, kv in quick]


def _batch_spec(case: Case, full: bool, rng: random.Random) -> list[tuple[int, int]]:
    """(query_len, cached_len) per sequence, decodes first."""
    bs = case.block_size
    if case.batch == "decode":
        return [(1, rng.randint(1, 5 * bs)) for _ in range(8)] + [(1, 2 * bs - 1)]
    specs = [
        (1, 3 * bs - 1),             # decode that fills its block exactly (context ends on a block boundary)
        (1, rng.randint(bs + 1, 3 * bs - 3)),   # decode ending mid-block
        (1, 0),                      # decode of a one-token sequence
        (rng.randint(bs + 2, 2 * bs + 5), 0),   # prefill chunk from position 0, ending mid-block
        (rng.randint(3, bs - 1), rng.randint(bs + 1, 2 * bs - 1)),   # chunk after cached context
    ]
    if full:
        specs.insert(2, (1, rng.randint(4 * bs, 6 * bs)))
        specs.append((2 * bs, 2 * bs))  # a chunk starting and ending on block boundaries
    return specs


@dataclass
class CaseInputs:
    step1: Optional[tuple]          # (metadata, q, k, v) prefill of the cached context, or None
    step2: tuple                    # (metadata, q, k, v) the mixed batch
    num_blocks: int
    seqs2: list                     # per sequence of step 2: (query_len, seq_len, kind)


def make_inputs(case: Case, full: bool, seed: int, device: str) -> CaseInputs:
    import torch
    from tokenmill.attention_backends.interface import build_metadata
    rng = random.Random(f"{seed}-{case}")
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    bs = case.block_size
    specs = _batch_spec(case, full, rng)
    seq_lens = [q + c for q, c in specs]
    need = [(s + bs - 1) // bs for s in seq_lens]
    num_blocks = sum(need) + 3
    ids = list(range(1, num_blocks))   # block 0 stays unused: padding entries point at it
    while True:                        # shuffle until no sequence owns two consecutive ids
        rng.shuffle(ids)
        tables, p = [], 0
        for n in need:
            tables.append(ids[p:p + n])
            p += n
        if all(b - a != 1 for t in tables for a, b in zip(t, t[1:])):
            break
    dtype = getattr(torch, case.dtype)
    h, hkv, d = case.num_heads, case.num_kv_heads, case.head_size

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    cached = [(i, c) for i, (_, c) in enumerate(specs) if c > 0]
    step1 = None
    if cached:
        md1 = build_metadata([c for _, c in cached], [c for _, c in cached], [tables[i] for i, _ in cached],
                             bs, device=device, num_decodes=0)
        t1 = sum(c for _, c in cached)
        step1 = (md1, rnd(t1, h, d), rnd(t1, hkv, d), rnd(t1, hkv, d))
    md2 = build_metadata([q for q, _ in specs], seq_lens, tables, bs, device=device)
    t2 = sum(q for q, _ in specs)
    step2 = (md2, rnd(t2, h, d), rnd(t2, hkv, d), rnd(t2, hkv, d))
    kinds = []
    for q, c in specs:
        kinds.append((q, q + c, "decode" if q == 1 else ("prefill" if c == 0 else "chunk")))
    return CaseInputs(step1, step2, num_blocks, kinds)


# ---------------------------------------------------------------------------------------------
# Running one backend on one case
# ---------------------------------------------------------------------------------------------
@dataclass
class CellResult:
    backend: str
    case: Case
    status: str                      # "pass", "fail", "unsupported", "error"
    max_abs_error: Optional[float] = None
    where: str = ""
    reasons: list = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"backend": self.backend, "case": self.case.as_dict(), "label": self.case.label,
                "status": self.status, "max_abs_error": self.max_abs_error, "where": self.where,
                "reasons": self.reasons, "seconds": round(self.seconds, 3)}


def _attention_config(case: Case, device: str):
    import torch
    from tokenmill.attention_backends.interface import AttentionConfig
    return AttentionConfig(head_size=case.head_size, num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                           dtype=getattr(torch, case.dtype), kv_cache_dtype=case.kv_cache_dtype,
                           block_size=case.block_size, device=device)


def run_backend(cls, case: Case, inputs: CaseInputs, device: str):
    """Both steps' outputs of backend `cls` on `inputs` (on a fresh cache of its own layout)."""
    import torch
    from tokenmill.attention_backends.interface import kv_cache_torch_dtype
    dtype = getattr(torch, case.dtype)
    shape = cls.kv_cache_shape(inputs.num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    cache = torch.zeros(shape, dtype=kv_cache_torch_dtype(case.kv_cache_dtype, dtype), device=device)
    be = cls(case.num_heads, case.head_size, case.head_size ** -0.5, case.num_kv_heads,
             kv_cache_dtype=case.kv_cache_dtype)
    outs = []
    for step in (inputs.step1, inputs.step2):
        if step is None:
            outs.append(None)
            continue
        md, q, k, v = step
        out = be.forward(q.clone(), k.clone(), v.clone(), cache, md)
        outs.append(out.detach().float().cpu())
    return outs


def _locate(err, md, seqs_kinds) -> str:
    """Where the largest error sits: sequence, its kind, token position, head."""
    import torch
    flat = int(torch.argmax(err))
    t, rest = divmod(flat, err.shape[1] * err.shape[2])
    head = rest // err.shape[2]
    qsl = md.query_start_loc_cpu
    seq = max(i for i in range(len(qsl) - 1) if qsl[i] <= t)
    q_len, seq_len, kind = seqs_kinds[seq]
    pos = seq_len - q_len + (t - qsl[seq])
    return f"seq {seq} ({kind}, {seq_len} tokens) position {pos} head {head}"


def check_cell(name: str, cls, case: Case, inputs: CaseInputs, ref_outs, device: str) -> CellResult:
    import torch
    reasons = cls.validate(_attention_config(case, device))
    if reasons:
        return CellResult(name, case, "unsupported", reasons=reasons)
    t0 = time.perf_counter()
    try:
        outs = run_backend(cls, case, inputs, device)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        return CellResult(name, case, "fail", where=f"raised {msg}", seconds=time.perf_counter() - t0)
    atol, rtol = TOLERANCES[case.dtype]
    worst: Optional[float] = None
    where = ""
    failed = False
    step_meta = [
        (inputs.step1, [(c, c, "prefill") for c in (inputs.step1[0].seq_lens_cpu if inputs.step1 else [])]),
        (inputs.step2, inputs.seqs2),
    ]
    for idx, (out, ref, (step, kinds)) in enumerate(zip(outs, ref_outs, step_meta)):
        if ref is None:
            continue
        if out is None or out.shape != ref.shape:
            return CellResult(name, case, "fail", where=f"step {idx + 1}: output shape "
                              f"{None if out is None else tuple(out.shape)} != {tuple(ref.shape)}",
                              seconds=time.perf_counter() - t0)
        err = (out - ref).abs()
        err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
        m = float(err.max()) if err.numel() else 0.0
        excess = err - (atol + rtol * ref.abs())
        if worst is None or m > worst:
            worst = m
        if err.numel() and float(excess.max()) > 0 and not failed:
            failed = True
            where = f"step {idx + 1}: " + _locate(excess, step[0], kinds)
    return CellResult(name, case, "fail" if failed else "pass", max_abs_error=worst, where=where,
                      seconds=time.perf_counter() - t0)


def run_matrix(backends: dict, cases: list, device: str = "cpu", full: bool = False, seed: int = 0,
               progress=None) -> list[CellResult]:
    """Every backend in `backends` (name -> class) against `reference` on every case."""
    from tokenmill.attention_backends.reference import ReferenceAttention
    ref_cls = backends.get("reference", ReferenceAttention)
    results = []
    for case in cases:
        inputs = make_inputs(case, full, seed, device)
        ref_outs = None
        for name, cls in backends.items():
            if name == "reference":
                continue
            if ref_outs is None and not cls.validate(_attention_config(case, device)):
                ref_outs = run_backend(ref_cls, case, inputs, device)
            res = check_cell(name, cls, case, inputs, ref_outs, device)
            results.append(res)
            if progress:
                progress(res)
    return results


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def _cell_text(r: dict, notes: dict) -> str:
    if r["status"] == "pass":
        return f"pass {r['max_abs_error']:.1e}"
    if r["status"] == "unsupported":
        key = "; ".join(r["reasons"])
        notes.setdefault(key, len(notes) + 1)
        return f"unsupported [{notes[key]}]"
    err = r["max_abs_error"]
    return f"**FAIL** {err:.2g}" if err is not None else "**FAIL** (raised)"


def environment_info(device: str) -> dict:
    import importlib.metadata as md
    import torch
    info = {"python": _platform.python_version(), "torch": torch.__version__,
            "os": f"{_platform.system()} {_platform.release()}", "machine": _platform.machine(),
            "cpu": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": device, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    pkgs = {}
    for dist in ("tokenmill", "triton", "flash-attn", "flashinfer-python", "flashinfer",
                 "intel-extension-for-pytorch", "torch-xla", "numpy"):
        try:
            pkgs[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    info["packages"] = pkgs
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or "unknown"


def format_text(results: list[dict]) -> str:
    lines = []
    atol_line = ", ".join(f"{dt}: {a:g} + {r:g}*|ref|" for dt, (a, r) in TOLERANCES.items())
    lines.append(f"tolerance (max |out-ref|): {atol_line}")
    width = max([len(r["label"]) for r in results] + [10])
    for r in results:
        if r["status"] == "pass":
            cell = f"pass  max|err| {r['max_abs_error']:.2e}"
        elif r["status"] == "fail":
            err = r["max_abs_error"]
            cell = f"FAIL  max|err| {err:.3g} at {r['where']}" if err is not None else f"FAIL  {r['where']}"
        else:
            cell = "unsupported: " + "; ".join(r["reasons"])
        lines.append(f"{r['backend']:<14} {r['label']:<{width}}  {cell}")
    return "\n".join(lines)


def summarize(results: list[dict]) -> dict:
    summ: dict = {}
    for r in results:
        s = summ.setdefault(r["backend"], {"pass": 0, "fail": 0, "unsupported": 0})
        s[r["status"] if r["status"] in s else "fail"] += 1
    return summ


def markdown_section(run: dict, title: Optional[str] = None) -> str:
    results = run["results"]
    env = run["environment"]
    out = []
    title = title or run.get("title") or f"{env.get('device')} -- {env.get('cpu')}"
    out.append(f"## {title}\n")
    out.append(f"- command: `{run.get('command', '')}`")
    out.append(f"- date: {run.get('date', '')}, grid: {run.get('grid')}, seed: {run.get('seed')}")
    out.append(f"- machine: {env.get('cpu')}, {env.get('cores')} cores ({env.get('torch_threads')} torch threads), "
               f"{env.get('os')} {env.get('machine')}" + (f", GPU {env['gpu']} (CUDA {env.get('cuda')})"
                                                           if env.get("gpu") else ""))
    pk = ", ".join(f"{k} {v}" for k, v in env.get("packages", {}).items())
    out.append(f"- versions: Python {env.get('python')}, torch {env.get('torch')}" + (f", {pk}" if pk else ""))
    if env.get("TRITON_INTERPRET"):
        out.append(f"- TRITON_INTERPRET={env['TRITON_INTERPRET']} (Triton kernels run in the interpreter)")
    tol = run.get("tolerances", TOLERANCES)
    out.append("- tolerance: max |out - ref| <= atol + rtol*|ref|: "
               + ", ".join(f"{dt} atol {a:g} rtol {r:g}" for dt, (a, r) in tol.items()))
    if run.get("load_errors"):
        for k, v in run["load_errors"].items():
            out.append(f"- backend {k} failed to load: {v}")
    out.append("")
    summ = summarize(results)
    out.append("| backend | pass | fail | unsupported |")
    out.append("|---|---|---|---|")
    for b, s in summ.items():
        out.append(f"| {b} | {s['pass']} | {s['fail']} | {s['unsupported']} |")
    out.append("")
    backends = list(summ)
    labels = []
    for r in results:
        if r["label"] not in labels:
            labels.append(r["label"])
    notes: dict = {}
    cells = {(r["backend"], r["label"]): r for r in results}
    out.append("| configuration | " + " | ".join(backends) + " |")
    out.append("|---|" + "---|" * len(backends))
    for lab in labels:
        row = [(_cell_text(cells[(b, lab)], notes) if (b, lab) in cells else "-") for b in backends]
        out.append(f"| {lab} | " + " | ".join(row) + " |")
    out.append("")
    fails = [r for r in results if r["status"] == "fail"]
    if fails:
        out.append("Failures:\n")
        for r in fails:
            err = r["max_abs_error"]
            out.append(f"- {r['backend']} / {r['label']}: max|err| "
                       f"{'-' if err is None else '%.3g' % err}, {r['where']}")
        out.append("")
    if notes:
        out.append("Unsupported, in the backends' own words:\n")
        for text, n in notes.items():
            out.append(f"{n}. {text}")
        out.append("")
    return "\n".join(out)


def write_markdown(path: str, runs: list[dict], notes_text: str = "") -> None:
    parts = ["# Attention-backend matrix\n",
             "Generated by `tokenmill attention-matrix` (entrypoints/attention_matrix.py). Each cell compares "
             "a backend with `reference` on the same inputs: two steps (a prefill of the cached context, "
             "then a batch mixing decodes with prefill chunks from position 0 and after cached context), "
             "contexts ending mid-block and on block boundaries, block tables shuffled so that no sequence's "
             "blocks are contiguous. Each backend builds its own KV cache (`kv_cache_shape`, KV dtype) and "
             "writes it with its own `forward`. `D` head size, `H` query/KV heads, `bs` block size.\n"]
    for run in runs:
        parts.append(markdown_section(run))
    if notes_text:
        parts.append(notes_text.rstrip() + "\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(parts))


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
                reasons = backends[name].validate(_attention_config(case, device))
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
