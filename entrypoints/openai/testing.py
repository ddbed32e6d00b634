"""A stand-in with LLMEngine's interface, for exercising the server without a model, and the
helper that starts `tokenmill serve` for tests.

`tokenmill serve --engine-factory tokenmill.entrypoints.openai.testing:FakeEngine` serves the fake.
It follows the engine's contract: the default model's real tokenizer (chat template included),
the engine's own request validation (core/request_checks.py: vocabulary, empty prompt, context
length, explicit max_tokens, KV pool), and per-step `RequestDelta`s (new token ids, new text with a
partial stop string held back, new logprobs; metrics on the finishing delta). It "generates" token
ids from a seeded RNG (greedy: a fixed function of the prompt), one token per step per sequence,
with the scheduler's shape: at most max_num_seqs sequences running, admitted fairly across HTTP
requests as the scheduler does, the rest waiting; KV blocks counted per
sequence. TOKENMILL_FAKE_STEP_S sets the time one step takes (default 0.01 s). TOKENMILL_FAKE_SCRIPT
makes every sequence "generate" that text instead (its token ids, then EOS): how the server tests get
tool calls and reasoning out of it. TOKENMILL_FAKE_LOAD_S makes "loading the model" take that long
(the readiness tests).
"""
from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from typing import Any, Iterable, Optional

from ...core.detokenizer import IncrementalDetokenizer
from ...core.loaders.model_source import resolve_model_source
from ...core import request_checks
from ...core.errors import RequestError
from ...core.outputs import CompletionDelta, EngineStats, RequestDelta, RequestMetrics
from ...core.pooling_params import pooling_request


class _Platform:
    name = "fake"


class _Seq:
    """One choice: its tokens, its detokenizer (stop strings, held-back text) and its RNG."""

    def __init__(self, index: int, prompt_ids: list[int], params: Any, tokenizer: Any) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.rng = random.Random(None if params.seed is None else params.seed * 1000 + index)
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output)
        self.cumulative_logprob = 0.0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None


class _Req:
    def __init__(self, rid: str, ids: list[int], params: Any, max_tokens: int, arrival: float,
                 tokenizer: Any, group: Optional[str] = None) -> None:
        self.rid, self.ids, self.params, self.max_tokens = rid, ids, params, max_tokens
        self.group = group if group is not None else rid     # as Sequence.group_id
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.seqs = [_Seq(i, ids, params, tokenizer) for i in range(params.n)]
        self.num_computed = 0     # prompt tokens prefilled so far


def _load_tokenizer(model: Optional[str], tokenizer: Optional[str]) -> Any:
    """The model's tokenizer through transformers alone: the fake needs no weights, and does not
    depend on the engine's loaders."""
    from transformers import AutoTokenizer

    from ...core.loaders.model_source import resolve_model_source
    source = tokenizer or resolve_model_source(model).path
    if str(source).endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(source)),
                                             gguf_file=os.path.basename(source))
    return AutoTokenizer.from_pretrained(source)


class FakeEngine:
    def __init__(self, config: Any) -> None:
        self.config = config
        time.sleep(float(os.environ.get("TOKENMILL_FAKE_LOAD_S", "0")))
        self.tokenizer = _load_tokenizer(config.model.model, config.model.tokenizer)
        config.finalize(8192)
        self.max_model_len = config.model.max_model_len
        self.vocab_size = len(self.tokenizer)
        # as the engine names it: the model file's stem (the server drops a quantization suffix)
        path = os.path.basename(str(resolve_model_source(config.model.model).path).rstrip("/"))
        self.model_name = config.model.served_model_name or (path[:-5] if path.endswith(".gguf") else path)
        self.platform = _Platform()
        self.attention_backend_name = "none"
        self.block_size = config.cache.block_size
        self.num_kv_blocks = 4096
        self.step_s = float(os.environ.get("TOKENMILL_FAKE_STEP_S", "0.01"))
        script = os.environ.get("TOKENMILL_FAKE_SCRIPT")
        self.script = None if script is None else list(self.tokenizer.encode(script, add_special_tokens=False))
        self.eos_token_id = self.tokenizer.eos_token_id
        self.requests: dict[str, _Req] = {}     # unfinished, waiting or running (the engine's one table)
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._stats = EngineStats()

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Any, params: Any, arrival_time: Optional[float] = None,
                    priority: int = 0, max_tokens_must_fit: bool = False, group_id: Optional[str] = None) -> None:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id", "invalid_value")
        # The engine's own checks, so a refusal reads exactly as the engine's (core/request_checks.py).
        _, ids = request_checks.prompt_token_ids(prompt, self.tokenizer.encode, self.vocab_size)
        params, _ = pooling_request(params, None, len(ids), self.max_model_len, self._fits_in_pool)
        limit = self.max_model_len
        request_checks.check_length(len(ids), params, limit, max_tokens_must_fit, self._fits_in_pool)
        max_tokens = params.max_tokens
        room = limit - len(ids)      # an unset max_tokens is clipped to the context
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        r = _Req(request_id, ids, params, max_tokens,
                 time.monotonic() if arrival_time is None else arrival_time, self.tokenizer, group_id)
        self.requests[request_id] = r
        self.waiting.append(r)

    def _fits_in_pool(self, num_tokens: int) -> Optional[str]:
        return request_checks.pool_problem(-(-num_tokens // self.block_size), self.num_kv_blocks)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for rid in ids:
            self.requests.pop(rid, None)
        self.waiting = [r for r in self.waiting if r.rid not in ids]
        self.running = [r for r in self.running if r.rid not in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _blocks(self, r: _Req) -> int:
        total = len(r.ids) + max(len(s.token_ids) for s in r.seqs)
        return -(-total // self.block_size) * r.params.n

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_cache_usage = min(1.0, sum(self._blocks(r) for r in self.running) / self.num_kv_blocks)
        return s

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestDelta]:
        now = time.monotonic()
        self._admit(now)
        # Chunked prefill, as the scheduler does it: decodes first, prompts share what is left of
        # the token budget; a request samples only once its whole prompt is computed.
        budget = self.config.scheduler.max_num_batched_tokens or 2048
        decoding = [r for r in self.running if r.num_computed >= len(r.ids)]
        tokens = sum(r.params.n for r in decoding)
        budget -= tokens
        for r in self.running:
            if r.num_computed < len(r.ids) and budget > 0:
                chunk = min(len(r.ids) - r.num_computed, budget)
                r.num_computed += chunk
                budget -= chunk
                tokens += chunk
                self._stats.prompt_tokens += chunk
                if r.num_computed >= len(r.ids):
                    decoding.append(r)
        if self.step_s:    # a step costs more the more tokens it computes
            time.sleep(self.step_s * max(1.0, tokens / 32))
        now = time.monotonic()
        deltas = []
        for r in decoding:
            outs = [self._next_token(r, seq) for seq in r.seqs if seq.finish_reason is None]
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.last_token_time = now
            finished = all(seq.finish_reason is not None for seq in r.seqs)
            if finished:
                r.metrics.finished_time = now
                self.running.remove(r)
                del self.requests[r.rid]
            deltas.append(RequestDelta(r.rid, outs, finished, metrics=r.metrics if finished else None))
        return deltas

    def _admit(self, now: float) -> None:
        """As the scheduler admits (core/scheduler.py), a request at a time: its n sequences count against
        max_num_seqs, groups take turns (fewest running sequences first), and a group with nothing running
        while the slots are full gets the newest request of the group holding the most beyond its share."""
        cap = self.config.scheduler.max_num_seqs
        held: Counter = Counter()
        for r in self.running:
            held[r.group] += r.params.n
        starved = next((r for r in self.waiting if r.group not in held), None)
        if starved is not None and sum(held.values()) + starved.params.n > cap:
            share = max(1, cap // (len(held) + len({r.group for r in self.waiting} - held.keys())))
            victims = [r for r in self.running if held[r.group] > share]
            if victims:
                victim = max(victims, key=lambda r: (held[r.group], r.metrics.arrival_time))
                self.running.remove(victim)
                held[victim.group] -= victim.params.n
                victim.num_computed = 0          # recomputed, as a preempted sequence is
                self.waiting.insert(0, victim)
        while self.waiting:
            pos, r = min(enumerate(self.waiting), key=lambda e: (held[e[1].group], e[0]))
            if held and sum(held.values()) + r.params.n > cap:
                break
            del self.waiting[pos]
            held[r.group] += r.params.n
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            self.running.append(r)

    def _next_token(self, r: _Req, seq: _Seq) -> CompletionDelta:
        p = r.params
        n_out = len(seq.token_ids)
        if self.script is not None:
            tid = self.script[n_out] if n_out < len(self.script) else self.eos_token_id
        elif p.greedy:
            tid = 1000 + (sum(r.ids[-3:]) * 31 + n_out * 7919) % 8000
        else:
            tid = seq.rng.randrange(1000, 9000)
        seq.token_ids.append(tid)
        n_out += 1
        self._stats.generation_tokens += 1
        logprobs = None
        if p.logprobs is not None:
            entry = {tid: -0.25}
            for k in range(p.logprobs):
                entry.setdefault(1000 + (tid + k + 1) % 8000, -1.0 - k)
            logprobs = [entry]
            seq.cumulative_logprob -= 0.25
        stop_str = seq.detok.append([tid])
        if n_out >= p.min_tokens:
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
            elif tid in p.stop_token_ids or (tid == self.eos_token_id and not p.ignore_eos):
                seq.finish_reason, seq.stop_reason = "stop", tid
        if seq.finish_reason is None and n_out >= r.max_tokens:
            seq.finish_reason = "length"
        text = seq.detok.output_text(finished=seq.finish_reason is not None, delta=True)
        return CompletionDelta(seq.index, [tid], text, logprobs,
                               seq.cumulative_logprob if p.logprobs is not None else None,
                               seq.finish_reason, seq.stop_reason)


# ---------------------------------------------------------------------------- test helper
class ServerProcess:
    """Start `tokenmill serve` on a free loopback port in a subprocess; always stopped on exit.

    Used by the server tests and the bench-serve test::

        with ServerProcess(["--max-model-len", "2048"]) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    """

    def __init__(self, args: list[str], env: Optional[dict[str, str]] = None, startup_timeout: float = 240.0,
                 fake_engine: bool = False, wait_for: str = "/health") -> None:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.args = list(args)
        if fake_engine:
            self.args += ["--engine-factory", "tokenmill.entrypoints.openai.testing:FakeEngine"]
        self.env = dict(os.environ, **(env or {}))
        self.startup_timeout = startup_timeout
        self.wait_for = wait_for     # the route whose 200 means "started" (/health/live: before the model loads)
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
                if httpx.get(self.url + self.wait_for, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"tokenmill serve did not become healthy in {self.startup_timeout}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {name: value}, without the `tokenmill:` prefix; a `finished_reason` label
        is kept as a suffix: `request_success_total[length]`."""
        import httpx
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            m = re.match(r"^tokenmill:(\w+)\{([^}]*)\} (\S+)$", line)
            if m:
                name, labels, value = m.groups()
                reason = re.search(r'finished_reason="(\w+)"', labels)
                out[name + (f"[{reason.group(1)}]" if reason else "")] = float(value)
        return out

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
