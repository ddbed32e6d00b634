"""One rank of a tensor/pipeline-parallel engine: joins the process group, builds and loads its
shard of the model, sizes its KV pool, and runs each step the engine broadcasts.

The same `Worker` runs in a process of its own (`worker_main`: the mp executor, core/worker_process.py)
and inside a Ray actor (core/executor_ray.py). The scheduler stays in the engine; a worker only runs
forwards.

Pipeline parallelism: the step's batch is cut into two micro-batches of whole sequences. Stage 0
computes the first, starts sending its hidden states (isend) and goes on with the second while
stage 1 computes the first: two micro-batches are in flight, so no stage waits for a whole step.
"""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import distributed
from .config import EngineConfig
from .step import StepInputs, StepOutput

logger = logging.getLogger("tokenmill.worker")

MICRO_BATCHES = 2


@dataclass
class WorkerSpec:
    config: EngineConfig          # finalized by the engine (max_model_len known)
    rank: int
    local_rank: int               # which of this machine's devices
    init_method: str              # torch.distributed rendezvous: tcp://host:port or env://
    local_world_size: int = 1     # ranks sharing this machine's CPU cores


@dataclass
class WorkerReady:
    num_blocks: int
    bytes_per_block: int
    kv_cache_dtype: torch.dtype
    parameter_bytes: int          # this rank's weights (1/tp of the model's, about)
    pid: int
    forward: str = ""             # the runner's forward (a graph-capture wrapper's class name, or eager)
    kv_layout: Any = None         # the model's KV groups (core/kv_groups.py), the same on every rank


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        from tokenmill.plugins import discovery

        from .loaders.loader import load_model
        from .model_runner import ModelRunner

        config = spec.config
        parallel = config.parallel
        if config.device.num_threads is None and spec.local_world_size > 1:
            # Ranks on one machine share its cores: each takes its part, not all of them.
            config.device.num_threads = max(1, (os.cpu_count() or 1) // spec.local_world_size)
        self.platform = platform = discovery.resolve_platform(config.device.device)
        platform.set_device_for_rank(spec.local_rank)
        platform.check_and_update_config(config)
        platform.set_seed(config.model.seed)
        self.state = distributed.init_parallel_state(
            spec.rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
            platform.distributed_backend(), spec.init_method, platform.device(),
            expert_parallel=parallel.enable_expert_parallel, expert_exchange=parallel.expert_parallel_exchange)
        distributed.set_collective_device(platform.device())

        def choose_backend(attn_config: Any) -> type:
            return discovery.select_attention_backend(platform, attn_config, config.device.attention_backend)

        bundle = load_model(config, platform, choose_backend)
        self.model = bundle.model
        self.runner = ModelRunner(config, platform, bundle.model, bundle.dtype, None)
        self.hidden_size = int(bundle.hf_config.hidden_size)
        # Only one rank sends results back: the first tp rank of the last stage.
        self.returns_results = self.state.is_last_stage and self.state.tp_rank == 0
        # Each stage counts its own MoE layers' tokens per expert: [all layers, experts] summed into the
        # result rank after each step (pp > 1), so the counts cover every stage.
        experts = distributed.num_routed_experts(bundle.hf_config)
        self.expert_rows = (int(bundle.hf_config.num_hidden_layers), experts) if experts else None

    def ready(self) -> WorkerReady:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return WorkerReady(self.runner.num_blocks, self.runner.bytes_per_block, self.runner.kv_cache_dtype,
                           params, os.getpid(), type(self.runner.forward).__name__, self.runner.kv_layout)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> Optional[StepOutput]:
        if self.state.pp_size == 1:
            out = self.runner.execute_inputs(inputs)
        else:
            out = self._execute_pipelined(inputs)
            if self.expert_rows is not None:
                counts = self._expert_tokens_of_all_stages()
                if out is not None:
                    out.expert_tokens = counts
        if out is not None and out.expert_tokens is not None:
            out.expert_tokens = out.expert_tokens.cpu()        # pickled to the engine
        return out if self.returns_results else None

    def _expert_tokens_of_all_stages(self) -> torch.Tensor:
        """Every stage's counts summed into the result rank (every rank takes part; other tp ranks add 0)."""
        import torch.distributed as dist
        assert self.expert_rows is not None
        total = torch.zeros(self.expert_rows, dtype=torch.long, device=self.runner.device)
        mine = self.runner.expert_tokens
        if mine is not None:
            rows = min(total.shape[0], mine.counts.shape[0])
            total[:rows] = mine.counts[:rows]
        dist.reduce(total, dst=(self.state.pp_size - 1) * self.state.tp_size)
        return total

    def _execute_pipelined(self, inputs: StepInputs) -> Optional[StepOutput]:
        runner, state = self.runner, self.state
        parts = inputs.split(MICRO_BATCHES)
        sending: list[tuple[Any, torch.Tensor]] = []     # (work, tensor kept alive until sent)
        outputs = []
        for part in parts:
            step = runner.prepare(part)
            intermediate = None
            if not state.is_first_stage:
                intermediate = distributed.recv_from_previous_stage(
                    (2, step.total_rows, self.hidden_size), runner.dtype, runner.device)
            hidden = runner.count_experts(step, self.model(step.input_ids, step.positions, step.metadata,
                                                           intermediate))
            if state.is_last_stage:
                outputs.append(runner.finish(step, hidden))
            else:
                sending.append((distributed.send_to_next_stage(hidden), hidden))
        for work, _ in sending:
            work.wait()
        if not state.is_last_stage:
            return None
        return StepOutput.merge(outputs, [len(p.entries) for p in parts])

    def shutdown(self) -> None:
        distributed.destroy_parallel_state()


def worker_main(conn: Any, spec: WorkerSpec, log_level: int) -> int:
    """The mp executor's worker (core/worker_process.py runs it, set to die with the engine process):
    build the worker, answer ("ready", WorkerReady) or ("failed", traceback), then run
    ("execute", StepInputs) until ("shutdown",) or EOF. Returns the process's exit code."""
    import signal

    # Ctrl-C reaches the whole process group: it is the server's (or the script's), which shuts us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        logging.basicConfig(level=log_level,
                            format=f"%(asctime)s %(levelname)s %(name)s [rank {spec.rank}]: %(message)s")
        worker = Worker(spec)
        _send(conn, ("ready", worker.ready()))
    except BaseException:
        _send(conn, ("failed", traceback.format_exc()))
        return 1
    code = 0
    try:
        while True:
            message = conn.recv()
            if message[0] == "shutdown":
                break
            out = worker.execute(message[1])
            if out is not None:
                _send(conn, ("out", out))
    except (EOFError, OSError):
        pass      # the engine is gone
    except BaseException:
        code = 1
        try:
            _send(conn, ("failed", traceback.format_exc()))
        except Exception:
            pass
    finally:
        try:
            worker.shutdown()
        except Exception:
            pass
    return code


def _send(conn: Any, message: Any) -> None:
    # Plain pickle: tensors travel inline in the pipe (multiprocessing's own pickler would pass
    # torch storages as shared-memory file descriptors).
    import pickle
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
