"""Data parallelism (`serve --data-parallel-size N`): N engine processes for one model behind one API.

`ReplicaSet` has the EngineClient interface the serving code uses (add, abort, admission counts,
ping, start/attach/respawn/shutdown, `info`, `tokenizer`, `on_stats`, `on_dead`), so everything
above it is unchanged. Each request group goes to one replica, chosen by prefix_router.py: the
longest cached prefix of its prompt, then the least loaded. Each replica is its own EngineClient
(its own process, pipe and request table); an abort is offered to every replica, and only the
one holding the request acts on it.

The model's metrics add up the replicas (gauges summed, KV use averaged, counters as running
totals that survive a replica's restart); `tokenmill:dp_*` series carry a `replica` label.
A replica that dies fails only its own requests; the others keep serving, and the app is told
(`on_dead`) as for a single engine: it exits, or with --restart-engine restarts the dead replicas.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable, Iterable, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from ...core.engine_process import EngineInfo
from .engine_client import EngineClient, EngineDeadError, NewRequest
from .prefix_router import PrefixShadow, ReplicaLoad, choose_replica, prompt_block_hashes

logger = logging.getLogger("tokenmill.serve")

_GAUGES = ("num_running", "num_waiting")        # summed over the replicas; kv_cache_usage is averaged
_NOT_COUNTERS = _GAUGES + ("kv_cache_usage", "max_loras")   # max_loras: each replica's, the same


class _DPMetrics:
    """The per-replica series, registered once per registry (several models share one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name", "replica"]
        r = registry
        self.routed = Counter("tokenmill:dp_routed_requests", "Requests routed to each data-parallel replica, "
                              "by reason: prefix (its cached prefix) or load (the least loaded).",
                              labels + ["reason"], registry=r)
        self.running = Gauge("tokenmill:dp_replica_num_requests_running", "Requests running on each replica.",
                             labels, registry=r)
        self.waiting = Gauge("tokenmill:dp_replica_num_requests_waiting", "Requests waiting on each replica.",
                             labels, registry=r)
        self.kv = Gauge("tokenmill:dp_replica_kv_cache_usage_perc", "KV-cache usage of each replica (1 = 100%).",
                        labels, registry=r)
        self.prefix_hits = Counter("tokenmill:dp_replica_prefix_cache_hits", "Prefix-cache hits on each replica, "
                                   "in tokens.", labels, registry=r)

    @classmethod
    def of(cls, registry: CollectorRegistry) -> "_DPMetrics":
        families = getattr(registry, "_tokenmill_dp_metrics", None)
        if families is None:
            families = cls(registry)
            registry._tokenmill_dp_metrics = families     # type: ignore[attr-defined]
        return families


class ReplicaSet:
    """`num_replicas` EngineClients of the same engine kwargs, behind one EngineClient-shaped object."""

    def __init__(self, engine_kwargs: dict[str, Any], num_replicas: int, factory: Optional[str] = None,
                 log_level: int = logging.INFO) -> None:
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self.engine_kwargs, self.factory, self.log_level = engine_kwargs, factory, log_level
        self.replicas = [EngineClient(dict(engine_kwargs), factory=factory, log_level=log_level)
                         for _ in range(num_replicas)]
        self.info: Optional[EngineInfo] = None
        self.tokenizer: Any = None
        self.stats: dict[str, float] = {}
        self.on_stats: Optional[Callable[[dict[str, float]], None]] = None
        self.on_dead: Optional[Callable[[str], None]] = None
        self.shadows: list[PrefixShadow] = []
        self._attached = [False] * num_replicas
        self._replica_stats: list[dict[str, float]] = [{} for _ in range(num_replicas)]
        self._offsets: list[dict[str, float]] = [{} for _ in range(num_replicas)]   # counters before a restart
        self._hits_reported = [0.0] * num_replicas    # what tokenmill:dp_replica_prefix_cache_hits counted
        self._base: dict[str, float] = {}       # the totals when the model's metrics last restarted from zero
        self._metrics: Optional[_DPMetrics] = None
        self._spawned = False
        self._model_name = ""

    # -------------------------------------------------------------- lifecycle
    def spawn(self) -> None:
        for replica in self.replicas:
            replica.spawn()
        self._spawned = True

    def start(self, timeout: Optional[float] = None) -> EngineInfo:
        """Spawn every replica (they load their models at the same time), then wait for each."""
        if not self._spawned:
            self.spawn()
        try:
            infos = [replica.start(timeout) for replica in self.replicas]
        except BaseException:
            for replica in self.replicas:
                replica.shutdown(timeout=1.0)
            raise
        for i, replica in enumerate(self.replicas):
            replica.on_stats = lambda stats, i=i: self._stats_from(i, stats)
            replica.on_dead = lambda reason, i=i: self._replica_died(i, reason)
        self.shadows = [PrefixShadow(max(1, info.num_kv_blocks)) for info in infos]
        # What admission and logging read: the replicas together (each has the same model).
        self.info = dataclasses.replace(infos[0], max_num_seqs=sum(i.max_num_seqs for i in infos),
                                        num_kv_blocks=sum(i.num_kv_blocks for i in infos))
        self.tokenizer = self.replicas[0].tokenizer
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        for i, replica in enumerate(self.replicas):
            if not self._attached[i] and replica.info is not None and not replica.is_closing:
                replica.attach(loop)
                self._attached[i] = True

    def detach(self) -> None:
        """Stop reading the dead replicas' pipes (the live ones keep serving)."""
        for i, replica in enumerate(self.replicas):
            if self._attached[i] and not replica.is_alive:
                replica.detach()
                self._attached[i] = False

    def respawn(self, timeout: Optional[float] = None) -> EngineInfo:
        """Start the dead replicas again (blocking; `attach` afterwards)."""
        for i, replica in enumerate(self.replicas):
            if not replica.is_alive and not self._attached[i]:
                logger.warning("restarting data-parallel replica %d", i)
                replica.respawn(timeout)
                self.shadows[i].clear()
        assert self.info is not None
        return self.info

    def shutdown(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    def bind_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """Publish the per-replica series in `registry` under `model_name` (the app calls it)."""
        self._metrics, self._model_name = _DPMetrics.of(registry), model_name
        for i in range(len(self.replicas)):
            for reason in ("prefix", "load"):
                self._metrics.routed.labels(model_name, str(i), reason).inc(0)

    # -------------------------------------------------------------- state
    @property
    def is_alive(self) -> bool:
        return any(replica.is_alive for replica in self.replicas)

    @property
    def is_closing(self) -> bool:
        return all(replica.is_closing for replica in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    @property
    def num_waiting_estimate(self) -> int:
        return self.num_waiting_after(0)

    def num_waiting_after(self, num_new: int, max_running: Optional[int] = None) -> int:
        """The replicas' waiting requests, plus those `num_new` would add on the replica with most room."""
        alive = [r for r in self.replicas if r.is_alive]
        if not alive:
            return num_new
        now = [r.num_waiting_after(0) for r in alive]
        added = min(r.num_waiting_after(num_new) - w for r, w in zip(alive, now))
        return sum(now) + added

    async def ping(self, timeout: float = 10.0) -> bool:
        """True when every live replica answers (and one at least is alive)."""
        alive = [r for r in self.replicas if r.is_alive]
        if not alive:
            return False
        return all(await asyncio.gather(*(r.ping(timeout) for r in alive)))

    def replica_loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(r.num_in_flight, float(r.stats.get("kv_cache_usage", 0.0) or 0.0), r.is_alive,
                            len(shadow)) for r, shadow in zip(self.replicas, self.shadows)]

    # -------------------------------------------------------------- requests
    def add(self, requests: Sequence[NewRequest], priority: int = 0) -> None:
        """Send one group (the prompts of one HTTP request) to one replica: the one with the longest cached
        prefix of its first prompt, else the least loaded."""
        if self.info is None or not self.is_alive:
            raise EngineDeadError("no data-parallel replica is running")
        block_size = self.info.block_size
        hashes = [prompt_block_hashes(_token_ids(prompt), block_size, _salt(prompt)) for _, prompt, _, _ in requests]
        first = hashes[0] if hashes else []
        decision = choose_replica([shadow.match(first) for shadow in self.shadows], self.replica_loads())
        self.replicas[decision.replica].add(requests, priority)
        shadow = self.shadows[decision.replica]
        for prompt_hashes in hashes:
            shadow.insert(prompt_hashes)
        if self._metrics is not None:
            self._metrics.routed.labels(self._model_name, str(decision.replica), decision.reason).inc(len(requests))

    async def call(self, op: str, *args: Any, timeout: float = 120.0) -> Any:
        """A command every live replica obeys (load_lora / unload_lora: each replica serves the same adapters);
        the first replica's answer, or the first refusal."""
        alive = [r for r in self.replicas if r.is_alive]
        if not alive:
            raise EngineDeadError("no data-parallel replica is running")
        results = await asyncio.gather(*(r.call(op, *args, timeout=timeout) for r in alive), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results[0]

    def abort(self, request_ids: Iterable[str]) -> None:
        rids = list(request_ids)
        for replica in self.replicas:      # each skips the ids it does not hold
            replica.abort(rids)

    def abort_all(self, exc: BaseException) -> None:
        for replica in self.replicas:
            replica.abort_all(exc)

    # -------------------------------------------------------------- stats and deaths
    def _stats_from(self, i: int, stats: dict[str, float]) -> None:
        last, offsets = self._replica_stats[i], self._offsets[i]
        for key, value in stats.items():
            if key not in _NOT_COUNTERS and isinstance(value, (int, float)):
                if value < last.get(key, 0):       # the replica restarted: its counters began again at zero
                    offsets[key] = offsets.get(key, 0) + last[key]
        self._replica_stats[i] = dict(stats)
        if self._metrics is not None:
            m, labels = self._metrics, (self._model_name, str(i))
            m.running.labels(*labels).set(stats.get("num_running", 0))
            m.waiting.labels(*labels).set(stats.get("num_waiting", 0))
            m.kv.labels(*labels).set(stats.get("kv_cache_usage", 0.0))
            hits = stats.get("prefix_cache_hits", 0) + offsets.get("prefix_cache_hits", 0)
            if hits > self._hits_reported[i]:
                m.prefix_hits.labels(*labels).inc(hits - self._hits_reported[i])
                self._hits_reported[i] = hits
        self.stats = self._aggregate()
        if self.on_stats is not None:
            self.on_stats(self.stats)

    def _aggregate(self) -> dict[str, float]:
        """The replicas as one engine: gauges summed, KV use averaged over the live replicas, counters as
        totals since the model's metrics last started from zero."""
        out: dict[str, Any] = {}
        alive = [s for r, s in zip(self.replicas, self._replica_stats) if r.is_alive]
        for key in _GAUGES:
            out[key] = sum(s.get(key, 0) for s in alive)
        out["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for s in alive) / max(1, len(alive))
        out["max_loras"] = max((s.get("max_loras") or 0 for s in alive), default=0)
        for stats in alive:         # per-name gauges (lora_running, lora_waiting): summed name by name
            for key, value in stats.items():
                if isinstance(value, dict):
                    acc = out.setdefault(key, {})
                    for name, count in value.items():
                        if isinstance(count, list):      # moe_expert_tokens: per layer, expert by expert
                            row = acc.setdefault(name, [0] * len(count))
                            acc[name] = [a + b for a, b in zip(row, count)]
                        else:
                            acc[name] = acc.get(name, 0) + count
        for stats, offsets in zip(self._replica_stats, self._offsets):
            for key, value in stats.items():
                if key in _NOT_COUNTERS:
                    continue
                if isinstance(value, (int, float)):
                    out[key] = out.get(key, 0) + value + offsets.get(key, 0)
                elif isinstance(value, list):      # spec_accepted_per_position: elementwise
                    acc = out.setdefault(key, [])
                    acc.extend([0] * (len(value) - len(acc)))
                    for j, v in enumerate(value):
                        acc[j] += v
        for key, base in self._base.items():
            if isinstance(out.get(key), (int, float)):
                out[key] = max(0, out[key] - base)
        return out

    def _replica_died(self, i: int, reason: str) -> None:
        logger.error("data-parallel replica %d is dead: %s", i, reason)
        # Its counters so far stay in the totals (as an offset), its gauges describe nothing now.
        for key, value in self._replica_stats[i].items():
            if isinstance(value, (int, float)) and key not in _NOT_COUNTERS:
                self._offsets[i][key] = self._offsets[i].get(key, 0) + value
        self._replica_stats[i] = {}
        if i < len(self.shadows):
            self.shadows[i].clear()
        if self._metrics is not None:
            for gauge in (self._metrics.running, self._metrics.waiting, self._metrics.kv):
                gauge.labels(self._model_name, str(i)).set(0)
        # The app zeroes the model's metrics' memory of the totals (metrics.engine_gone): start from here.
        self._base = {}
        self._base = {k: v for k, v in self._aggregate().items() if isinstance(v, (int, float))}
        if self.on_dead is not None:
            self.on_dead(f"replica {i}: {reason}")


def _salt(prompt: Any) -> Optional[int]:
    """A LoRA request's prompts form their own prefix chains (as in the engine's cache)."""
    lora = prompt.get("lora_request") if isinstance(prompt, dict) else None
    return None if lora is None else hash(("lora", str(lora)))


def _token_ids(prompt: Any) -> list[int]:
    if isinstance(prompt, dict):
        return list(prompt.get("prompt_token_ids") or [])
    return list(prompt) if isinstance(prompt, (list, tuple)) else []
