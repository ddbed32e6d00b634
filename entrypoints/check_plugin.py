"""`tokenmill check-plugin NAME`: what a platform or attention backend must pass in its own CI.

NAME is a platform or an attention-backend name. Checks, each pass / fail / skip:
  registered        the entry point loaded (imports, right type, right API version, no clash)
  api_version       the class states this tokenmill's API version for its kind
  probe             probe() returns (an Availability / None-or-reason) and does not raise
  describe          describe() works without the device (platforms)
  attention_matrix  the quick grid of `tokenmill attention-matrix` against `reference`, for the
                    platform's own backends (or the named backend, on a platform that runs it)
  memory_profiler   a positive KV block count for a tiny configuration (platforms)
  greedy_tokens     the default model's greedy tokens identical to --device cpu
Device checks are skipped when the platform is unavailable here. Exit status 1 on any failure.
The same checks run as pytest items with `pytest --tokenmill-plugin NAME` (pytest_plugin.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# Engine settings of the greedy comparison; a fixed block count keeps the profiler out of it
# (it has a check of its own) and the KV pool small on every device.
ENGINE_KW = dict(dtype="float32", max_model_len=256, max_num_seqs=4, seed=0, num_gpu_blocks_override=64)


class Skip(Exception):
    """The check cannot run here (not a failure)."""


@dataclass
class CheckResult:
    check: str
    status: str          # "pass", "fail", "skip"
    detail: str = ""


class PluginChecks:
    """The checks for one platform or attention backend; each returns a detail string, raises
    AssertionError (fail) or Skip."""

    def __init__(self, name: str, device: Optional[str] = None, generate: bool = True) -> None:
        from tokenmill.plugins import discovery, registry

        self.name = name
        self.registry, self.discovery = registry, discovery
        self.kind = next((k for k in ("platform", "attention_backend")
                          if any(r.name == name for r in registry.reports(k))), None)
        if self.kind is None:
            known = sorted(registry.load("platform")) + sorted(registry.load("attention_backend"))
            raise ValueError(f"{name!r} is neither a platform nor an attention backend; known: {', '.join(known)}")
        self.cls = registry.load(self.kind).get(name)
        self._device = device
        self.generate = generate

    def checks(self) -> dict[str, Callable[[], str]]:
        out = {"registered": self.registered, "api_version": self.api_version, "probe": self.probe}
        if self.kind == "platform":
            out["describe"] = self.describe
        out["attention_matrix"] = self.attention_matrix
        if self.kind == "platform":
            out["memory_profiler"] = self.memory_profiler
        if self.generate:
            out["greedy_tokens"] = self.greedy_tokens
        return out

    def run(self) -> list[CheckResult]:
        results = []
        for check, fn in self.checks().items():
            try:
                results.append(CheckResult(check, "pass", fn()))
            except Skip as exc:
                results.append(CheckResult(check, "skip", str(exc)))
            except AssertionError as exc:
                results.append(CheckResult(check, "fail", str(exc)))
            except Exception as exc:   # whatever the plugin raised is a failure too
                results.append(CheckResult(check, "fail", self.registry.error_text(exc)))
        return results

    # ----------------------------------------------------------------------------- the checks
    def _loaded(self) -> type:
        if self.cls is None:
            raise Skip(f"{self.kind} {self.name!r} is not loaded")
        return self.cls

    def registered(self) -> str:
        report = next(r for r in self.registry.reports(self.kind) if r.name == self.name)
        assert report.loaded, f"refused: {report.reason}"
        return f"{report.entry_point} from {report.package} {report.package_version}"

    def api_version(self) -> str:
        from tokenmill.plugins.kinds import KINDS
        expected = KINDS[self.kind].expected_api_version()
        stated = getattr(self._loaded(), "api_version", None)
        assert stated == expected, f"states api_version {stated}; this tokenmill speaks {expected}"
        return str(stated)

    def probe(self) -> str:
        cls = self._loaded()
        got = cls.probe()
        if self.kind == "platform":
            from tokenmill.platforms.interface import Availability
            assert isinstance(got, Availability), f"probe() returned {got!r}, not an Availability"
            return ("available: " if got.available else "unavailable: ") + got.reason
        assert got is None or isinstance(got, str), f"probe() returned {got!r}, not None or a reason"
        return got or "its packages import here"

    def describe(self) -> str:
        desc = self._loaded()().describe()
        assert desc.get("name") == self.name, f"describe()['name'] is {desc.get('name')!r}"
        json.dumps(desc, default=str)
        return ", ".join(f"{k}={desc[k]}" for k in ("torch_device", "attention_backends") if k in desc)

    def platform(self) -> Any:
        """The platform the device checks run on: the named one, or for a backend the --device
        given, else the highest-priority available platform whose dispatch key it supports."""
        if self.kind == "platform":
            platform_name = self.name
        elif self._device:
            platform_name = self._device
        else:
            cls = self._loaded()
            usable = sorted((r for r in self.discovery.discover_platforms() if r.usable),
                            key=lambda r: -(r.priority or 0))
            keys = set(cls.supported_devices)
            match = next((r for r in usable
                          if "*" in keys or self.discovery.platform_class(r.name).dispatch_key in keys), None)
            if match is None:
                raise Skip(f"no available platform has a dispatch key {self.name} supports ({sorted(keys)})")
            platform_name = match.name
        self._loaded()
        try:
            return self.discovery.resolve_platform(platform_name)
        except ValueError as exc:
            raise Skip(str(exc)) from None

    def attention_matrix(self) -> str:
        from .attention_grid import build_grid, run_matrix
        platform = self.platform()
        backends = self.discovery.attention_backend_classes()
        names = [self.name] if self.kind == "attention_backend" else platform.attention_backends()
        missing = [n for n in names if n not in backends]
        assert not missing, f"not loaded: {', '.join(missing)}"
        chosen = {n: backends[n] for n in names if n != "reference"}
        if not chosen:
            return "the platform uses the reference backend only"
        if platform.torch_device == "cpu":   # Triton kernels reach CPU tensors only through the interpreter
            os.environ.setdefault("TRITON_INTERPRET", "1")
        results = run_matrix(chosen, build_grid("quick", platform.torch_device), device=platform.torch_device,
                             dispatch_key=platform.dispatch_key)
        fails = [r for r in results if r.status == "fail"]
        assert not fails, "; ".join(f"{r.backend} {r.case.label}: {r.where or r.max_abs_error}" for r in fails[:3])
        for backend in chosen:
            assert any(r.backend == backend and r.status == "pass" for r in results), \
                f"{backend} supports no configuration of the quick grid on {platform.name}"
        passed = sum(r.status == "pass" for r in results)
        return f"{passed} pass, {len(results) - passed} unsupported on {platform.name}"

    def memory_profiler(self) -> str:
        from tokenmill.core.config import EngineConfig
        platform = self.platform()
        config = EngineConfig.from_kwargs(device=self.name, max_model_len=256, max_num_seqs=4)
        platform.check_and_update_config(config)
        bytes_per_block = 2 * 2 * config.cache.block_size * 2 * 64 * 4   # K+V, 2 layers, 2 heads of 64, fp32
        blocks = platform.memory_profiler().num_kv_blocks(config, bytes_per_block, lambda: None)
        assert isinstance(blocks, int) and blocks > 0, f"num_kv_blocks returned {blocks!r}"
        return f"{blocks} blocks of {bytes_per_block} bytes"

    def greedy_tokens(self) -> str:
        platform = self.platform()
        backend = self.name if self.kind == "attention_backend" else None
        want = _greedy(device="cpu")
        got = _greedy(device=platform.name, attention_backend=backend)
        assert got == want, f"tokens differ from --device cpu: {got} != {want}"
        return f"{len(PROMPTS)} prompts x {len(want[0])} tokens identical to --device cpu"


def _greedy(device: str, attention_backend: Optional[str] = None) -> list[list[int]]:
    import gc

    from tokenmill import LLM, SamplingParams
    llm = LLM(device=device, attention_backend=attention_backend, **ENGINE_KW)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm
    gc.collect()
    return tokens


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("check-plugin", help="conformance checks for a platform or attention backend",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="a platform or attention-backend name")
    p.add_argument("--device", default=None, help="for a backend: the platform to run it on")
    p.add_argument("--skip-generate", action="store_true", help="leave out the greedy-tokens check")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .platforms_cmd import table
    try:
        checks = PluginChecks(args.name, device=args.device, generate=not args.skip_generate)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = checks.run()
    if args.json:
        json.dump([asdict(r) for r in results], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"{checks.kind} {args.name}:")
        print("\n".join(table([["CHECK", "RESULT", "DETAIL"]] +
                              [[r.check, r.status.upper() if r.status == "fail" else r.status, r.detail]
                               for r in results])))
    return 1 if any(r.status == "fail" for r in results) else 0
