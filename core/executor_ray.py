"""One Ray actor per rank (`distributed_executor_backend="ray"`): the same Worker as the mp
executor (core/worker.py), placed by Ray — on this machine, or across a cluster's machines.

The cluster: `ray.init(address=RAY_ADDRESS)` when the variable is set (a cluster started with
`ray start --head` / `ray start --address ...`, docs/distributed.md), else a local Ray started for
this engine. The actors are placed in one placement group, PACKed, so consecutive ranks (one
tensor-parallel group) share a machine where they fit. Rank 0's actor picks the torch.distributed
rendezvous address (its node's IP and a free port); the ranks then talk only through
torch.distributed, Ray carries the per-step StepInputs and the results.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from . import distributed
from .config import EngineConfig
from .executor_base import EngineDeadError, Executor
from .step import StepInputs, StepOutput
from .worker import Worker, WorkerReady, WorkerSpec

logger = logging.getLogger("tokenmill.executor")


class RayWorker:
    """The actor body: a Worker built on `init`, then one `execute` per step."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node(self) -> tuple[str, str]:
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def rendezvous(self) -> str:
        import ray
        return f"tcp://{ray.util.get_node_ip_address()}:{distributed.free_port()}"

    def init(self, spec: WorkerSpec) -> WorkerReady:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s %(name)s [rank {spec.rank}]: %(message)s")
        self.worker = Worker(spec)
        return self.worker.ready()

    def execute(self, inputs: StepInputs) -> "StepOutput | None":
        return self.worker.execute(inputs)

    def pid(self) -> int:
        return os.getpid()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: Any) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'tokenmill[ray]'") from None
        self._ray = ray
        parallel = config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        world = tp * pp
        self.result_rank = (pp - 1) * tp
        self._started_ray = False
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                ray.init(num_cpus=max(world, os.cpu_count() or 1), include_dashboard=False)
                self._started_ray = True
        on_device = platform.device().type != "cpu"     # each rank then needs a device of its own
        bundle = {"GPU": 1} if on_device else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        ray.get(self._pg.ready(), timeout=300)
        actor_cls = ray.remote(RayWorker)
        self.actors = [actor_cls.options(
            num_cpus=0 if on_device else 1, num_gpus=1 if on_device else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                                 placement_group_bundle_index=rank),
            name=None).remote() for rank in range(world)]
        self._closed = False
        try:
            nodes = ray.get([a.node.remote() for a in self.actors])
            init_method = ray.get(self.actors[0].rendezvous.remote())
            per_node = {node: sum(1 for n, _ in nodes if n == node) for node, _ in nodes}
            specs = [WorkerSpec(config=config, rank=rank, local_rank=0 if on_device else rank,
                                init_method=init_method, local_world_size=per_node[nodes[rank][0]])
                     for rank in range(world)]
            readies: list[WorkerReady] = ray.get([a.init.remote(s) for a, s in zip(self.actors, specs)])
        except Exception as exc:
            self.shutdown()
            raise RuntimeError(f"starting the Ray workers failed: {exc}") from exc
        self.readies = readies
        self.num_blocks = min(r.num_blocks for r in readies)
        self.bytes_per_block = readies[0].bytes_per_block
        self.kv_cache_dtype = readies[0].kv_cache_dtype
        self.kv_layout = readies[0].kv_layout
        logger.info("%d Ray workers (tp %d x pp %d) on %d node(s): %s", world, tp, pp, len(set(n for n, _ in nodes)),
                    [ip for _, ip in nodes])

    def execute_inputs(self, inputs: StepInputs) -> StepOutput:
        ray = self._ray
        if self._closed:
            raise EngineDeadError("the engine's Ray workers are shut down")
        shared = ray.put(inputs)           # serialized once, read by every actor
        refs = [a.execute.remote(shared) for a in self.actors]
        result_ref = refs[self.result_rank]
        result = None
        pending = list(refs)
        try:
            while pending:       # one at a time: the first failure ends the step, not the slowest rank
                done, pending = ray.wait(pending, num_returns=1)
                value = ray.get(done[0])
                if done[0] == result_ref:
                    result = value
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            self.shutdown()
            raise EngineDeadError(f"a Ray worker failed: {exc}") from None
        return result

    def worker_pids(self) -> list[int]:
        return self._ray.get([a.pid.remote() for a in self.actors])

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        ray = self._ray
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        try:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._pg)
        except Exception:
            pass
        if self._started_ray:
            ray.shutdown()

