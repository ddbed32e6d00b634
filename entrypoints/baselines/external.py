"""`--baseline vllm|llamacpp`: run another engine on the same prompts, in its own process.

The contract with a runner script: `PYTHON RUNNER SPEC.json OUT.json`. SPEC holds the engine
settings and, per workload, the token-id prompts tokenmill timed, warm-up prompts of the same
shapes (other token ids) and the output length. OUT holds the engine's version, threads and
environment and, per workload, requests, prompt_tokens, output_tokens, seconds (median of
`repeat` runs), runs, output_tok_s and total_tok_s. The runner rewrites OUT after every workload,
so a crash part-way keeps what was done; a non-zero exit is a failure, reported with the tail of
its stderr.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ("vllm", "llamacpp")
RUNNERS = {"vllm": os.path.join(HERE, "vllm_runner.py"), "llamacpp": os.path.join(HERE, "llamacpp_runner.py")}
# Where shared/baselines/setup_vllm.sh and setup_llamacpp.sh put the venvs and the HF copy of the model.
DEFAULT_PYTHON = {"vllm": "/tmp/anchors/vllm-venv/bin/python", "llamacpp": "/tmp/anchors/llamacpp-venv/bin/python"}
DEFAULT_VLLM_MODEL = "/tmp/anchors/smollm2-hf"
DEFAULT_DTYPE = {"vllm": "bfloat16"}
LABELS = {"vllm": "vLLM", "llamacpp": "llama.cpp"}
STDERR_TAIL_CHARS = 3000


@dataclass
class BaselineResult:
    engine: str                         # vllm | llamacpp
    python: str
    model: str
    ok: bool = False
    error: Optional[str] = None         # set on failure (also when only some workloads finished)
    stderr_tail: str = ""
    info: dict[str, Any] = field(default_factory=dict)        # the runner's top-level entries
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def label(self) -> str:
        return self.info.get("engine") or LABELS.get(self.engine, self.engine)

    def summary(self) -> dict[str, Any]:
        """The top-level `baseline` entry of --json: everything but the per-workload numbers."""
        out = {"engine": self.engine, "label": self.label, "python": self.python, "model": self.model,
               "ok": self.ok, "wall_s": self.wall_s,
               **{k: v for k, v in self.info.items() if k not in ("workloads", "model")}}
        if self.error:
            out.update(error=self.error, stderr_tail=self.stderr_tail)
        return out


def warmup_prompt(prompt: list[int]) -> list[int]:
    """The same length, every id another one in the workloads' range [1000, 40000): the warm-up
    runs the same shapes (and a shared prefix stays shared) but cannot hit the timed run's cache."""
    return [1000 + (t - 1000 + 19500) % 39000 for t in prompt]


def resolve_model(engine: str, baseline_model: Optional[str], engine_model: Optional[str]) -> str:
    """vLLM: --baseline-model, else tokenmill's --model when it is an HF directory, else the HF copy
    of the default model. llama.cpp: --baseline-model, else tokenmill's own GGUF."""
    if baseline_model:
        return os.path.abspath(os.path.expanduser(baseline_model))
    if engine == "vllm":
        if engine_model and os.path.isdir(engine_model):
            return os.path.abspath(engine_model)
        return DEFAULT_VLLM_MODEL
    if engine_model and not os.path.isdir(engine_model):
        return os.path.abspath(os.path.expanduser(engine_model))
    if engine_model:
        raise ValueError(f"llama.cpp needs a GGUF file and --model {engine_model} is a directory; "
                         f"pass --baseline-model FILE.gguf")
    from tokenmill.core.loaders.model_source import default_model_path
    return default_model_path()


def build_spec(engine: str, model: str, workloads, *, repeat: int, threads: int, dtype: Optional[str],
               prefix_caching: bool, seed: int = 0, extra_bufts: bool = True) -> dict[str, Any]:
    return {"engine": engine, "model": model, "dtype": dtype or DEFAULT_DTYPE.get(engine), "threads": threads,
            "repeat": repeat, "prefix_caching": prefix_caching, "seed": seed, "n_batch": 512,
            "extra_bufts": extra_bufts,
            "workloads": [{"name": w.name, "output_len": w.output_len, "prompts": [list(p) for p in w.prompts],
                           "warmup_prompts": [warmup_prompt(p) for p in w.prompts]} for w in workloads]}


def runner_env(engine: str, python: str, threads: int, base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment the shared baselines use; a variable already set in the environment wins.
    vLLM-cpu: a 4 GiB KV cache, its OpenMP threads bound to cores 0..threads-1 (by default it keeps
    one core for its scheduler), and the venv's own libgomp preloaded (torch's wheel ships one)."""
    env = dict(os.environ if base is None else base)
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
        venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        gomp = sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "torch", "lib", "libgomp.so.1")))
        if gomp and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = gomp[0]
    return env


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(text: str) -> str:
    return text[-STDERR_TAIL_CHARS:].strip()


def run_baseline(engine: str, python: str, spec: dict[str, Any], runner: Optional[str] = None,
                 timeout: Optional[float] = None) -> BaselineResult:
    """Runs the engine's runner on `spec`; never raises for a failing baseline (see .error)."""
    result = BaselineResult(engine, python, spec["model"])
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        result.error = (f"baseline interpreter {python} not found or not executable: build the "
                        f"{LABELS[engine]} venv (shared/baselines/setup_{engine}.sh) or pass --baseline-python")
        return result
    if not os.path.exists(spec["model"]):
        result.error = f"baseline model {spec['model']} not found: pass --baseline-model"
        return result
    runner = runner or RUNNERS[engine]
    with tempfile.TemporaryDirectory(prefix=f"tokenmill-{engine}-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        start = time.perf_counter()
        try:
            proc = subprocess.run([python, runner, spec_path, out_path], cwd=tmp, capture_output=True, text=True,
                                  env=runner_env(engine, python, int(spec["threads"])), timeout=timeout)
            returncode, stderr = proc.returncode, proc.stderr or proc.stdout
        except subprocess.TimeoutExpired as exc:
            returncode = None
            stderr = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        except OSError as exc:
            result.error = f"could not start {python}: {exc}"
            return result
        result.wall_s = time.perf_counter() - start
        out: dict[str, Any] = {}
        if os.path.exists(out_path):
            try:
                with open(out_path) as f:
                    out = json.load(f)
            except ValueError as exc:
                result.error = f"unreadable runner output: {exc}"
    result.info = {k: v for k, v in out.items() if k != "workloads"}
    result.workloads = dict(out.get("workloads") or {})
    missing = [w["name"] for w in spec["workloads"] if w["name"] not in result.workloads]
    if returncode is None:
        result.error = f"the {LABELS[engine]} runner did not finish within {timeout:.0f} s"
    elif returncode < 0:
        result.error = f"the {LABELS[engine]} runner was killed by {_signal_name(-returncode)}"
        if -returncode in (signal.SIGILL, signal.SIGSEGV) and engine == "llamacpp":
            # Both seen on 2-core AMX VMs, in ggml's AMX matmul (ggml_backend_amx_mul_mat) of its
            # default weight buffers. GGML_NATIVE=ON turns AMX back on whatever the AMX options say.
            result.error += (" (llama.cpp's AMX kernels do this on some machines: try --baseline-no-extra-bufts, "
                             "or --baseline-python of a build without them: CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
                             "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON "
                             "-DGGML_AMX_INT8=OFF\")")
    elif returncode != 0:
        result.error = f"the {LABELS[engine]} runner exited with status {returncode}"
    elif missing and not result.error:
        result.error = f"the {LABELS[engine]} runner wrote no result for {', '.join(missing)}"
    if result.error:
        result.stderr_tail = _tail(stderr or "")
    result.ok = result.error is None
    return result


def attach(results: dict[str, Any], baseline: BaselineResult) -> None:
    """Adds `baseline` (the summary) to `results` and a `baseline` entry to every workload:
    its numbers and the ratios tokenmill / baseline, or the error."""
    results["baseline"] = baseline.summary()
    for name, entry in results["workloads"].items():
        b = baseline.workloads.get(name)
        if b is None:
            entry["baseline"] = {"engine": baseline.label, "error": baseline.error or "no result"}
            continue
        tm = entry["tokenmill"]
        entry["baseline"] = {"engine": baseline.label, **b,
                             "ratio_output_tok_s": tm["output_tok_s"] / b["output_tok_s"],
                             "ratio_total_tok_s": tm["total_tok_s"] / b["total_tok_s"]}


def report_lines(results: dict[str, Any], baseline: BaselineResult) -> list[str]:
    """What the bench prints for the baseline, after attach()."""
    lines = []
    if baseline.error:
        lines.append(f"baseline {baseline.engine} FAILED: {baseline.error}")
        if baseline.stderr_tail:
            lines += ["  | " + line for line in baseline.stderr_tail.splitlines()[-25:]]
    settings = [f"{baseline.info['threads']} threads" if "threads" in baseline.info else "",
                baseline.info.get("dtype") or os.path.basename(baseline.model),
                "use_extra_bufts off" if baseline.info.get("extra_bufts") is False else ""]
    where = ", ".join(s for s in settings if s)
    for name, entry in results["workloads"].items():
        b = entry["baseline"]
        if "error" in b:
            lines.append(f"{name} {baseline.label}: no result ({b['error']})")
            continue
        lines.append(f"{name} {baseline.label} ({where}): {b['requests']} requests, {b['seconds']:.2f}s, "
                     f"{b['output_tok_s']:.1f} output tok/s, {b['total_tok_s']:.1f} total tok/s")
        lines.append(f"{name} ratio tokenmill / {LABELS[baseline.engine]}: "
                     f"{b['ratio_output_tok_s']:.2f}x output tok/s, {b['ratio_total_tok_s']:.2f}x total tok/s")
    return lines
