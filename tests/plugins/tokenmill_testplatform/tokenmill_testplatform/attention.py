"""`testcpu_paged`: a small, correct paged attention of this plugin's own.

Per sequence it turns the block table into the slot of every cached position, gathers K/V
with one index_select, and calls scaled_dot_product_attention in float32 with an explicit
causal (and optional sliding-window) mask. Different code from tokenmill's reference backend,
the same math.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention_backends.interface import AttentionBackend, AttentionMetadata, write_kv


class TestPagedAttention(AttentionBackend):
    name = "testcpu_paged"
    supported_devices = ("cpu",)
    supported_dtypes = (torch.float32, torch.bfloat16)
    supports_sliding_window = True
    supported_graph_modes = ("none", "torch.compile")

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        keys = kv_cache[0].reshape(num_blocks * block_size, self.num_kv_heads, self.head_size)
        values = kv_cache[1].reshape(num_blocks * block_size, self.num_kv_heads, self.head_size)
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(query)
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i, seq_len in enumerate(lens):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            positions = torch.arange(seq_len, device=query.device)
            table = metadata.block_tables[i].long()
            slots = table[positions // block_size] * block_size + positions % block_size
            k = keys.index_select(0, slots).float().transpose(0, 1)     # [Hkv, S, D]
            v = values.index_select(0, slots).float().transpose(0, 1)
            if group > 1:
                k = k.repeat_interleave(group, dim=0)
                v = v.repeat_interleave(group, dim=0)
            q = query[start:end].float().transpose(0, 1)                 # [H, Q, D]
            q_pos = positions[seq_len - (end - start):].unsqueeze(1)
            allowed = positions.unsqueeze(0) <= q_pos                    # [Q, S]
            if self.sliding_window is not None:
                allowed &= positions.unsqueeze(0) > q_pos - self.sliding_window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
            out[start:end] = o.transpose(0, 1).to(query.dtype)
        return out
