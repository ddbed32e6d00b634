"""The attention matrix's harness: the grid of configurations, the inputs of each case, and one
backend run against `reference` on them (used by `tokenmill attention-matrix`, `tokenmill
check-plugin` and the tests).

Each case runs two steps through the backend's own `forward` on its own KV cache (its
`kv_cache_shape`, the case's KV dtype): a prefill of the cached context, then a batch mixing
decodes with prefill chunks (from position 0 and after cached context), contexts ending
mid-block and at block boundaries, block tables shuffled so that no sequence's blocks are
contiguous.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

HEAD_SIZES = (64, 80, 128, 256)
GQA_RATIOS = (1, 3, 4, 8)
BLOCK_SIZES = (16, 32)
KV_DTYPES = ("auto", "fp8")
# The multi-head latent attention rows (DeepSeek's shape scaled down): a cached row of latent L and
# rope key R (the case's head_size, L + R), heads with N nope and V value dims.
MLA_DIMS = {"latent": 224, "rope": 32, "nope": 64, "value": 64}

# Max |out - ref| allowed: atol + rtol * |ref|, per compute dtype (fp8 KV: both read the same cache;
# over float32 activations bf16's, see tolerance()).
TOLERANCES = {
    "float32": (1e-4, 1e-4),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}



def tolerance(case: "Case") -> tuple[float, float]:
    """(atol, rtol) of a cell. An fp8 cache over float32 activations is held to bf16's: its keys
    carry 3 (e4m3) or 2 (e5m2) mantissa bits, so a backend may read them, and round the query,
    as bf16 (cpu_sdpa's prompt kernels do, as they do over a bf16 cache)."""
    if case.kv_cache_dtype.startswith("fp8") and case.dtype == "float32":
        return TOLERANCES["bfloat16"]
    return TOLERANCES[case.dtype]


@dataclass(frozen=True)
class Case:
    head_size: int
    gqa_ratio: int
    block_size: int
    dtype: str
    kv_cache_dtype: str
    num_kv_heads: int
    batch: str = "mixed"       # "mixed": decodes + prefill chunks; "decode": decodes only
    sliding_window: Optional[int] = None     # Mistral's, Gemma's sliding layers
    logits_soft_cap: Optional[float] = None  # Gemma 2's
    mla: bool = False                        # DeepSeek's latent cache (MLA_DIMS), through forward_mla
    attention_sinks: bool = False            # GPT-OSS's per-head sink logits (case_sinks)

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.gqa_ratio

    @property
    def label(self) -> str:
        return ("MLA " if self.mla else "") + (
                f"D{self.head_size} H{self.num_heads}/{self.num_kv_heads} bs{self.block_size} "
                f"{self.dtype} kv:{self.kv_cache_dtype} {self.batch}"
                + (f" window{self.sliding_window}" if self.sliding_window else "")
                + (f" softcap{self.logits_soft_cap:g}" if self.logits_soft_cap else "")
                + (" sinks" if self.attention_sinks else ""))

    def as_dict(self) -> dict:
        return {"head_size": self.head_size, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "gqa_ratio": self.gqa_ratio, "block_size": self.block_size, "dtype": self.dtype,
                "kv_cache_dtype": self.kv_cache_dtype, "batch": self.batch, "sliding_window": self.sliding_window,
                "logits_soft_cap": self.logits_soft_cap, "mla": self.mla, "attention_sinks": self.attention_sinks}


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
        return cases + _feature_cases(dtypes)
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
    return ([Case(d, r, bs, dt, kv, num_kv_heads=2 if r < 8 else 1) for d, r, bs, dt, kv in quick]
            + _feature_cases(dtypes))


def _feature_cases(dtypes: list[str]) -> list[Case]:
    """The capabilities families need beyond plain causal attention: a sliding window shorter than
    the contexts, logits soft-capping (scores = cap * tanh(scores / cap), scores of unit scale),
    multi-head latent attention."""
    mla = MLA_DIMS["latent"] + MLA_DIMS["rope"]
    return [Case(mla, 8, 16, "float32", "auto", 1, mla=True), Case(mla, 8, 32, "bfloat16", "auto", 1, mla=True),
            Case(mla, 8, 16, "float32", "auto", 1, batch="decode", mla=True),
            Case(64, 3, 16, "float32", "auto", 2, sliding_window=20),
            Case(128, 4, 16, "bfloat16", "auto", 2, sliding_window=20),
            Case(64, 3, 16, "float32", "auto", 2, logits_soft_cap=2.0),
            Case(128, 4, 32, "bfloat16", "auto", 2, logits_soft_cap=2.0, sliding_window=24),
            Case(64, 4, 16, "float32", "auto", 2, attention_sinks=True),
            Case(64, 4, 16, "bfloat16", "auto", 2, sliding_window=20, attention_sinks=True)]


def case_sinks(case: Case):
    """A sinks case's logits, one per query head, of the scores' size (so they take a real share of
    each softmax, more for some heads than others); None for other cases."""
    if not case.attention_sinks:
        return None
    import torch
    return torch.linspace(-2.0, 2.0, case.num_heads)


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
    kv_b: Any = None                # an MLA case's kv_b_proj weight [H, N + V, L]; its steps are
                                    # (metadata, q_nope, q_pe, latent, k_pe)


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

    def qkv(t: int) -> tuple:
        if not case.mla:
            return rnd(t, h, d), rnd(t, hkv, d), rnd(t, hkv, d)
        n, r, rank = MLA_DIMS["nope"], MLA_DIMS["rope"], MLA_DIMS["latent"]
        return rnd(t, h, n), rnd(t, h, r), rnd(t, rank), rnd(t, r)

    cached = [(i, c) for i, (_, c) in enumerate(specs) if c > 0]
    step1 = None
    if cached:
        md1 = build_metadata([c for _, c in cached], [c for _, c in cached], [tables[i] for i, _ in cached],
                             bs, device=device, num_decodes=0)
        t1 = sum(c for _, c in cached)
        step1 = (md1, *qkv(t1))
    md2 = build_metadata([q for q, _ in specs], seq_lens, tables, bs, device=device)
    t2 = sum(q for q, _ in specs)
    step2 = (md2, *qkv(t2))
    kinds = []
    for q, c in specs:
        kinds.append((q, q + c, "decode" if q == 1 else ("prefill" if c == 0 else "chunk")))
    kv_b = None
    if case.mla:           # scaled so expanded keys and values are of unit size
        kv_b = rnd(h, MLA_DIMS["nope"] + MLA_DIMS["value"], MLA_DIMS["latent"]) * MLA_DIMS["latent"] ** -0.5
    return CaseInputs(step1, step2, num_blocks, kinds, kv_b)


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


def attention_config(case: Case, dispatch_key: str):
    """The AttentionConfig of a case on a platform of `dispatch_key` (what `validate` judges)."""
    import torch
    from tokenmill.attention_backends.interface import AttentionConfig
    return AttentionConfig(head_size=case.head_size, num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                           dtype=getattr(torch, case.dtype), kv_cache_dtype=case.kv_cache_dtype,
                           block_size=case.block_size, sliding_window=case.sliding_window,
                           logits_soft_cap=case.logits_soft_cap, device=dispatch_key, mla=case.mla,
                           attention_sinks=case.attention_sinks)


def run_backend(cls, case: Case, inputs: CaseInputs, device: str):
    """Both steps' outputs of backend `cls` on `inputs` (on a fresh cache of its own layout)."""
    import torch
    from tokenmill.attention_backends.interface import kv_cache_torch_dtype
    dtype = getattr(torch, case.dtype)
    shape = (inputs.num_blocks, case.block_size, case.head_size) if case.mla else \
        cls.kv_cache_shape(inputs.num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    cache = torch.zeros(shape, dtype=kv_cache_torch_dtype(case.kv_cache_dtype, dtype), device=device)
    scale = (MLA_DIMS["nope"] + MLA_DIMS["rope"]) ** -0.5 if case.mla else case.head_size ** -0.5
    be = cls(case.num_heads, case.head_size, scale, case.num_kv_heads,
             sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap,
             kv_cache_dtype=case.kv_cache_dtype)
    if case.attention_sinks:
        be.sinks = case_sinks(case).to(device)
    outs = []
    for step in (inputs.step1, inputs.step2):
        if step is None:
            outs.append(None)
            continue
        md, *tensors = step
        if case.mla:
            out = be.forward_mla(*(x.clone() for x in tensors), cache, md, inputs.kv_b)
        else:
            out = be.forward(*(x.clone() for x in tensors), cache, md)
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


def check_cell(name: str, cls, case: Case, inputs: CaseInputs, ref_outs, device: str,
               dispatch_key: Optional[str] = None) -> CellResult:
    """One backend on one case against the reference outputs. `device`: the torch device the
    tensors live on; `dispatch_key`: the platform's key backends are validated for (default: device)."""
    import torch
    reasons = cls.validate(attention_config(case, dispatch_key or device))
    if reasons:
        return CellResult(name, case, "unsupported", reasons=reasons)
    t0 = time.perf_counter()
    try:
        outs = run_backend(cls, case, inputs, device)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        return CellResult(name, case, "fail", where=f"raised {msg}", seconds=time.perf_counter() - t0)
    atol, rtol = tolerance(case)
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
               progress: Optional[Callable[[CellResult], None]] = None,
               dispatch_key: Optional[str] = None) -> list[CellResult]:
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
            if ref_outs is None and not cls.validate(attention_config(case, dispatch_key or device)):
                ref_outs = run_backend(ref_cls, case, inputs, device)
            res = check_cell(name, cls, case, inputs, ref_outs, device, dispatch_key)
            results.append(res)
            if progress:
                progress(res)
    return results
