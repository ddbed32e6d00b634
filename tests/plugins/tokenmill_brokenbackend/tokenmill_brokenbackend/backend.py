"""The reference algorithm with one deliberate bug: the last KV block of a sequence is dropped."""
from __future__ import annotations

import torch

from tokenmill.attention_backends.interface import AttentionBackend, AttentionMetadata, write_kv


class DropLastBlockAttention(AttentionBackend):
    name = "broken_lastblock"
    supported_devices = ("cpu",)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        group = self.num_heads // self.num_kv_heads
        bs = metadata.block_size
        for i in range(metadata.num_seqs):
            start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
            seq_len = metadata.seq_lens_cpu[i]
            q_len = end - start
            num_blocks = (seq_len + bs - 1) // bs
            if num_blocks > 1:                       # THE BUG: the last block is never read
                num_blocks -= 1
            kept = min(seq_len, num_blocks * bs)
            blocks = metadata.block_tables[i, :num_blocks].long()
            k = kv_cache[0, blocks].reshape(-1, self.num_kv_heads, self.head_size)[:kept].float()
            v = kv_cache[1, blocks].reshape(-1, self.num_kv_heads, self.head_size)[:kept].float()
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            q = query[start:end].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            allowed = torch.arange(kept).unsqueeze(0) <= q_pos
            # a query row with nothing left to attend to would be NaN; keep it finite (and wrong)
            allowed[:, 0] = True
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).to(query.dtype)
        return out
