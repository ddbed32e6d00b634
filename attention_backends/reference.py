"""The truth: plain torch, one sequence at a time, softmax in float32. Slow by design.

Only portable torch ops, every tensor made on the query's device: it runs on any torch device,
so a new platform needs no attention backend of its own to start."""
from __future__ import annotations

import torch

from .interface import AttentionBackend, AttentionMetadata, from_kv, write_kv
from .mla import attend_expanded, context_rows, write_latent


class ReferenceAttention(AttentionBackend):
    name = "reference"
    supported_devices = ("*",)
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_attention_sinks = True
    supports_non_causal = True
    supports_mla = True
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")   # fp8: per-tensor k/v scales
    supported_graph_modes = ("none",)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        write_kv(key, value, kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        out = torch.empty_like(query)
        group = self.num_heads // self.num_kv_heads
        block_size = metadata.block_size
        for i in range(metadata.num_seqs):
            start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
            seq_len = metadata.seq_lens_cpu[i]
            q_len = end - start
            num_blocks = (seq_len + block_size - 1) // block_size
            blocks = metadata.block_tables[i, :num_blocks].long()
            k = kv_cache[0, blocks].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            v = kv_cache[1, blocks].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            k = from_kv(k, torch.float32, self.k_scale).repeat_interleave(group, dim=1)     # [S, H, D]
            v = from_kv(v, torch.float32, self.v_scale).repeat_interleave(group, dim=1)
            q = query[start:end].float()                            # [Q, H, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if self.logits_soft_cap:
                scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
            allowed = k_pos <= q_pos if metadata.causal else torch.ones_like(k_pos <= q_pos)
            if self.sliding_window is not None:
                allowed &= k_pos > q_pos - self.sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            if self.sinks is not None:      # one more logit per head in the denominator, attending to nothing
                sink = self.sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)
                probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        return out

    def forward_mla(self, q_nope, q_pe, latent, k_pe, kv_cache, metadata: AttentionMetadata, kv_b_weight):
        """The expanded form for every sequence (attention_backends/mla.py)."""
        write_latent(latent, k_pe, kv_cache, metadata.slot_mapping, self.k_scale)
        out = q_nope.new_empty(*q_nope.shape[:2], kv_b_weight.shape[1] - q_nope.shape[-1])
        for i in range(metadata.num_seqs):
            start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
            rows = context_rows(kv_cache, metadata.block_tables[i], metadata.seq_lens_cpu[i], torch.float32,
                                self.k_scale)
            out[start:end] = attend_expanded(q_nope[start:end], q_pe[start:end], rows, kv_b_weight, self.scale)
        return out
