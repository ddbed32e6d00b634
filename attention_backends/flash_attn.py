"""FlashAttention-2 wrapper (package `flash_attn`, CUDA only). Selected only where it imports.

Upstream FlashAttention-2 pages its KV cache only in 256-token pages, so for the engine's
16/32-token blocks this wrapper gathers each sequence's blocks into a contiguous [S, Hkv, D]
(through the block table) and calls `flash_attn_varlen_func` once for the whole mixed batch,
causal with bottom-right alignment (each query row sits at the end of its context).
"""
from __future__ import annotations

from typing import Optional

import torch

from .interface import AttentionBackend, AttentionConfig, AttentionMetadata, write_kv


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"
    supported_devices = ("cuda",)
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = (32, 64, 80, 96, 128, 160, 192, 224, 256)
    supported_kv_cache_dtypes = ("auto",)
    supports_gqa = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supported_graph_modes = ("none",)

    @classmethod
    def probe(cls) -> Optional[str]:
        try:
            import flash_attn  # noqa: F401
            from flash_attn import flash_attn_varlen_func  # noqa: F401
        except Exception as exc:
            return f"flash_attn is not importable ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
        return None

    @classmethod
    def validate(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate(config)
        if config.device == "cuda" and not reasons:
            if not torch.cuda.is_available():
                reasons.append("no CUDA device")
            elif torch.cuda.get_device_capability()[0] < 8:
                reasons.append("FlashAttention-2 needs compute capability >= 8.0")
        return reasons

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
