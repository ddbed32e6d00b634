"""The Neuron platform: AWS Inferentia2 / Trainium through torch_neuronx (an XLA device).

* attention: reference (gathers from the paged cache with static shapes);
* memory: static: every sequence slot gets blocks for the whole context up front, checked
  against the NeuronCore memory share (platforms/memory.py: static_kv_blocks);
* graph capture: bucketed compilation (coarser buckets than TPU: Neuron compiles are slow);
* distributed: xla.
"""
from __future__ import annotations

import logging
import os

from . import _probe
from .interface import Availability, DecodeProgram, MemoryProfiler, blocks_from_budget
from .memory import GiB, static_kv_blocks
from .xla_common import XlaBucketedProgram, XlaPlatform, probe_xla_runtime, xla_mark_step

logger = logging.getLogger("tokenmill.platforms.neuron")

# HBM per NeuronCore (Inf2 / Trn1: 32 GiB per chip, 2 cores per chip). Override with the env var.
DEFAULT_NEURON_CORE_MEMORY = 16 * GiB
NEURON_MEMORY_ENV = "TOKENMILL_NEURON_CORE_MEMORY"


class NeuronStaticMemoryProfiler(MemoryProfiler):
    def __init__(self, core_memory: int | None = None) -> None:
        self.core_memory = core_memory or int(os.environ.get(NEURON_MEMORY_ENV, DEFAULT_NEURON_CORE_MEMORY))

    def num_kv_blocks(self, config, bytes_per_block, profile_forward):
        if config.cache.num_gpu_blocks_override:
            return int(config.cache.num_gpu_blocks_override)
        if config.cache.kv_cache_memory is not None:
            return blocks_from_budget(config.cache.kv_cache_memory, bytes_per_block)
        blocks = static_kv_blocks(config.scheduler.max_num_seqs, config.model.max_model_len or 2048,
                                  config.cache.block_size, bytes_per_block, self.core_memory,
                                  config.cache.gpu_memory_utilization)
        logger.info("neuron static KV cache: %d blocks of %d bytes", blocks, bytes_per_block)
        return blocks


class NeuronPlatform(XlaPlatform):
    """AWS Inferentia2/Trainium through torch_neuronx: bucketed compilation, static memory."""
    name = "neuron"
    priority = 85
    dispatch_key = "neuron"

    @classmethod
    def probe(cls) -> Availability:
        return probe_xla_runtime("neuron", "torch_neuronx", cls._probe_device)

    @classmethod
    def _probe_device(cls) -> Availability:
        nodes = _probe.device_nodes("/dev/neuron[0-9]*")
        if not nodes:
            return Availability.no("torch_neuronx is installed but no Neuron device was found (no /dev/neuron* "
                                   "node; is the aws-neuronx-dkms driver loaded?)")
        try:
            import torch_neuronx  # noqa: F401
        except Exception as exc:
            return Availability.no(f"torch_neuronx failed to import: {_probe.exc_text(exc)}")
        version = _probe.dist_version("torch-neuronx", "torch_neuronx") or "?"
        return Availability.yes(f"{len(nodes)} Neuron device(s), torch_neuronx {version}")

    def attention_backends(self) -> list[str]:
        return ["reference"]

    def memory_profiler(self) -> MemoryProfiler:
        return NeuronStaticMemoryProfiler()

    def decode_program(self, config) -> DecodeProgram:
        if config.device.graph_capture not in (None, "xla"):
            raise ValueError(f"graph_capture {config.device.graph_capture!r} is not offered by the neuron platform "
                             f"(offers ['xla'])")
        return XlaBucketedProgram(min_bucket=128, precompile=not config.device.enforce_eager,
                                  compile_fn=None, step_fn=xla_mark_step,
                                  max_num_batched_tokens=config.scheduler.max_num_batched_tokens or 2048)
