"""Intel Extension for PyTorch wrapper (package `intel_extension_for_pytorch`): IPEX's paged
attention kernels, which exist for the CPU (and XPU). Selected only where IPEX imports.

Cache layout is IPEX's: [2, num_blocks, num_kv_heads, block_size, head_size]. Keys/values are
written with `PagedAttention.reshape_and_cache`; decodes use
`PagedAttention.single_query_cached_kv_attention`, prefill chunks (with or without cached
context) `PagedAttention.flash_attn_varlen_func` over the paged cache.
"""
from __future__ import annotations

import torch

from .interface import AttentionMetadata
from .package_backend import PackageBackend


def _ipex_paged():
    from intel_extension_for_pytorch.llm.modules import PagedAttention
    return PagedAttention


class IpexPagedAttention(PackageBackend):
    name = "ipex"
    supported_devices = ("cpu", "xpu")
    supported_dtypes = (torch.float32, torch.bfloat16)
    package = "intel_extension_for_pytorch"

    @classmethod
    def import_package(cls) -> None:
        _ipex_paged()

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        pa = _ipex_paged()
        n = metadata.num_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        pa.reshape_and_cache(key[:n].contiguous(), value[:n].contiguous(), key_cache, value_cache,
                             metadata.slot_mapping)
        out = torch.empty_like(query[:n])
        group = self.num_heads // self.num_kv_heads
        nd = metadata.num_decodes
        bt = metadata.block_tables.to(torch.int32)
        seq_lens = metadata.seq_lens.to(torch.int32)
        if nd:
            head_mapping = torch.arange(self.num_kv_heads, dtype=torch.int32,
                                        device=query.device).repeat_interleave(group)
            dec_out = torch.empty_like(query[:nd])
            pa.single_query_cached_kv_attention(dec_out, query[:nd].contiguous(), key_cache, value_cache,
                                                head_mapping, self.scale, bt[:nd].contiguous(),
                                                seq_lens[:nd].contiguous(), metadata.block_size,
                                                max(metadata.seq_lens_cpu[:nd]), None)
            out[:nd] = dec_out
        if metadata.num_seqs > nd:
            qsl = metadata.query_start_loc_cpu
            start = qsl[nd]
            cu_q = (metadata.query_start_loc[nd:] - start).to(torch.int32).contiguous()
            cu_k = torch.zeros(metadata.num_seqs - nd + 1, dtype=torch.int32, device=query.device)
            cu_k[1:] = torch.cumsum(seq_lens[nd:], 0)
            pre_out = torch.empty_like(query[start:n])
            max_q = max(qsl[i + 1] - qsl[i] for i in range(nd, metadata.num_seqs))
            pa.flash_attn_varlen_func(pre_out, query[start:n].contiguous(), key_cache, value_cache,
                                      cu_q, cu_k, max_q, max(metadata.seq_lens_cpu[nd:]), self.scale, True,
                                      bt[nd:].contiguous(), None)
            out[start:n] = pre_out
        return out
