"""LoRA metrics (issue 14), after vLLM's `vllm:lora_requests_info`.

  tokenmill:lora_requests_info{model_name, running_lora_adapters, waiting_lora_adapters, max_lora}
      a gauge whose labels list the adapters with running / waiting requests (comma-separated, as
      vLLM's) and the slot count; its value is the time of the update. One series at a time.
  tokenmill:lora_num_requests_running{model_name, lora_name}   requests running on each adapter
  tokenmill:lora_num_requests_waiting{model_name, lora_name}   requests waiting (e.g. for a slot)
  tokenmill:lora_swaps_total{model_name}   adapters loaded into a device slot (metrics.py's counters)
"""
from __future__ import annotations

import time
from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Gauge

INFO_LABELS = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]


def lora_families(labels: list[str], registry: CollectorRegistry) -> tuple[Gauge, Gauge, Gauge]:
    info = Gauge("tokenmill:lora_requests_info", "Running stats on LoRA requests.", labels + INFO_LABELS,
                 registry=registry)
    running = Gauge("tokenmill:lora_num_requests_running", "Requests running on each LoRA adapter.",
                    labels + ["lora_name"], registry=registry)
    waiting = Gauge("tokenmill:lora_num_requests_waiting", "Requests waiting to run on each LoRA adapter.",
                    labels + ["lora_name"], registry=registry)
    return info, running, waiting


class LoRAGauges:
    """One model's LoRA series, set from each step's engine stats (nothing without --enable-lora)."""

    def __init__(self, model_name: str, info: Gauge, running: Gauge, waiting: Gauge) -> None:
        self.model_name = model_name
        self.info, self.running, self.waiting = info, running, waiting
        self._info_labels: Any = None
        self._names: dict[str, set[str]] = {"running": set(), "waiting": set()}

    def update(self, stats: Mapping[str, Any]) -> None:
        max_loras = stats.get("max_loras") or 0
        if not max_loras:
            return
        running, waiting = stats.get("lora_running") or {}, stats.get("lora_waiting") or {}
        labels = (self.model_name, ",".join(sorted(running)), ",".join(sorted(waiting)), str(max_loras))
        if labels != self._info_labels:
            if self._info_labels is not None:
                self.info.remove(*self._info_labels)
            self._info_labels = labels
        self.info.labels(*labels).set(time.time())
        for kind, gauge, now in (("running", self.running, running), ("waiting", self.waiting, waiting)):
            for name in self._names[kind] | set(now):   # adapters gone idle read 0, not their last count
                gauge.labels(self.model_name, name).set(now.get(name, 0))
            self._names[kind] |= set(now)

    def engine_gone(self) -> None:
        self.update({"max_loras": int(self._info_labels[3]) if self._info_labels else 0})
