"""`--distributed-executor-backend ray` (issue 16 items 1 and 5): a Ray cluster started on loopback
(`ray start --head --node-ip-address 127.0.0.1`, found through RAY_ADDRESS as a multi-node
cluster would be) runs -tp 2 as two Ray actors, with the same greedy tokens as -tp 1."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from model_helpers import save_tiny_checkpoint
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tokenmill[ray]')")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
ENGINE = dict(dtype="float32", kv_cache_memory=1 << 24, num_threads=1, max_model_len=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A one-node cluster on loopback, in the foreground (--block) so this test owns its processes."""
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable))
    if ray_bin is None:
        pytest.skip("the ray command is not installed next to this python")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("ray") / "head.log", "w+")
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled"))
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if head.poll() is not None:
            log.seek(0)
            pytest.skip(f"ray start --head exited ({head.returncode}): {log.read()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.5)
    else:
        os.killpg(head.pid, signal.SIGKILL)
        pytest.skip("the Ray head did not start listening within 90 s")
    yield address
    os.killpg(head.pid, signal.SIGTERM)      # --block: the head ends the processes it started
    try:
        head.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(10)


def test_ray_cluster_runs_tp2_with_the_same_tokens(tmp_path, ray_cluster, monkeypatch):
    path = str(tmp_path / "llama")
    save_tiny_checkpoint("llama", path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    single = LLM(path, **ENGINE)
    expected = [list(o.outputs[0].token_ids) for o in single.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    # A throwaway loopback cluster: no token (a real one shares ~/.ray/auth_token, docs/distributed.md).
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    started = time.monotonic()
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        executor = llm.engine.executor
        assert type(executor).__name__ == "RayExecutor" and len(executor.actors) == 2
        pids = executor.worker_pids()
        assert len(set(pids)) == 2 and os.getpid() not in pids      # two actor processes, not this one
        got = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    finally:
        llm.engine.executor.shutdown()
        ray.shutdown()
    assert got == expected
    print(f"ray tp=2 engine start + generate: {time.monotonic() - started:.1f} s")
