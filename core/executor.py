"""How the engine runs its forwards: one interface, three ways (vLLM's executors).

* `UniProcExecutor` — tp = pp = 1: the model runner in the engine's own process, as before
  (no extra process, no message per step).
* `MultiprocExecutor` (core/executor_mp.py, `distributed_executor_backend="mp"`) — one worker
  process per rank on this machine (core/worker_process.py).
* `RayExecutor` (core/executor_ray.py, `"ray"`) — one Ray actor per rank, on a running cluster
  (RAY_ADDRESS) or a local one: the way to span machines.

The scheduler stays in the engine. Each step the executor sends every rank the same small
`StepInputs` (core/step.py) and gets the logits back from one rank. A rank that dies ends
the engine with `EngineDeadError` (never a hang): the engine process then reports "fatal" and the
server's /health turns 503.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .config import EngineConfig
from .executor_base import EngineDeadError, Executor

__all__ = ["EngineDeadError", "Executor", "UniProcExecutor", "make_executor"]

if TYPE_CHECKING:
    from .model_runner import ModelRunner
    from .step import ScheduledBatch, StepOutput

logger = logging.getLogger("tokenmill.executor")

EXECUTOR_BACKENDS = ("mp", "ray", "uni")


class UniProcExecutor(Executor):
    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner
        self.num_blocks = runner.num_blocks
        self.bytes_per_block = runner.bytes_per_block
        self.kv_cache_dtype = runner.kv_cache_dtype
        self.kv_layout = runner.kv_layout
        self.state_slots = runner.num_state_slots     # recurrent-state slots (hybrid models), 0: none
        self.state_checkpoints = runner.num_state_checkpoints     # their prefix-cache checkpoints

    def execute(self, batch: "ScheduledBatch") -> "StepOutput":
        return self.runner.execute(batch)

    @property
    def lora(self) -> Any:
        return self.runner.lora

    @lora.setter
    def lora(self, manager: Any) -> None:     # the engine's LoRA manager: the runner maps rows per step
        self.runner.lora = manager


def make_executor(config: EngineConfig, platform: Any, bundle: Any) -> Executor:
    """The executor `config.parallel` asks for. `bundle`: load_model's, built (tp = pp = 1) or
    metadata only (the workers build their shards)."""
    parallel = config.parallel
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    backend = parallel.distributed_executor_backend or ("uni" if world == 1 else "mp")
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                         f"got {backend!r}")
    if backend == "uni":
        if world != 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank: tensor_parallel_size and "
                             "pipeline_parallel_size must be 1")
        from .model_runner import ModelRunner
        return UniProcExecutor(ModelRunner(config, platform, bundle.model, bundle.dtype, bundle.pooler_config))
    if bundle.pooler_config is not None:
        raise ValueError("tensor_parallel_size/pipeline_parallel_size > 1 serve generative models only "
                         "(pooling keeps per-sequence state in the engine process)")
    if backend == "ray":
        from .executor_ray import RayExecutor
        return RayExecutor(config, platform)
    from .executor_mp import MultiprocExecutor
    return MultiprocExecutor(config)
