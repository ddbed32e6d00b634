"""A tiny stand-in with LLMEngine's interface, for exercising the server without a model.

`tokenmill serve --engine-factory tokenmill.entrypoints.openai.testing:FakeEngine` serves it.
It uses the default model's real tokenizer (chat template included) but "generates" token ids
from a seeded RNG, one token per step per sequence, with the scheduler's shape: at most
max_num_seqs running, the rest waiting; KV blocks counted per sequence. TOKENMILL_FAKE_STEP_S
sets the time one step takes (default 0.01 s).
"""
from __future__ import annotations

import os
import signal
import random
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ...core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from .engine_client import EngineStatsSnapshot, _load_tokenizer_fallback


# The fake engine reports the same stats record the real engine's snapshot uses.
FakeStats = EngineStatsSnapshot


class _Platform:
    name = "fake"


class _Req:
    def __init__(self, rid: str, ids: list[int], params: Any, arrival: float) -> None:
        self.rid, self.ids, self.params = rid, ids, params
        self.metrics = RequestMetrics(arrival_time=arrival)
        seed = params.seed
        self.rngs = [random.Random(None if seed is None else seed * 1000 + i) for i in range(params.n)]
        self.outs = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=0.0,
                                      logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]


class FakeEngine:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.tokenizer = _load_tokenizer_fallback({"model": config.model.model, "tokenizer": config.model.tokenizer})
        config.finalize(8192)
        self.model_name = config.model.served_model_name or "fake"
        self.platform = _Platform()
        self.attention_backend_name = "none"
        self.block_size = config.cache.block_size
        self.num_kv_blocks = 4096
        self.step_s = float(os.environ.get("TOKENMILL_FAKE_STEP_S", "0.01"))
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._stats = FakeStats()

    def add_request(self, request_id: str, prompt: Any, params: Any, arrival_time: Optional[float] = None,
                    priority: int = 0) -> None:
        if isinstance(prompt, dict):
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if len(ids) + 1 > self.config.model.max_model_len:
            err = ValueError(f"prompt of {len(ids)} tokens exceeds the maximum context length "
                             f"{self.config.model.max_model_len}")
            err.param = "prompt"  # type: ignore[attr-defined]
            raise err
        self.waiting.append(_Req(request_id, ids, params, arrival_time or time.monotonic()))

    def abort_request(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        self.waiting = [r for r in self.waiting if r.rid not in ids]
        self.running = [r for r in self.running if r.rid not in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks(self, r: _Req) -> int:
        total = len(r.ids) + max(len(o.token_ids) for o in r.outs)
        return -(-total // self.block_size) * r.params.n

    def stats(self) -> FakeStats:
        s = self._stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_cache_usage = min(1.0, sum(self._blocks(r) for r in self.running) / self.num_kv_blocks)
        return s

    def step(self) -> list[RequestOutput]:
        if self.step_s:
            time.sleep(self.step_s)
        now = time.monotonic()
        while self.waiting and len(self.running) < self.config.scheduler.max_num_seqs:
            r = self.waiting.pop(0)
            r.metrics.first_scheduled_time = now
            self._stats.prompt_tokens += len(r.ids)
            self.running.append(r)
        outputs = []
        eos = self.tokenizer.eos_token_id
        for r in list(self.running):
            p = r.params
            for o, rng in zip(r.outs, r.rngs):
                if o.finish_reason is not None:
                    continue
                if p.greedy:
                    tid = 1000 + (sum(r.ids[-3:]) * 31 + len(o.token_ids) * 7919) % 8000
                else:
                    tid = rng.randrange(1000, 9000)
                o.token_ids.append(tid)
                self._stats.generation_tokens += 1
                if o.logprobs is not None:
                    entry = {tid: -0.25}
                    for k in range(p.logprobs):
                        entry.setdefault(1000 + (tid + k + 1) % 8000, -1.0 - k)
                    o.logprobs.append(entry)
                o.cumulative_logprob = (o.cumulative_logprob or 0.0) - 0.25
                o.text = self.tokenizer.decode(o.token_ids, skip_special_tokens=True)
                for s in p.stop:
                    pos = o.text.find(s)
                    if pos >= 0:
                        o.text = o.text[: pos + (len(s) if p.include_stop_str_in_output else 0)]
                        o.finish_reason, o.stop_reason = "stop", s
                        break
                if o.finish_reason is None:
                    if tid in p.stop_token_ids or (tid == eos and not p.ignore_eos):
                        o.finish_reason, o.stop_reason = "stop", tid
                    elif p.max_tokens is not None and len(o.token_ids) >= p.max_tokens:
                        o.finish_reason = "length"
                    elif len(r.ids) + len(o.token_ids) >= self.config.model.max_model_len:
                        o.finish_reason = "length"
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.last_token_time = now
            finished = all(o.finish_reason is not None for o in r.outs)
            if finished:
                r.metrics.finished_time = now
                self.running.remove(r)
            outputs.append(RequestOutput(r.rid, None, r.ids, [CompletionOutput(o.index, o.text, list(o.token_ids),
                                                                               o.cumulative_logprob,
                                                                               list(o.logprobs) if o.logprobs is not None else None,
                                                                               o.finish_reason, o.stop_reason)
                                                              for o in r.outs], finished, r.metrics))
        return outputs


# ---------------------------------------------------------------------------- test helper
class ServerProcess:
    """Start `tokenmill serve` on a free loopback port in a subprocess; always stopped on exit.

    Used by the server tests and the bench-serve test::

        with ServerProcess(["--max-model-len", "2048"]) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    """

    def __init__(self, args: list[str], env: Optional[dict[str, str]] = None, startup_timeout: float = 240.0,
                 fake_engine: bool = False) -> None:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.args = list(args)
        if fake_engine:
            self.args += ["--engine-factory", "tokenmill.entrypoints.openai.testing:FakeEngine"]
        self.env = dict(os.environ, **(env or {}))
        self.startup_timeout = startup_timeout
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Any = None
        self._log: Any = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        import subprocess
        import sys
        import tempfile

        import httpx
        self._log = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", *self.args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"tokenmill serve did not become healthy in {self.startup_timeout}s:\n{self.log()}")

    def log(self) -> str:
        if self._log is None:
            return ""
        with open(self._log.name) as f:
            return f.read()

    def child_pids(self) -> list[int]:
        """Pids whose parent is the server process (the engine process)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if self.proc is not None and ppid == self.proc.pid:
                pids.append(int(entry))
        return pids

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> Optional[int]:
        """Ctrl-C the server; kill its process group if it does not exit in time. Returns the exit code."""
        import subprocess
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # the session we created: the server and its engine
            except ProcessLookupError:
                pass
            proc.wait(10)
        return proc.returncode
