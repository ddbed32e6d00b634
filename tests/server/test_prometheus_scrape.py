"""A real Prometheus (Debian's `prometheus` binary) scrapes `tokenmill serve` every second; the series
read back through its HTTP API agree with the server's own /metrics. Loopback only; the test starts
and stops prometheus itself, bounded in time."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import httpx
import pytest

from tokenmill.entrypoints.openai.testing import ServerProcess

MODEL = "scraped"
NUM_REQUESTS = 7
MAX_TOKENS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(api: str, expr: str) -> dict:
    r = httpx.get(api + "/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return {tuple(sorted(item["metric"].items())): float(item["value"][1]) for item in r.json()["data"]["result"]}


def test_prometheus_reads_back_what_metrics_says(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (`make system-deps` installs it as root: apt-get install -y "
                    "prometheus)")
    with ServerProcess(["--served-model-name", MODEL, "--max-model-len", "512", "--disable-access-log"],
                       env={"TOKENMILL_FAKE_STEP_S": "0.005"}, fake_engine=True) as server:
        for i in range(NUM_REQUESTS):
            r = httpx.post(server.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": f"request {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True})
            assert r.status_code == 200, r.text
        ours = server.metrics()
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: tokenmill
    static_configs:
      - targets: ["127.0.0.1:{server.port}"]
""")
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 45
            success: dict = {}
            while time.monotonic() < deadline:
                assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
                try:
                    success = query(api, 'tokenmill:request_success_total{finished_reason="length"}')
                    if success:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            assert success, "prometheus never scraped tokenmill:request_success_total"
            ((labels, value),) = success.items()
            assert dict(labels)["model_name"] == MODEL and dict(labels)["job"] == "tokenmill"
            assert value == ours["request_success_total[length]"] == NUM_REQUESTS
            assert sum(query(api, "tokenmill:generation_tokens_total").values()) == ours["generation_tokens_total"] \
                == NUM_REQUESTS * MAX_TOKENS
            assert sum(query(api, "tokenmill:time_to_first_token_seconds_count").values()) == NUM_REQUESTS
            assert sum(query(api, "tokenmill:num_requests_running").values()) == ours["num_requests_running"] == 0
            up = query(api, 'up{job="tokenmill"}')
            assert list(up.values()) == [1.0]
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
