"""torch_xla Pallas wrapper (package `torch_xla`): `ragged_paged_attention` over a mixed batch.

On a TPU it runs the Pallas kernel. On an XLA CPU device (`PJRT_DEVICE=CPU`), where Mosaic
kernels cannot run, it calls the same op with `use_kernel=False` (torch_xla's own XLA
implementation of the ragged paged attention), so the wrapper and its cache handling are
still exercised for real. Tensors are moved to the XLA device and back when the caller's
device is the CPU. Cache layout (torch_xla's): [num_blocks, block_size, 2 * num_kv_heads, D]
with keys and values interleaved along the head axis.
"""
from __future__ import annotations

import inspect
import os

import torch

from .interface import AttentionConfig, AttentionMetadata
from .package_backend import PackageBackend


class PallasPagedAttention(PackageBackend):
    name = "pallas"
    supported_devices = ("tpu", "xla", "cpu")   # cpu: through torch_xla's CPU PJRT device
    supported_dtypes = (torch.float32, torch.bfloat16)
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supported_graph_modes = ("none", "xla")
    package = "torch_xla"
    package_label = "torch_xla (with ragged_paged_attention)"

    @classmethod
    def import_package(cls) -> None:
        from torch_xla.experimental.custom_kernel import ragged_paged_attention  # noqa: F401

    @classmethod
    def runtime_reasons(cls, config: AttentionConfig) -> list[str]:
        if config.device == "cpu" and os.environ.get("PJRT_DEVICE", "").upper() != "CPU":
            return ["on the CPU torch_xla needs PJRT_DEVICE=CPU"]
        return []

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, 2 * num_kv_heads, head_size)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        import torch_xla.core.xla_model as xm
        from torch_xla.experimental.custom_kernel import ragged_paged_attention
        n = metadata.num_tokens
        on_host = query.device.type != "xla"
        dev = xm.xla_device() if on_host else query.device
        # KV write (interleaved K/V heads), done in torch on the caller's tensor
        nb, bs, hh, d = kv_cache.shape
        flat = kv_cache.view(nb * bs, hh, d)
        kv = torch.stack([key[:n], value[:n]], dim=2).reshape(n, hh, d).to(kv_cache.dtype)
        flat.index_copy_(0, metadata.slot_mapping, kv)
        q = query[:n].to(dev)
        pages = kv_cache.to(dev)
        params = inspect.signature(ragged_paged_attention).parameters
        kwargs = {"sm_scale": self.scale}
        if "sliding_window" in params:
            kwargs["sliding_window"] = self.sliding_window
        if "soft_cap" in params:
            kwargs["soft_cap"] = self.logits_soft_cap
        if "use_kernel" in params:
            kwargs["use_kernel"] = not on_host
        num_seqs = torch.tensor([metadata.num_seqs], dtype=torch.int32)
        out = ragged_paged_attention(q, pages, metadata.seq_lens.to(torch.int32).to(dev),
                                     metadata.block_tables.to(torch.int32).to(dev),
                                     metadata.query_start_loc.to(torch.int32).to(dev), num_seqs.to(dev),
                                     **kwargs)
        out = out.reshape(n, self.num_heads, self.head_size)
        return out.to(query.device) if on_host else out
