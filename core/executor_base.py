"""The executor interface (core/executor.py explains the three kinds) and the error a dead worker
raises."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from .errors import EngineDeadError
from .step import ScheduledBatch, StepInputs, StepOutput

if TYPE_CHECKING:
    from .kv_groups import KVLayout
    from .model_runner import ModelRunner

__all__ = ["EngineDeadError", "Executor"]


class Executor:
    """execute(batch) -> StepOutput; the KV pool every rank holds (the min over ranks)."""
    num_blocks: int
    bytes_per_block: int
    kv_cache_dtype: torch.dtype
    kv_layout: Optional["KVLayout"] = None      # the model's KV groups (core/kv_groups.py)
    runner: Optional["ModelRunner"] = None      # in-process only
    lora: Any = None                            # LoRA runs in process only (refused at tp/pp > 1)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        return self.execute_inputs(StepInputs.from_batch(batch))

    def execute_inputs(self, inputs: StepInputs) -> StepOutput:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise EngineDeadError when a worker is gone."""

    def shutdown(self) -> None:
        pass

    def worker_pids(self) -> list[int]:
        return []
