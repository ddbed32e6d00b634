"""The engine's LoRA section (vLLM's --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# Ranks vLLM accepts for --max-lora-rank; any positive integer works here, these are the usual ones.
MAX_LORA_RANK_LIMIT = 512


@dataclass
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 1                   # adapters resident on the device at once (slots)
    max_lora_rank: int = 16              # slots are sized for this rank; a larger adapter is refused
    max_cpu_loras: Optional[int] = None  # adapters kept in host memory; default: max_loras
    # Adapters known from the start, as (name, path) pairs (the server's --lora-modules).
    lora_modules: Optional[list] = None

    def validate(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be an integer in 1..{MAX_LORA_RANK_LIMIT}, "
                             f"got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None:
            if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < 1:
                raise ValueError(f"max_cpu_loras must be an integer >= 1, got {self.max_cpu_loras!r}")
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        names = [name for name, _ in parse_lora_modules(self.lora_modules)]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be unique, got {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def parse_lora_modules(modules: Any) -> list[tuple[str, str]]:
    """--lora-modules entries: "name=path", {"name": .., "path": ..} (or its JSON text), (name, path)."""
    import json
    pairs = []
    for item in modules or []:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except ValueError as e:
                raise ValueError(f"lora_modules entry {item!r} is not valid JSON: {e}") from None
        if hasattr(item, "lora_name") and hasattr(item, "lora_path"):     # a LoRARequest
            pairs.append((item.lora_name, item.lora_path))
        elif isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str):
            pairs.append((item["name"], item["path"]))
        elif isinstance(item, str) and "=" in item and item.split("=", 1)[0]:
            name, path = item.split("=", 1)
            pairs.append((name, path))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            pairs.append((str(item[0]), str(item[1])))
        else:
            raise ValueError(f"lora_modules entries must be name=path or {{\"name\": .., \"path\": ..}}, got {item!r}")
    return pairs
