"""The parallel state of this process (vLLM's parallel_state): its tensor- and pipeline-parallel
rank and size, the tensor-parallel process group, and the few collectives the layers use.

Every collective goes through torch.distributed with the backend the platform names
(`Platform.distributed_backend()`: gloo on CPU, the accelerator's own library elsewhere). With
one rank (the default, and every tp=pp=1 run) nothing is initialized and every collective is the
identity, so single-process runs pay nothing.

Global rank = pp_rank * tp_size + tp_rank: the ranks of one pipeline stage are consecutive and
form one tensor-parallel group; rank r of stage s sends its hidden states to rank r of stage s+1.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger("tokenmill.distributed")


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None            # torch.distributed ProcessGroup of this stage's ranks; None: world
    # Expert parallelism (core/layers/moe_parallel.py): the experts split over the tp group, and how
    # tokens reach them ("all_reduce" | "all_to_all"); off with one tp rank.
    expert_parallel: bool = False
    expert_exchange: str = "all_reduce"

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank holding this process's tp rank in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank


_STATE = ParallelState()


def get_state() -> ParallelState:
    return _STATE


def tp_rank() -> int:
    return _STATE.tp_rank


def tp_size() -> int:
    return _STATE.tp_size


def free_port() -> int:
    """A free TCP port on loopback for a one-machine rendezvous (tcp://127.0.0.1:PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel_state(rank: int, tp: int, pp: int, backend: str, init_method: str,
                        device: Optional[torch.device] = None, expert_parallel: bool = False,
                        expert_exchange: str = "auto") -> ParallelState:
    """Join the process group (every rank calls this once, before building the model) and make
    the tensor-parallel groups. `init_method`: tcp://host:port or env:// (MASTER_ADDR/PORT).
    `expert_parallel`: mixture-of-experts layers split their experts over the tp group."""
    global _STATE
    import torch.distributed as dist
    world = tp * pp
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if device is not None and device.type not in ("cpu", "meta") and backend != "gloo":
            kwargs["device_id"] = device      # eager NCCL-like init bound to this rank's device
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world, **kwargs)
    group = None
    if pp > 1:     # every rank creates every group, in the same order (torch.distributed's rule)
        for stage in range(pp):
            ranks = list(range(stage * tp, (stage + 1) * tp))
            made = dist.new_group(ranks)
            if rank in ranks:
                group = made
    _STATE = ParallelState(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp, tp_group=group,
                           expert_parallel=expert_parallel and tp > 1,
                           expert_exchange="all_reduce" if expert_exchange == "auto" else expert_exchange)
    logger.info("rank %d of %d: tp rank %d/%d, pp stage %d/%d, backend %s%s", rank, world, _STATE.tp_rank, tp,
                _STATE.pp_rank, pp, backend,
                f", experts split over the tp ranks ({_STATE.expert_exchange})" if _STATE.expert_parallel else "")
    return _STATE


def destroy_parallel_state() -> None:
    global _STATE
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()


# ---------------------------------------------------------------------- collectives
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group (in place; identity with one rank)."""
    if _STATE.tp_size == 1:
        return x
    import torch.distributed as dist
    x = x.contiguous()
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every tp rank's `x` along the last dimension (rank order)."""
    if _STATE.tp_size == 1:
        return x
    import torch.distributed as dist
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x, group=_STATE.tp_group)
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int) -> int:
    """The smallest `value` over every rank (the KV pool: each rank's profile, the min wins)."""
    import torch.distributed as dist
    if _STATE.world_size == 1 or not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.long)
    if dist.get_backend() != "gloo":    # device collectives need a device tensor
        t = t.to(_device_for_collectives())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


_COLLECTIVE_DEVICE: Optional[torch.device] = None


def set_collective_device(device: torch.device) -> None:
    global _COLLECTIVE_DEVICE
    _COLLECTIVE_DEVICE = device


def _device_for_collectives() -> torch.device:
    return _COLLECTIVE_DEVICE or torch.device("cpu")


def send_to_next_stage(x: torch.Tensor) -> Any:
    """Start sending `x` to the same tp rank of the next stage; returns the Work to wait on."""
    import torch.distributed as dist
    return dist.isend(x.contiguous(), dst=_STATE.stage_rank(_STATE.pp_rank + 1))


def recv_from_previous_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=_STATE.stage_rank(_STATE.pp_rank - 1))
    return x


# ---------------------------------------------------------------------- what a model can split
# Where a config states its routed experts (Qwen/OLMoE, Mixtral/GPT-OSS, DeepSeek/GLM-4-MoE).
_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")


def num_routed_experts(hf_config: Any) -> int:
    """The routed experts per mixture-of-experts layer; 0 for a dense model."""
    for name in _EXPERT_COUNT_NAMES:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _tp_problem(hf_config: Any, tp: int, expert_parallel: bool = False) -> Optional[str]:
    heads = getattr(hf_config, "num_attention_heads", None)
    if heads is None:              # no attention (Mamba-2 alone): the family's own checks decide
        return None
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        return f"{heads} attention heads do not divide by {tp}"
    if kv % tp and tp % kv:        # fewer KV heads than ranks: each is replicated on tp/kv ranks
        return f"{kv} KV heads neither divide by {tp} nor divide {tp}"
    experts = num_routed_experts(hf_config)
    if expert_parallel and experts < tp:
        return f"{experts} experts cannot give each of {tp} ranks one (enable_expert_parallel)"
    # The dense MLP's, each expert's and the shared expert's; at expert parallelism the experts are kept
    # whole, so their size (moe_intermediate_size, or Mixtral's / GPT-OSS's intermediate_size) need not divide.
    expert_size = "moe_intermediate_size" if getattr(hf_config, "moe_intermediate_size", None) else "intermediate_size"
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        inter = getattr(hf_config, name, None)
        if expert_parallel and name == expert_size:
            continue
        if inter and inter % tp:
            return f"{name} {inter} does not divide by {tp}"
    return None


def settle_expert_parallel(parallel: Any, hf_config: Any) -> None:
    """vLLM's handling of `enable_expert_parallel` where it cannot apply: with one tensor-parallel rank
    (nothing to split) or on a model without routed experts it is ignored, with a log line."""
    if not parallel.enable_expert_parallel:
        return
    if parallel.tensor_parallel_size == 1:
        logger.info("enable_expert_parallel: ignored with tensor_parallel_size=1 (one rank holds every expert)")
        parallel.enable_expert_parallel = False
    elif num_routed_experts(hf_config) == 0:
        logger.warning("enable_expert_parallel: ignored, %s has no mixture-of-experts layers",
                       getattr(hf_config, "model_type", "the model"))
        parallel.enable_expert_parallel = False


def check_parallel_sizes(hf_config: Any, tp: int, pp: int, expert_parallel: bool = False) -> None:
    """ValueError naming tensor_parallel_size (and the sizes that work) or pipeline_parallel_size
    when the model cannot be split that way."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1 (got {tp}, {pp})")
    if tp > 1:
        problem = _tp_problem(hf_config, tp, expert_parallel)
        if problem:
            heads = hf_config.num_attention_heads
            working = [n for n in range(1, heads + 1) if _tp_problem(hf_config, n, expert_parallel) is None]
            raise ValueError(f"tensor_parallel_size={tp} cannot split this model: {problem}; "
                             f"tensor_parallel_size values that work: {', '.join(map(str, working))}")
    layers = hf_config.num_hidden_layers
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {layers} layers")


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the contiguous layers stage `pp_rank` owns (the first stages take one more
    when the layers do not divide evenly)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
