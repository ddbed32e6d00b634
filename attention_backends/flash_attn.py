"""FlashAttention-2 wrapper (package `flash_attn`, CUDA only). Selected only where it imports.

Upstream FlashAttention-2 pages its KV cache only in 256-token pages, so for the engine's
16/32-token blocks this wrapper gathers each sequence's blocks into a contiguous [S, Hkv, D]
(through the block table) and calls `flash_attn_varlen_func` once for the whole mixed batch,
causal with bottom-right alignment (each query row sits at the end of its context).
"""
from __future__ import annotations

import torch

from .interface import AttentionConfig, AttentionMetadata, write_kv
from .package_backend import PackageBackend


class FlashAttentionBackend(PackageBackend):
    name = "flash_attn"
    supported_devices = ("cuda",)
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = (32, 64, 80, 96, 128, 160, 192, 224, 256)
    supports_sliding_window = True
    supports_logits_soft_cap = True
    package = "flash_attn"

    @classmethod
    def import_package(cls) -> None:
        from flash_attn import flash_attn_varlen_func  # noqa: F401

    @classmethod
    def runtime_reasons(cls, config: AttentionConfig) -> list[str]:
        if config.device != "cuda":
            return []
        if not torch.cuda.is_available():
            return ["no CUDA device"]
        if torch.cuda.get_device_capability()[0] < 8:
            return ["FlashAttention-2 needs compute capability >= 8.0"]
        return []

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        from flash_attn import flash_attn_varlen_func
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        n = metadata.num_tokens
        bs = metadata.block_size
        ks, vs = [], []
        for i in range(metadata.num_seqs):
            s = metadata.seq_lens_cpu[i]
            blocks = metadata.block_tables[i, :(s + bs - 1) // bs].long()
            ks.append(kv_cache[0, blocks].reshape(-1, self.num_kv_heads, self.head_size)[:s])
            vs.append(kv_cache[1, blocks].reshape(-1, self.num_kv_heads, self.head_size)[:s])
        k = torch.cat(ks).to(query.dtype)
        v = torch.cat(vs).to(query.dtype)
        cu_k = torch.zeros(metadata.num_seqs + 1, dtype=torch.int32, device=query.device)
        cu_k[1:] = torch.cumsum(metadata.seq_lens.to(torch.int32), 0)
        kwargs = {}
        if self.sliding_window is not None:
            kwargs["window_size"] = (self.sliding_window - 1, 0)
        if self.logits_soft_cap:
            kwargs["softcap"] = float(self.logits_soft_cap)
        return flash_attn_varlen_func(query[:n].contiguous(), k, v, metadata.query_start_loc.to(torch.int32), cu_k,
                                      metadata.max_query_len, metadata.max_seq_len,
                                      softmax_scale=self.scale, causal=True, **kwargs)
