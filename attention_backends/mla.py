"""Multi-head latent attention (DeepSeek V2/V3) over its compressed KV cache, in torch; `cpu_mla`.

An MLA layer caches per token one row [L + R], shared by every head: the normalized latent c
(kv_lora_rank L) and the rotated rope key k_pe (qk_rope_head_dim R); the cache is
[num_blocks, block_size, L + R]. Head h's key is (W_UK[h] c | k_pe) and its value W_UV[h] c, with
W_UK[h] [N, L] and W_UV[h] [V, L] its rows of kv_b_proj. Two equal ways to attend:

* expanded: decompress the context's latents into per-head keys and values (kv_b_proj on each
  row), then ordinary attention. Pays H * (N + V) * L per context token once per step, fine for a
  prefill chunk whose many queries share that cost.
* absorbed: fold W_UK into the query (q_nope W_UK[h]: one L-vector per head) and W_UV into the
  output, and attend over the cached rows themselves. A decode token then reads L + R numbers per
  context token instead of expanding H * (N + V) of them; what vLLM's MLA decode does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .interface import AttentionBackend, AttentionConfig, AttentionMetadata, from_kv, to_kv


def write_latent(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 scale: float = 1.0) -> None:
    """Scatter this step's rows (latent [T, L] | k_pe [T, R]) into their paged slots."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    rows = to_kv(torch.cat((latent, k_pe), dim=-1), flat.dtype, scale)
    if flat.element_size() == 1 and flat.dtype != torch.uint8:   # fp8: index_copy_ has no fp8 kernel on CPU
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slot_mapping, rows)


def context_rows(kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int, dtype: torch.dtype,
                 scale: float = 1.0) -> torch.Tensor:
    """One sequence's cached rows [seq_len, L + R] in `dtype`, from its block table."""
    block_size = kv_cache.shape[1]
    blocks = table[:(seq_len + block_size - 1) // block_size].long()
    return from_kv(kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:seq_len], dtype, scale)


def expand(rows: torch.Tensor, kv_b_weight: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [S, L + R] -> per-head keys [S, H, N + R] and values [S, H, V] (kv_b_proj as transformers applies it)."""
    heads, _, rank = kv_b_weight.shape
    latent, k_pe = rows[:, :rank], rows[:, rank:]
    kv = F.linear(latent, kv_b_weight.reshape(-1, rank).to(rows.dtype)).view(rows.shape[0], heads, -1)
    k = torch.cat((kv[..., :nope], k_pe[:, None].expand(-1, heads, -1)), dim=-1)
    return k, kv[..., nope:]


def attend_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, kv_b_weight: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """One sequence's Q queries (its last Q of S context tokens, causal), float32 softmax: [Q, H, V] float32."""
    k, v = expand(rows.float(), kv_b_weight.float(), q_nope.shape[-1])
    q = torch.cat((q_nope, q_pe), dim=-1).float()
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    s, n = rows.shape[0], q.shape[0]
    q_pos = torch.arange(s - n, s, device=q.device).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(s, device=q.device).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def attend_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                    kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
    """B decode queries (q_nope [B, H, N], q_pe [B, H, R]) over their rows [B, S, L + R] (`valid` [B, S]
    marks each one's context) in the absorbed form, in float32: [B, H, V] in q_nope's dtype. (In bf16
    the absorbed query's scores, sums over L latent dims, would round to a few parts in 1000.)"""
    nope, rank = q_nope.shape[-1], kv_b_weight.shape[-1]
    w = kv_b_weight.float()
    rows = rows.float()
    latent, k_pe = rows[..., :rank], rows[..., rank:]
    q_latent = torch.einsum("bhn,hnl->bhl", q_nope.float(), w[:, :nope])               # W_UK folded into q
    scores = torch.einsum("bhl,bsl->bhs", q_latent, latent) + torch.einsum("bhr,bsr->bhs", q_pe.float(), k_pe)
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    out_latent = torch.einsum("bhs,bsl->bhl", torch.softmax(scores, dim=-1), latent)
    return torch.einsum("bhl,hvl->bhv", out_latent, w[:, nope:]).to(q_nope.dtype)     # W_UV on the way out


class CpuMLAAttention(AttentionBackend):
    """MLA on the CPU: decodes batched in the absorbed form, prefill chunks (from position 0 or
    after cached context) expanded through torch's scaled_dot_product_attention."""
    name = "cpu_mla"
    supports_mla = True
    supported_graph_modes = ("none", "torch.compile")

    @classmethod
    def validate(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate(config)
        if not config.mla:
            reasons.append("runs multi-head latent attention (MLA) layers only")
        return reasons

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        raise NotImplementedError("cpu_mla runs multi-head latent attention only (forward_mla)")

    def forward_mla(self, q_nope, q_pe, latent, k_pe, kv_cache, metadata: AttentionMetadata, kv_b_weight):
        write_latent(latent, k_pe, kv_cache, metadata.slot_mapping, self.k_scale)
        t, heads = q_nope.shape[:2]
        out = q_nope.new_empty(t, heads, kv_b_weight.shape[1] - q_nope.shape[-1])
        dtype, block_size, nope = q_nope.dtype, kv_cache.shape[1], q_nope.shape[-1]
        decodes = metadata.num_decodes
        if decodes:
            lens = metadata.seq_lens[:decodes]
            width = (max(metadata.seq_lens_cpu[:decodes]) + block_size - 1) // block_size
            tables = metadata.block_tables[:decodes, :width].long()
            rows = from_kv(kv_cache[tables].flatten(1, 2), dtype, self.k_scale)          # [B, S, L + R]
            valid = torch.arange(rows.shape[1], device=rows.device)[None, :] < lens[:, None]
            out[:decodes] = attend_absorbed(q_nope[:decodes], q_pe[:decodes], rows, valid, kv_b_weight, self.scale)
        qsl = metadata.query_start_loc_cpu
        for i in range(decodes, metadata.num_seqs):
            start, end, seq_len = qsl[i], qsl[i + 1], metadata.seq_lens_cpu[i]
            rows = context_rows(kv_cache, metadata.block_tables[i], seq_len, dtype, self.k_scale)
            k, v = expand(rows, kv_b_weight, nope)
            q = torch.cat((q_nope[start:end], q_pe[start:end]), dim=-1)
            n = end - start
            # Queries at positions seq_len - n .. seq_len - 1: causal within the chunk, all of the cache before it.
            mask = None if n == seq_len else (torch.arange(seq_len, device=q.device)[None, :]
                                              <= torch.arange(seq_len - n, seq_len, device=q.device)[:, None])
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                  attn_mask=mask, is_causal=mask is None, scale=self.scale)
            out[start:end] = attn.transpose(0, 1)
        return out
