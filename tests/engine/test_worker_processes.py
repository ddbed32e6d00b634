"""The mp executor's workers are programs of their own (core/worker_process.py; issue 32 item 1): a plain
script that builds `LLM(..., tensor_parallel_size=2)` at module level, without `if __name__ ==
"__main__":`, runs once and gets tp=1's tokens; a worker that fails to start says why (its traceback,
or its exit code and the end of its stderr), never "worker rank(s) [] exited"."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from model_helpers import save_tiny_checkpoint
from process_helpers import children, is_alive
from tokenmill.core import worker_process
from tokenmill.core.config import EngineConfig
from tokenmill.core.executor_base import EngineDeadError
from tokenmill.core.executor_mp import MultiprocExecutor
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
ENGINE = dict(dtype="float32", kv_cache_memory=1 << 24, num_threads=1, max_model_len=256)
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)

# No `if __name__ == "__main__":` on purpose: a worker that imported this file again would build
# another LLM (and print TOKENS twice, or fail).
SCRIPT = """
import json
from tokenmill import LLM, SamplingParams

llm = LLM({path!r}, tensor_parallel_size=2, **{engine!r})
outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], SamplingParams(**{greedy!r}), use_tqdm=False)
print("PIDS", json.dumps(llm.engine.executor.worker_pids()))
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""




def test_plain_script_at_tp2_runs_once_and_equals_tp1(tmp_path):
    path = str(tmp_path / "llama")
    save_tiny_checkpoint("llama", path)
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT.format(path=path, engine=ENGINE, prompts=PROMPTS, greedy=GREEDY))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    tokens = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("TOKENS ")]
    assert len(tokens) == 1, done.stdout      # the script's body ran once: in the script, not in a worker
    single = LLM(path, **ENGINE)
    outs = single.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY), use_tqdm=False)
    assert tokens[0] == [list(o.outputs[0].token_ids) for o in outs]
    # The script never shut its LLM down: its workers were ended at exit all the same.
    pids = next(json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("PIDS "))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(is_alive, pids)):
        time.sleep(0.1)
    assert not [p for p in pids if is_alive(p)]


def test_worker_that_fails_to_start_reports_its_exception(tmp_path):
    """A checkpoint cut short: the engine reads only its config at tp > 1, the workers read the
    weights and fail. The error carries a worker's traceback, not an empty list of exit codes."""
    path = tmp_path / "llama"
    save_tiny_checkpoint("llama", str(path))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(RuntimeError, match=r"(?s)worker rank\(s\) \[\d.*failed to start.*Traceback.*"
                                           r"SafetensorError.*incomplete metadata"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE)


def test_worker_that_dies_before_reporting_names_its_exit_and_stderr(monkeypatch):
    """A worker that cannot even start its program (here: a command that writes to stderr and exits 3)
    is named with its exit code and its stderr; the other rank (here: one that would wait forever, as a
    rank waits for its peers in the rendezvous) is ended, not left behind."""
    def command(fd: int, rank: int) -> list[str]:
        if rank == 0:
            return [sys.executable, "-c", "import time; time.sleep(120)"]
        return [sys.executable, "-c", ("import sys; sys.stderr.write('cannot load libtokenmill_fake.so\\n'); "
                                       "sys.exit(3)")]

    monkeypatch.setattr(worker_process, "worker_command", command)
    config = EngineConfig.from_kwargs(model=None, tensor_parallel_size=2, **ENGINE)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"(?s)worker rank\(s\) \[1\] exited while starting.*"
                                              r"rank 1: exit code 3.*cannot load libtokenmill_fake\.so"):
        MultiprocExecutor(config)
    assert time.monotonic() - started < 30
    assert not [p for p in children(os.getpid()) if b"time.sleep(120)" in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
