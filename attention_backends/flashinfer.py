"""FlashInfer wrapper (package `flashinfer`, CUDA only). Selected only where it imports.

One `BatchPrefillWithPagedKVCacheWrapper` serves the whole mixed batch (a decode is a prefill of
one query token): planned once per step from the metadata, run per layer on the default
[2, num_blocks, block_size, Hkv, D] cache as the (keys, values) pair in NHD layout.
"""
from __future__ import annotations

import torch

from .interface import AttentionConfig, AttentionMetadata, write_kv
from .package_backend import PackageBackend

_WORKSPACE_BYTES = 128 << 20


class FlashInferBackend(PackageBackend):
    name = "flashinfer"
    supported_devices = ("cuda",)
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = (64, 128, 256)
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supported_graph_modes = ("none", "cuda_graphs")
    package = "flashinfer"

    @classmethod
    def runtime_reasons(cls, config: AttentionConfig) -> list[str]:
        if config.device == "cuda" and not torch.cuda.is_available():
            return ["no CUDA device"]
        return []

    _wrapper = None

    def _plan(self, metadata: AttentionMetadata, query: torch.Tensor, kv_dtype: torch.dtype):
        import flashinfer
        key = ("flashinfer_plan", self.num_heads, self.num_kv_heads, self.head_size, self.sliding_window,
               self.logits_soft_cap, kv_dtype)
        cached = getattr(metadata, "_flashinfer_plans", None)
        if cached is None:
            cached = {}
            try:
                metadata._flashinfer_plans = cached
            except Exception:
                pass
        if key in cached:
            return cached[key]
        dev = query.device
        if FlashInferBackend._wrapper is None or FlashInferBackend._wrapper[0] != dev:
            ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            FlashInferBackend._wrapper = (dev, ws)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(FlashInferBackend._wrapper[1], kv_layout="NHD")
        bs = metadata.block_size
        indptr, indices, last = [0], [], []
        for i in range(metadata.num_seqs):
            s = metadata.seq_lens_cpu[i]
            nb = (s + bs - 1) // bs
            indices.append(metadata.block_tables[i, :nb])
            indptr.append(indptr[-1] + nb)
            last.append(s - (nb - 1) * bs)
        kwargs = {}
        if self.sliding_window is not None:
            kwargs["window_left"] = self.sliding_window - 1
        if self.logits_soft_cap:
            kwargs["logits_soft_cap"] = float(self.logits_soft_cap)
        wrapper.plan(metadata.query_start_loc.to(torch.int32),
                     torch.tensor(indptr, dtype=torch.int32, device=dev),
                     torch.cat(indices).to(torch.int32),
                     torch.tensor(last, dtype=torch.int32, device=dev),
                     self.num_heads, self.num_kv_heads, self.head_size, bs, causal=True,
                     sm_scale=self.scale, q_data_type=query.dtype, kv_data_type=kv_dtype, **kwargs)
        cached[key] = wrapper
        return wrapper

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        write_kv(key, value, kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        n = metadata.num_tokens
        wrapper = self._plan(metadata, query, kv_cache.dtype)
        scales = {}
        if kv_cache.element_size() == 1 and (self.k_scale != 1.0 or self.v_scale != 1.0):
            scales = {"k_scale": float(self.k_scale), "v_scale": float(self.v_scale)}   # fp8: read x * scale
        return wrapper.run(query[:n].contiguous(), (kv_cache[0], kv_cache[1]), **scales)
