"""Prometheus metrics, named after vLLM's (`vllm:` → `tokenmill:`), labelled by model name.

Gauges and the engine's cumulative counters come from the stats the engine process sends with
every step; request-level histograms are observed by the server as it streams each request.
Counters are exposed with prometheus_client's `_total` suffix, as vLLM's are.
"""
from __future__ import annotations

from typing import Iterator, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from .lora_metrics import LoRAGauges, lora_families

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_COUNTER_FIELDS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                   "generation_tokens", "num_constrained_requests", "grammar_compile_seconds",
                   "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "lora_swaps")


class _ExpertTokens:
    """`tokenmill:moe_expert_tokens_total{model_name, layer, expert}`: tokens routed to each expert of each
    mixture-of-experts layer. The engine sends its cumulative counts with each step's stats; they are kept
    as sent and turned into samples only when the registry is read (layers x experts series are too many to
    walk every step). One per registry, holding every model's counts."""

    def __init__(self) -> None:
        self.latest: dict[str, Mapping[str, list[int]]] = {}        # model -> layer -> counts (this engine's)
        self.base: dict[str, dict[str, list[int]]] = {}             # model -> counts of engines gone before

    @classmethod
    def of(cls, registry: CollectorRegistry) -> "_ExpertTokens":
        collector = getattr(registry, "_tokenmill_expert_tokens", None)
        if collector is None:
            collector = cls()
            registry.register(collector)
            registry._tokenmill_expert_tokens = collector     # type: ignore[attr-defined]
        return collector

    def totals(self, model: str) -> dict[str, list[int]]:
        out = {layer: list(counts) for layer, counts in self.base.get(model, {}).items()}
        for layer, counts in self.latest.get(model, {}).items():
            acc = out.setdefault(layer, [0] * len(counts))
            acc.extend([0] * (len(counts) - len(acc)))
            for expert, value in enumerate(counts):
                acc[expert] += value
        return out

    def engine_gone(self, model: str) -> None:
        """A restarted engine counts from zero: what the gone one counted stays in the totals."""
        self.base[model] = self.totals(model)
        self.latest.pop(model, None)

    def describe(self) -> list[Metric]:
        return []        # samples appear as models report: nothing to check for clashes at registration

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("tokenmill:moe_expert_tokens", "Tokens routed to each expert of each "
                                     "mixture-of-experts layer (a token counts once per expert it picked).",
                                     labels=["model_name", "layer", "expert"])
        for model in sorted(set(self.latest) | set(self.base)):
            for layer, counts in sorted(self.totals(model).items(), key=lambda kv: int(kv[0])):
                for expert, value in enumerate(counts):
                    family.add_metric([model, layer, str(expert)], value)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        # Several models share one registry (model_router.py): the first creates the families, the others
        # build theirs in a scratch registry and then take the first one's (below), with their own labels.
        shared = getattr(self.registry, "_tokenmill_server_metrics", None)
        r = self.registry if shared is None else CollectorRegistry()
        self.num_requests_running = Gauge("tokenmill:num_requests_running",
                                          "Number of requests in the running batch.", labels, registry=r)
        self.num_requests_waiting = Gauge("tokenmill:num_requests_waiting",
                                          "Number of requests waiting to be scheduled.", labels, registry=r)
        self.kv_cache_usage_perc = Gauge("tokenmill:kv_cache_usage_perc",
                                         "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        self.counters = {
            "prefix_cache_queries": Counter("tokenmill:prefix_cache_queries",
                                            "Prefix-cache queries, in tokens.", labels, registry=r),
            "prefix_cache_hits": Counter("tokenmill:prefix_cache_hits",
                                         "Prefix-cache hits, in tokens.", labels, registry=r),
            "num_preemptions": Counter("tokenmill:num_preemptions",
                                       "Cumulative number of preemptions.", labels, registry=r),
            "prompt_tokens": Counter("tokenmill:prompt_tokens",
                                     "Number of prefill tokens processed.", labels, registry=r),
            "generation_tokens": Counter("tokenmill:generation_tokens",
                                         "Number of generation tokens processed.", labels, registry=r),
            "num_constrained_requests": Counter("tokenmill:structured_output_requests",
                                                "Requests with structured outputs (grammar-constrained).",
                                                labels, registry=r),
            "grammar_compile_seconds": Counter("tokenmill:grammar_compile_seconds",
                                               "Time spent compiling structured-output grammars, in seconds.",
                                               labels, registry=r),
            # Speculative decoding, as vLLM's spec_decode metrics.
            "spec_num_drafts": Counter("tokenmill:spec_decode_num_drafts",
                                       "Number of spec decoding drafts (verifications).", labels, registry=r),
            "spec_num_draft_tokens": Counter("tokenmill:spec_decode_num_draft_tokens",
                                             "Number of draft tokens.", labels, registry=r),
            "spec_num_accepted_tokens": Counter("tokenmill:spec_decode_num_accepted_tokens",
                                                "Number of accepted tokens.", labels, registry=r),
            "lora_swaps": Counter("tokenmill:lora_swaps", "LoRA adapters loaded into a device slot.", labels,
                                  registry=r),
        }
        self.lora_requests_info, self.lora_running, self.lora_waiting = lora_families(labels, r)
        self.spec_accepted_per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.", labels + ["position"],
                                             registry=r)
        self._last_per_pos: list[int] = []
        self.expert_tokens = _ExpertTokens.of(self.registry)
        self.request_success = Counter("tokenmill:request_success",
                                       "Count of successfully finished requests.",
                                       labels + ["finished_reason"], registry=r)
        self.request_aborted = Counter("tokenmill:request_aborted",
                                       "Count of requests aborted (client gone or server shutdown).",
                                       labels, registry=r)
        self.time_to_first_token = Histogram("tokenmill:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", labels,
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("tokenmill:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", labels,
                                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("tokenmill:e2e_request_latency_seconds",
                                             "Histogram of end-to-end request latency in seconds.", labels,
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.request_queue_time = Histogram("tokenmill:request_queue_time_seconds",
                                            "Histogram of time spent waiting in the queue, in seconds.", labels,
                                            buckets=_LATENCY_BUCKETS, registry=r)
        if shared is None:
            self.registry._tokenmill_server_metrics = self     # type: ignore[attr-defined]
        else:
            for key, value in vars(shared).items():
                if isinstance(value, MetricWrapperBase) or key == "counters":
                    setattr(self, key, value)
        m = model_name
        self._running = self.num_requests_running.labels(m)
        self._waiting = self.num_requests_waiting.labels(m)
        self._kv = self.kv_cache_usage_perc.labels(m)
        self._counters = {k: c.labels(m) for k, c in self.counters.items()}
        self._last = {k: 0 for k in _COUNTER_FIELDS}
        self._aborted = self.request_aborted.labels(m)
        self._ttft = self.time_to_first_token.labels(m)
        self._itl = self.inter_token_latency.labels(m)
        self._e2e = self.e2e_request_latency.labels(m)
        self._queue = self.request_queue_time.labels(m)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(m, reason)
        self._aborted.inc(0)
        self._lora = LoRAGauges(m, self.lora_requests_info, self.lora_running, self.lora_waiting)

    # ---------------------------------------------------------------- engine stats
    def update_stats(self, stats: Mapping[str, float]) -> None:
        """Set the gauges and advance the counters from the engine's EngineStats fields (a dict:
        the engine process sends the record's fields, see core/engine_process.stats_dict)."""
        self._running.set(stats.get("num_running", 0))
        self._waiting.set(stats.get("num_waiting", 0))
        self._kv.set(stats.get("kv_cache_usage", 0.0))
        self._lora.update(stats)
        for name in _COUNTER_FIELDS:
            value = stats.get(name, 0) or 0     # ints, and float seconds
            delta = value - self._last[name]
            if delta > 0:
                self._counters[name].inc(delta)
            self._last[name] = max(value, self._last[name])
        experts = stats.get("moe_expert_tokens")
        if experts:
            self.expert_tokens.latest[self.model_name] = experts
        per_pos = stats.get("spec_accepted_per_position") or []
        for j, value in enumerate(per_pos):
            if j == len(self._last_per_pos):
                self._last_per_pos.append(0)
            if value > self._last_per_pos[j]:
                self.spec_accepted_per_pos.labels(self.model_name, str(j)).inc(value - self._last_per_pos[j])
                self._last_per_pos[j] = value

    def engine_gone(self) -> None:
        """The engine process died: its last gauges describe nothing now (0 until a new engine reports),
        and a restarted engine counts from zero again (the counters here keep their totals)."""
        self._running.set(0)
        self._waiting.set(0)
        self._kv.set(0.0)
        self._lora.engine_gone()
        self._last = {k: 0 for k in _COUNTER_FIELDS}
        self._last_per_pos = []
        self.expert_tokens.engine_gone(self.model_name)

    # ---------------------------------------------------------------- requests
    def request_finished(self, finish_reason: str, ttft: Optional[float], itls: list[float], e2e: float,
                         queue_time: Optional[float]) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()
        self._observe(ttft, itls, e2e, queue_time)

    def request_was_aborted(self, ttft: Optional[float] = None, itls: Optional[list[float]] = None) -> None:
        self._aborted.inc()
        if ttft is not None:
            self._ttft.observe(ttft)
        for x in itls or ():
            self._itl.observe(x)

    def _observe(self, ttft: Optional[float], itls: list[float], e2e: float, queue_time: Optional[float]) -> None:
        if ttft is not None:
            self._ttft.observe(ttft)
        for x in itls:
            self._itl.observe(x)
        self._e2e.observe(e2e)
        if queue_time is not None and queue_time >= 0:
            self._queue.observe(queue_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
