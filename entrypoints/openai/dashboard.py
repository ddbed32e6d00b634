"""GET /dashboard (one self-contained page) and GET /dashboard/data (what it draws).

The dashboard shows the numbers /metrics exposes, read from the same prometheus registry, so the
two can never disagree: a sampler reads the registry once a second into a ring buffer (the last
five minutes), and /dashboard/data turns that buffer into what an operator looks at — gauges as
they were, counters as rates (tokens/s, requests/s, prefix-cache hit rate) and histograms as
p50/p90/p99 over a trailing window, computed from the bucket counts' deltas exactly as
Prometheus' `histogram_quantile(rate(...))` would. There is no second set of counters.

Series are grouped by the `model_name` label: every served name (an adapter served under its own
name included) gets its own panel as soon as the registry has samples for it.

The page itself holds no data and is public (a browser opening a bookmark sends no
Authorization header); /dashboard/data is behind --api-key like every /v1 route (http.Guard),
and the page asks for the key (or takes `?key=` once) and keeps it in sessionStorage.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CollectorRegistry

SAMPLE_INTERVAL_S = 1.0
HISTORY_S = 300            # the ring buffer: five minutes of one-second samples
PERCENTILE_WINDOW_S = 60   # TTFT/ITL percentiles at each point: over the minute before it
RATE_WINDOW_S = 5          # tokens/s and requests/s at each point: over the seconds before it
QUANTILES = (0.5, 0.9, 0.99)

_PAGE = Path(__file__).with_name("static") / "dashboard.html"

# registry metric (family) name -> the dashboard's name for it
_GAUGES = {"tokenmill:num_requests_running": "running", "tokenmill:num_requests_waiting": "waiting",
           "tokenmill:kv_cache_usage_perc": "kv_cache_usage"}
_COUNTERS = {"tokenmill:prompt_tokens": "prompt_tokens", "tokenmill:generation_tokens": "generation_tokens",
             "tokenmill:prefix_cache_queries": "prefix_cache_queries",
             "tokenmill:prefix_cache_hits": "prefix_cache_hits", "tokenmill:request_success": "requests_finished",
             "tokenmill:request_aborted": "requests_aborted"}
# the dashboard's rate -> the counter it is the rate of
_RATES = {"prompt_tps": "prompt_tokens", "generation_tps": "generation_tokens",
          "requests_per_s": "requests_finished", "aborted_per_s": "requests_aborted"}
_HISTOGRAMS = {"tokenmill:time_to_first_token_seconds": "ttft", "tokenmill:inter_token_latency_seconds": "itl",
               "tokenmill:e2e_request_latency_seconds": "e2e_latency"}


def read_registry(registry: CollectorRegistry) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    """One sample of the registry: {model_name: {name: value}} (gauges and counters as floats — a
    counter summed over its other labels, e.g. finished_reason — histograms as cumulative bucket
    counts), and each histogram's upper bounds."""
    models: dict[str, dict[str, Any]] = {}
    bounds: dict[str, list[float]] = {}
    for family in registry.collect():
        name = _GAUGES.get(family.name) or _COUNTERS.get(family.name) or _HISTOGRAMS.get(family.name)
        if name is None:
            continue
        for s in family.samples:
            model = s.labels.get("model_name")
            if model is None:
                continue
            values = models.setdefault(model, {})
            if family.name in _HISTOGRAMS:
                if not s.name.endswith("_bucket"):
                    continue
                le = float(s.labels["le"])
                values.setdefault(name, {})[le] = s.value
            elif family.name in _COUNTERS:
                if s.name.endswith("_total"):
                    values[name] = values.get(name, 0.0) + s.value
            else:
                values[name] = s.value
    for values in models.values():     # {le: count} -> counts in ascending le, bounds kept once
        for name in _HISTOGRAMS.values():
            if name in values:
                les = sorted(values[name])
                bounds[name] = les
                values[name] = [values[name][le] for le in les]
    return models, bounds


def histogram_quantile(q: float, bounds: list[float], counts: list[float]) -> Optional[float]:
    """Prometheus' histogram_quantile over cumulative `counts` (one per upper bound in `bounds`, the
    last +Inf): linear within the bucket the rank falls in; None without observations. A rank in
    the +Inf bucket reports the highest finite bound, as Prometheus does."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


class DashboardSampler:
    """Reads the registry every SAMPLE_INTERVAL_S into a ring buffer of HISTORY_S samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.samples: deque[tuple[float, dict[str, dict[str, Any]]]] = deque(
            maxlen=int(HISTORY_S / SAMPLE_INTERVAL_S) + 1)
        self.bounds: dict[str, list[float]] = {}
        self._task: Optional[asyncio.Task] = None

    def sample(self, now: Optional[float] = None) -> None:
        models, bounds = read_registry(self.registry)
        self.bounds.update(bounds)
        self.samples.append((time.time() if now is None else now, models))

    def start(self) -> None:
        self.sample()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            self.sample()

    # ------------------------------------------------------------------ the view
    def data(self) -> dict[str, Any]:
        """What the page draws, per model name: a time series of every number and its latest value."""
        samples = list(self.samples)
        names = sorted({m for _, models in samples for m in models})
        return {"interval_s": SAMPLE_INTERVAL_S, "history_s": HISTORY_S,
                "percentile_window_s": PERCENTILE_WINDOW_S, "rate_window_s": RATE_WINDOW_S,
                "quantiles": list(QUANTILES), "time": time.time(),
                "models": [self._model_view(name, samples) for name in names]}

    def _model_view(self, model: str, samples: list[tuple[float, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
        points = [(t, models[model]) for t, models in samples if model in models]
        series: dict[str, list[Any]] = {"t": [round(t, 3) for t, _ in points]}
        for key in _GAUGES.values():
            series[key] = [v.get(key, 0.0) for _, v in points]
        rate_from = window_from = 0     # the latest point at or before each window's start (else the oldest)
        for i, (t, now) in enumerate(points):
            while rate_from < i and points[rate_from + 1][0] <= t - RATE_WINDOW_S:
                rate_from += 1
            while window_from < i and points[window_from + 1][0] <= t - PERCENTILE_WINDOW_S:
                window_from += 1
            # A point's derived values depend on earlier points only: computed once, kept with the point.
            row = now.get("_derived")
            if row is None:
                row = now["_derived"] = self._derive(t, now, points[rate_from], points[window_from][1])
            for key, value in row.items():
                series.setdefault(key, []).append(value)
        latest = {key: values[-1] if values else None for key, values in series.items() if key != "t"}
        totals = points[-1][1] if points else {}
        latest.update({k: totals.get(k, 0.0) for k in _COUNTERS.values()})
        return {"model_name": model, "latest": latest, "series": series}

    def _derive(self, t: float, now: dict[str, Any], before: tuple[float, dict[str, Any]],
                window: dict[str, Any]) -> dict[str, Any]:
        """One point's rates (over RATE_WINDOW_S), prefix-cache hit rate and percentiles (over
        PERCENTILE_WINDOW_S)."""
        row: dict[str, Any] = {}
        dt = t - before[0]
        for key, counter in _RATES.items():
            delta = now.get(counter, 0.0) - before[1].get(counter, 0.0)
            row[key] = round(delta / dt, 3) if dt > 0 else 0.0
        queries = now.get("prefix_cache_queries", 0.0) - window.get("prefix_cache_queries", 0.0)
        hits = now.get("prefix_cache_hits", 0.0) - window.get("prefix_cache_hits", 0.0)
        row["prefix_cache_hit_rate"] = round(hits / queries, 4) if queries > 0 else None
        for hist in ("ttft", "itl"):
            counts = self._delta(now.get(hist), window.get(hist))
            for q in QUANTILES:
                value = histogram_quantile(q, self.bounds.get(hist, []), counts) if counts else None
                row[f"{hist}_p{round(q * 100)}"] = None if value is None else round(value, 6)
        return row

    @staticmethod
    def _delta(now: Optional[list[float]], before: Optional[list[float]]) -> Optional[list[float]]:
        if now is None:
            return None
        if before is None or len(before) != len(now):
            return list(now)
        return [a - b for a, b in zip(now, before)]


def add_dashboard_routes(app: FastAPI, serving: Any) -> None:
    """/dashboard and /dashboard/data; the sampler runs while the engine is up."""
    holder: dict[str, DashboardSampler] = {}

    def on_started(state: Any) -> None:
        on_stopping()       # one sampler at a time, whatever starts the state again
        sampler = DashboardSampler(state.metrics.registry)
        sampler.start()
        holder["sampler"] = sampler

    def on_stopping() -> None:
        if "sampler" in holder:
            holder["sampler"].stop()

    serving.on_started.append(on_started)
    serving.on_stopping.append(on_stopping)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_PAGE.read_text(encoding="utf-8"),
                            headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                                     "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                                                "style-src 'unsafe-inline'; img-src 'self' data:"})

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data() -> JSONResponse:
        serving.require()
        sampler = holder.get("sampler")
        return JSONResponse(sampler.data() if sampler is not None else {"models": []},
                            headers={"Cache-Control": "no-store"})
