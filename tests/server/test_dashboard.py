"""GET /dashboard and /dashboard/data: the numbers of /metrics, sampled into rates and windowed
percentiles, drawn by a page that a real headless Chromium renders while the server is under load."""
from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tokenmill.entrypoints.openai.dashboard import DashboardSampler, histogram_quantile
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.testing import ServerProcess

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "dash"
ARGS = ["--served-model-name", MODEL, "--max-model-len", "1024", "--api-key", KEY, "--disable-access-log"]


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed (`make system-deps` installs it as root: apt-get install -y chromium)")


# ---------------------------------------------------------------------------- the arithmetic
def test_histogram_quantile_matches_prometheus():
    bounds = [0.1, 0.2, 0.4, float("inf")]
    assert histogram_quantile(0.5, bounds, [0, 0, 0, 0]) is None
    # 10 observations in (0.1, 0.2]: the median interpolates to the middle of that bucket
    assert histogram_quantile(0.5, bounds, [0, 10, 10, 10]) == pytest.approx(0.15)
    # ranks in +Inf report the highest finite bound, as histogram_quantile() does
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 5]) == pytest.approx(0.4)
    assert histogram_quantile(0.9, bounds, [5, 5, 10, 10]) == pytest.approx(0.2 + 0.2 * 4 / 5)


def test_sampler_rates_and_windowed_percentiles_come_from_the_registry():
    m = ServerMetrics("a", CollectorRegistry())
    sampler = DashboardSampler(m.registry)
    sampler.sample(now=1000.0)
    for t in range(1, 11):        # 10 s: 50 generation tokens/s, 5 prompt tokens/s, 1 request/s
        m.update_stats({"num_running": 3, "num_waiting": 1, "kv_cache_usage": 0.25, "generation_tokens": 50 * t,
                        "prompt_tokens": 5 * t, "prefix_cache_queries": 10 * t, "prefix_cache_hits": 4 * t})
        m.request_finished("length", 0.15, [0.03, 0.03], 1.0, 0.01)
        sampler.sample(now=1000.0 + t)
    view = sampler.data()["models"]
    assert [v["model_name"] for v in view] == ["a"]
    latest = view[0]["latest"]
    assert latest["running"] == 3 and latest["waiting"] == 1 and latest["kv_cache_usage"] == 0.25
    assert latest["generation_tps"] == pytest.approx(50.0)
    assert latest["prompt_tps"] == pytest.approx(5.0)
    assert latest["requests_per_s"] == pytest.approx(1.0)
    assert latest["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert latest["requests_finished"] == 10
    assert 0.1 < latest["ttft_p50"] <= 0.25 and 0.025 < latest["itl_p99"] <= 0.05
    # the percentiles are over a trailing window: observations older than it no longer count
    for t in range(11, 80):
        m.request_finished("stop", 4.0, [0.5], 5.0, 0.01)
        sampler.sample(now=1000.0 + t)
    assert sampler.data()["models"][0]["latest"]["ttft_p50"] > 2.5
    assert len(sampler.samples) <= sampler.samples.maxlen


# ---------------------------------------------------------------------------- the served page
@pytest.fixture(scope="module")
def server():
    with ServerProcess(ARGS, env={"TOKENMILL_FAKE_STEP_S": "0.01"}, fake_engine=True) as srv:
        yield srv


class LoadLoop:
    """Background clients streaming completions until stopped."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url, self.stop_event, self.errors = url, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as c:
            while not self.stop_event.is_set():
                r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"load {i} " * 20, "max_tokens": 16,
                                                    "ignore_eos": True})
                if r.status_code != 200:
                    self.errors.append(r.text)

    def __enter__(self) -> "LoadLoop":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(60)


def test_page_is_public_data_is_keyed(server):
    page = httpx.get(server.url + "/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script" in page.text and "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")
    assert httpx.get(server.url + "/dashboard/data", timeout=10).status_code == 401
    data = httpx.get(server.url + "/dashboard/data", headers=AUTH, timeout=10)
    assert data.status_code == 200 and data.json()["models"][0]["model_name"] == MODEL


def test_data_agrees_with_metrics(server):
    with LoadLoop(server.url, clients=2):
        time.sleep(2.5)
    time.sleep(2.5)        # idle: the sampler has caught up with the last requests
    m = server.metrics()
    latest = httpx.get(server.url + "/dashboard/data", headers=AUTH, timeout=10).json()["models"][0]["latest"]
    finished = sum(v for k, v in m.items() if k.startswith("request_success_total["))
    assert latest["requests_finished"] == finished > 0
    assert latest["generation_tokens"] == m["generation_tokens_total"]
    assert latest["running"] == m["num_requests_running"] == 0


def test_chromium_renders_nonzero_throughput_under_load(server, tmp_path):
    chromium = chromium_binary()
    url = f"{server.url}/dashboard?key={KEY}"
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--user-data-dir=" + str(tmp_path / "profile"), "--window-size=1400,1000",
             "--virtual-time-budget=4000"]
    shot = tmp_path / "dashboard.png"
    with LoadLoop(server.url) as load:
        time.sleep(6)      # RATE_WINDOW_S of samples under load
        dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=90).stdout
        subprocess.run(flags + [f"--screenshot={shot}", url], capture_output=True, timeout=90)
    assert not load.errors, load.errors[:3]
    assert 'data-updated="' in dom, dom[-2000:]
    values = dict(re.findall(r'data-metric="(\w+)">([^<]*)<', dom))
    assert float(values["generation_tps"]) > 0, values
    assert float(values["prompt_tps"]) > 0 and float(values["requests_finished"]) > 0
    assert float(values["ttft_p50"]) > 0 and float(values["itl_p99"]) > 0
    assert f'data-model="{MODEL}"' in dom and dom.count("<path") >= 6
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 1000)
