"""The fast CPU backend: batched decode and per-sequence prefill on torch's fused SDPA kernel.

Decodes (the first `num_decodes` sequences, one query token each) run as one batch: their
blocks are gathered through the block table with a single `index_select`, the query is viewed
as [B, Hkv, group, D] so grouped-query attention needs no `repeat_interleave`, and one
`scaled_dot_product_attention` call with a padding mask covers all of them.

Prefill chunks run one sequence at a time, except back-to-back whole prompts of one length (an
embedding batch, a burst of same-length prompts), which run as one batched SDPA call. A chunk
that is the whole context (it starts at position 0) attends to its own new keys/values with
`is_causal=True`, no gather at all; a chunk after cached context gathers that sequence's blocks
and uses a causal mask offset by the cached length. Non-causal metadata (encoders) drops the
causal mask in both cases.

Where the native kernels build, decodes read their blocks in place (cpu_paged_decode) and bf16
prompt attention runs on AVX512-BF16 dot products (cpu_flash_prefill; also for float32
activations over a bf16 cache, only the query rounded), on AMX tiles where the CPU has them
(torch's flash kernel where it has them but this build cannot use them). Decodes, and runs of prompt chunks of
one length, whose tables start with the same cached blocks attend to that prefix once for all
their queries (cascade), merged with their own part by log-sum-exp.

Per-step derived tensors (gather indices, masks, cascade plans: cpu_sdpa_plans.py) are built
once and kept on the metadata object, so the 30-odd layers of one step share them.

Logits soft-capping has no SDPA equivalent, so it takes a plain-matmul path with a float32 softmax
(correct, slower). Attention sinks (GPT-OSS) scale the native decode's and the flash kernels' outputs by
their log-sum-exp (Z / (Z + e^sink)), elsewhere take that path too. KV cache layout is the default one.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import cpu_flash_prefill, cpu_paged_decode
from .cpu_sdpa_plans import _attend_with_lse, _gather_blocks, _merge_by_lse, _step_cache, _with_sinks
from .interface import FP8_DTYPES, AttentionBackend, AttentionMetadata, from_kv, kv_round_trip, to_kv, write_kv


class CpuSdpaAttention(AttentionBackend):
    name = "cpu_sdpa"
    supported_devices = ("cpu",)
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_kv_cache_dtypes = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supports_gqa = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_attention_sinks = True
    supports_non_causal = True          # prefill only: a one-token query is the same either way
    supported_graph_modes = ("none",)   # torch.compile of the whole model not verified yet

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        if not cpu_paged_decode.write_kv_rows(key, value, kv_cache, metadata.slot_mapping):
            write_kv(key, value, kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        num_tokens = metadata.num_tokens
        out = torch.empty_like(query[:num_tokens])
        if num_tokens == 0:
            return out
        step = _step_cache(metadata, metadata.block_size, self.sliding_window, query.device)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, metadata, step)
        qsl = metadata.query_start_loc_cpu
        if metadata.num_seqs > nd and self._paged_prefill_ok(query, kv_cache, metadata):
            # every prompt chunk of the step in one native call reading the cache
            start = qsl[nd]
            done = cpu_paged_decode.paged_prefill(
                query[start:num_tokens], kv_cache, metadata.block_tables[nd:], metadata.seq_lens[nd:],
                torch.tensor(qsl[nd:], dtype=torch.int64) - start, self.scale, self.k_scale, self.v_scale,
                out=out[start:num_tokens])
            if done is not None:
                return out
        i = nd
        while i < metadata.num_seqs:
            start, end = qsl[i], qsl[i + 1]
            shared = step["prefill_runs"].get(i) if not self._manual else None
            if shared is not None:
                stop = qsl[i + shared[0]]
                out[start:stop] = self._prefill_shared_prefix(query[start:stop], key[start:stop], value[start:stop],
                                                              kv_cache, metadata, i, *shared)
                i += shared[0]
                continue
            run = self._fresh_run(metadata, i)
            if run > 1:     # whole prompts of one length (an embedding batch): one SDPA call for all
                stop = qsl[i + run]
                out[start:stop] = self._prefill_fresh_batch(query[start:stop], key[start:stop], value[start:stop],
                                                            kv_cache.dtype, run, metadata.causal)
                i += run
                continue
            if end > start:
                out[start:end] = self._prefill(query[start:end], key[start:end], value[start:end],
                                               kv_cache, metadata, i)
            i += 1
        return out

    def _paged_prefill_ok(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Whether the native paged prefill (cpu_paged_decode.paged_prefill) takes this step's
        prompt chunks: causal, over a bf16 or fp8 cache, float32 or bf16 activations, head size 64
        or 128, no window or soft cap, on a CPU where it runs (AVX512-BF16 without AMX). It reads
        every chunk's keys back from the cache just written (a cached prefix several chunks share
        once), so no torch conversions of K/V, Q or the output and no partial outputs to merge
        (those conversions and merges were the larger part of a shared-prefix prompt step)."""
        return (self._window_in(metadata) is None and not self._manual and metadata.causal
                and kv_cache.dtype in (torch.bfloat16, *FP8_DTYPES)
                and query.dtype in (torch.float32, torch.bfloat16)
                and self.head_size in cpu_paged_decode.PREFILL_HEAD_SIZES and kv_cache.is_contiguous()
                and cpu_paged_decode.available() is None and cpu_paged_decode.prefill_may_run())

    def _window_in(self, metadata: AttentionMetadata) -> Optional[int]:
        """The window where it hides keys from some prompt chunk of the step (None: it hides none)."""
        window = self.sliding_window
        lens = metadata.seq_lens_cpu[metadata.num_decodes:]
        return window if window is not None and max(lens, default=0) > window else None

    def _fresh_run(self, metadata: AttentionMetadata, i: int) -> int:
        """How many sequences from i on are whole prompts (no cached context) of sequence i's length
        (prompts longer than a sliding window go one at a time, through the windowed flash tiles)."""
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        length = qsl[i + 1] - qsl[i]
        if self._manual or (self.sliding_window is not None and lens[i] > self.sliding_window):
            return 1
        j = i
        while j < metadata.num_seqs and lens[j] == length and qsl[j + 1] - qsl[j] == length:
            j += 1
        return j - i

    def _prefill_fresh_batch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype,
                             batch: int, causal: bool) -> torch.Tensor:
        """`batch` whole prompts of one length, rows back to back: attend to their own new K/V."""
        length = q.shape[0] // batch
        flash = self._flash_batch(q, k, v, torch.arange(0, q.shape[0] + 1, length), causal, cache_dtype)
        if flash is not None:
            return flash.reshape(q.shape)
        if cache_dtype != q.dtype:                                 # read what the cache holds
            k = kv_round_trip(k, cache_dtype, self.k_scale)
            v = kv_round_trip(v, cache_dtype, self.v_scale)
        o = F.scaled_dot_product_attention(
            q.view(batch, length, self.num_heads, self.head_size).transpose(1, 2),
            k.reshape(batch, length, self.num_kv_heads, self.head_size).transpose(1, 2),
            v.reshape(batch, length, self.num_kv_heads, self.head_size).transpose(1, 2),
            is_causal=causal, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(1, 2).reshape(q.shape)

    def _prefill_shared_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                               metadata: AttentionMetadata, i: int, count: int, prefix_len: int) -> torch.Tensor:
        """`count` prompt chunks of one length after the same cached prefix (cascade attention):
        the prefix once for every query (one GEMM-shaped call, the group folded into the query
        axis), each chunk's own tokens causally in one batched call, merged by log-sum-exp."""
        hkv, d, heads = self.num_kv_heads, self.head_size, self.num_heads
        group, tokens = heads // hkv, q.shape[0]
        length = tokens // count
        index = metadata.block_tables[i, :prefix_len // metadata.block_size].to(torch.long)
        prefix = _gather_blocks(kv_cache, index).view(2, prefix_len, hkv, d)
        if prefix.dtype != q.dtype:
            prefix = self._read(prefix, q.dtype)
        flash = self._flash(q, prefix[0], prefix[1], 0, False, kv_cache.dtype, True)
        if flash is not None:
            out_p, lse_p = flash[0], flash[1].t()
            own = self._flash_batch(q, k, v, torch.arange(0, tokens + 1, length), True, kv_cache.dtype, True)
            if own is not None:        # each chunk's own tokens: one native call for all chunks
                return _merge_by_lse(out_p, lse_p, own[0], own[1].t(), q.dtype)
        else:
            qp = q.view(tokens, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * tokens, d)
            out_p, lse_p = _attend_with_lse(qp, prefix[0].transpose(0, 1).unsqueeze(0),
                                            prefix[1].transpose(0, 1).unsqueeze(0), None, self.scale)
            out_p = out_p.reshape(hkv, group, tokens, d).permute(2, 0, 1, 3).reshape(tokens, heads, d)
            lse_p = lse_p.reshape(hkv, group, tokens).permute(2, 0, 1).reshape(tokens, heads)
        if kv_cache.dtype != q.dtype:                              # read what the cache holds
            k = kv_round_trip(k, kv_cache.dtype, self.k_scale)
            v = kv_round_trip(v, kv_cache.dtype, self.v_scale)
        own_k = k.reshape(count, length, hkv, d).transpose(1, 2).repeat_interleave(group, dim=1)
        own_v = v.reshape(count, length, hkv, d).transpose(1, 2).repeat_interleave(group, dim=1)
        out_s, lse_s = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.view(count, length, heads, d).transpose(1, 2), own_k, own_v, 0.0, True, scale=self.scale)[:2]
        out_s = out_s.transpose(1, 2).reshape(tokens, heads, d)
        lse_s = lse_s.transpose(1, 2).reshape(tokens, heads)
        return _merge_by_lse(out_p, lse_p, out_s, lse_s, q.dtype)

    # -- decode: one batched call ------------------------------------------------------------
    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                step: dict) -> torch.Tensor:
        nd = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_size
        group = self.num_heads // hkv
        max_len = step["decode_max_len"]
        native = self._native_decode_ok(q, kv_cache)
        if not native and q.dtype != torch.float32 and self._native_decode_ok(q.float(), kv_cache):
            # bf16 activations (AMX hosts): the in-place kernel on a float32 copy of the query
            # (9 heads x 64 values a token) beats gathering the blocks for SDPA by far.
            return self._decode(q.float(), kv_cache, metadata, step).to(q.dtype)
        if step.get("cascade") is not None and not self._manual and (native or q.dtype == kv_cache.dtype):
            q4 = q.view(nd, hkv, group, d)
            return self._decode_cascade(q4, kv_cache, step["cascade"], metadata, native).reshape(nd, self.num_heads, d)
        if native:
            out = cpu_paged_decode.paged_decode(q, kv_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd],
                                                self.scale, self.sliding_window, return_lse=self.sinks is not None,
                                                k_scale=self.k_scale, v_scale=self.v_scale)
            if self.sinks is None:
                return out
            # A sink adds e^sink to the denominator Z = e^lse: the output times Z / (Z + e^sink).
            return out[0].mul_(torch.sigmoid(out[1] - self.sinks.float()).unsqueeze_(-1))
        kv = _gather_blocks(kv_cache, step["decode_index"], step)  # [2, nd*nblk, bs, Hkv, D]
        kv = kv.view(2, nd, -1, hkv, d)[:, :, :max_len]           # [2, nd, S, Hkv, D]
        if kv.dtype != q.dtype:
            kv = self._read(kv, q.dtype)
        k = kv[0].transpose(1, 2)                                 # [nd, Hkv, S, D] (a view)
        v = kv[1].transpose(1, 2)
        mask = step["decode_mask"]
        if self._manual:
            q4 = q.view(nd, hkv, group, d)                        # group folded into the query axis
            o = self._attend_manual(q4, k, v, mask, (hkv, group, 1))
        else:
            # [B, H, 1, D] against [B, Hkv, S, D]: SDPA's own GQA (head h reads KV head h // group),
            # measured faster than folding the group into the query axis.
            o = F.scaled_dot_product_attention(q.view(nd, self.num_heads, 1, d), k, v, attn_mask=mask,
                                               scale=self.scale, enable_gqa=group > 1)
        return o.reshape(nd, self.num_heads, d)

    def native_decode_fn(self, kv_cache: torch.Tensor) -> Optional[int]:
        """paged_decode.cpp's write-and-attend entry for a float32, bf16 or fp8 cache (NATIVE_DECODE_ABI),
        soft-capping included; none with sinks (the ABI has no sink logits)."""
        if self.sinks is not None or not kv_cache.is_contiguous() or cpu_paged_decode.available() is not None:
            return None
        return cpu_paged_decode.native_attend_address(kv_cache.dtype)

    def _native_decode_ok(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """The C++ kernel reads blocks in place (no per-step gather of every sequence's context, as
        the SDPA path does); it covers float32 queries over a float32, bf16 or fp8 cache, without
        soft-capping (sinks: through its log-sum-exp)."""
        return (q.dtype == torch.float32 and kv_cache.dtype in cpu_paged_decode.KV_DTYPES
                and not self.logits_soft_cap and kv_cache.is_contiguous() and cpu_paged_decode.available() is None)

    def _decode_cascade(self, q4: torch.Tensor, kv_cache: torch.Tensor, plan: dict,
                        metadata: AttentionMetadata, native: bool) -> torch.Tensor:
        """Shared prefix once for all queries (one SDPA call, GEMM-shaped), then each suffix
        (the native kernel from the prefix's end, or gather + SDPA), merged by log-sum-exp."""
        nd, hkv, group, d = q4.shape
        prefix = kv_cache.index_select(1, plan["prefix_index"]).view(2, plan["prefix_len"], hkv, d)
        if prefix.dtype != q4.dtype:
            prefix = self._read(prefix, q4.dtype)
        qp = q4.permute(1, 0, 2, 3).reshape(1, hkv, nd * group, d)          # every query, one batch
        out_p, lse_p = _attend_with_lse(qp, prefix[0].transpose(0, 1).unsqueeze(0),
                                        prefix[1].transpose(0, 1).unsqueeze(0), None, self.scale)
        out_p = out_p.view(hkv, nd, group, d).transpose(0, 1)               # [nd, Hkv, G, D]
        lse_p = lse_p.view(hkv, nd, group).transpose(0, 1)
        if native:
            out_s, lse_s = cpu_paged_decode.paged_decode(q4.reshape(nd, hkv * group, d), kv_cache,
                                                         metadata.block_tables[:nd], metadata.seq_lens[:nd],
                                                         self.scale, None, first_pos=plan["prefix_len"],
                                                         return_lse=True, k_scale=self.k_scale, v_scale=self.v_scale)
            out_s, lse_s = out_s.view(nd, hkv, group, d), lse_s.view(nd, hkv, group)
        else:
            suffix = kv_cache.index_select(1, plan["suffix_index"])
            suffix = suffix.view(2, nd, -1, hkv, d)[:, :, :plan["max_suffix"]]
            out_s, lse_s = _attend_with_lse(q4, suffix[0].transpose(1, 2), suffix[1].transpose(1, 2),
                                            plan["suffix_mask"], self.scale)
        return _merge_by_lse(out_p, lse_p, out_s, lse_s, q4.dtype)

    # -- prefill: one sequence -----------------------------------------------------------------
    def _prefill(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 kv_cache: torch.Tensor, metadata: AttentionMetadata, i: int) -> torch.Tensor:
        q_len = q.shape[0]
        seq_len = metadata.seq_lens_cpu[i]
        ctx = seq_len - q_len
        hkv, d = self.num_kv_heads, self.head_size
        group = self.num_heads // hkv
        window = self.sliding_window if (self.sliding_window or seq_len) < seq_len else None   # one that hides keys
        sinks = self.sinks is not None                 # the flash kernels' lse takes them into account
        if ctx == 0 and not self.logits_soft_cap:
            flash = self._flash(q, k_new, v_new, 0, metadata.causal, kv_cache.dtype, sinks, window=window)
            if flash is not None:
                return _with_sinks(flash, self.sinks)
        if ctx == 0 and not self._manual and window is None:
            k, v = k_new, v_new
            if kv_cache.dtype != q.dtype:                          # read what the cache holds
                k = kv_round_trip(k, kv_cache.dtype, self.k_scale)
                v = kv_round_trip(v, kv_cache.dtype, self.v_scale)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None],
                                               is_causal=metadata.causal, scale=self.scale,
                                               enable_gqa=group > 1)   # [H, Q, D]
            return o[0].transpose(0, 1)
        bs = metadata.block_size
        nblk = (seq_len + bs - 1) // bs
        # Under a window, from the block of the first key any query sees (a hybrid KV layout has
        # already released the blocks before it).
        first = max(0, ctx - window + 1) // bs if window is not None and metadata.causal else 0
        idx = metadata.block_tables[i, first:nblk].to(torch.long)
        kv = _gather_blocks(kv_cache, idx).view(2, (nblk - first) * bs, hkv, d)[:, :seq_len - first * bs]
        flash = self._flash(q, kv[0], kv[1], ctx - first * bs, metadata.causal, kv_cache.dtype, sinks, window=window)
        if flash is not None:
            return _with_sinks(flash, self.sinks)
        if kv.dtype != q.dtype:
            kv = self._read(kv, q.dtype)
        q_pos = torch.arange(ctx, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(first * bs, seq_len, device=q.device).unsqueeze(0)
        allowed = k_pos <= q_pos                                   # causal, offset by the cached context
        if not metadata.causal:
            allowed = torch.ones_like(allowed)
        if window is not None:
            allowed &= k_pos > q_pos - window
        if self._manual:
            qh = q.view(q_len, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, Q, D]
            kh = kv[0].transpose(0, 1).unsqueeze(1)                # [Hkv, 1, S, D]
            vh = kv[1].transpose(0, 1).unsqueeze(1)
            o = self._attend_manual(qh, kh, vh, allowed, (hkv, group, 1, 1))   # [Hkv, G, Q, D]
            return o.permute(2, 0, 1, 3).reshape(q_len, self.num_heads, d)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kv[0].transpose(0, 1)[None],
                                           kv[1].transpose(0, 1)[None],
                                           attn_mask=allowed, scale=self.scale, enable_gqa=group > 1)
        return o[0].transpose(0, 1)

    def _flash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, causal: bool,
               cache_dtype: torch.dtype, return_lse: bool = False, window: Optional[int] = None):
        """The bf16 flash kernel where it applies: bf16 or float32 activations over a bf16 or fp8
        cache (every fp8 value is a bf16 value; float32 activations: only the query rounded, as
        for a bf16 cache, 2^-9 relative where the fp8 keys themselves carry 2^-4): faster than
        widening the cache to float32 for SDPA. A sliding `window` (one that hides keys here): only
        this library's tiles take it. None elsewhere."""
        if not self._flash_reads(q, cache_dtype) or self.logits_soft_cap:
            return None
        if window is not None and (not causal or cpu_flash_prefill.torch_kernel_is_faster()):
            return None
        k, v = self._as_cached(k, v, cache_dtype)
        widen = q.dtype == torch.float32
        if widen:
            q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        if window is None and cpu_flash_prefill.torch_kernel_is_faster():
            out = cpu_flash_prefill.torch_flash(q, k, v, self.scale, q_offset, causal, return_lse)
        elif cpu_flash_prefill.covers(q, k, v):
            out = cpu_flash_prefill.flash_prefill(q, k, v, self.scale, q_offset, causal, return_lse, window)
        else:
            return None
        if not widen:
            return out
        return (out[0].float(), out[1]) if return_lse else out.float()

    def _flash_batch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, causal: bool,
                     cache_dtype: torch.dtype, return_lse: bool = False):
        """_flash for whole prompts back to back (rows `starts`) in one native call, none past a window."""
        if not self._flash_reads(q, cache_dtype) or self._manual:
            return None
        if self.sliding_window is not None and int((starts[1:] - starts[:-1]).max()) > self.sliding_window:
            return None
        k, v = self._as_cached(k, v, cache_dtype)
        widen = q.dtype == torch.float32
        if widen:
            q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        if cpu_flash_prefill.torch_kernel_is_faster():
            out = cpu_flash_prefill.torch_flash_batch(q, k, v, self.scale, starts, causal, return_lse)
        elif cpu_flash_prefill.covers(q, k, v):
            out = cpu_flash_prefill.flash_prefill_batch(q, k, v, self.scale, starts, causal, return_lse)
        else:
            return None
        if not widen:
            return out
        return (out[0].float(), out[1]) if return_lse else out.float()

    @staticmethod
    def _flash_reads(q: torch.Tensor, cache_dtype: torch.dtype) -> bool:
        return cache_dtype == torch.bfloat16 or (cache_dtype in FP8_DTYPES
                                                 and q.dtype in (torch.bfloat16, torch.float32))

    def _as_cached(self, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype):
        """K/V as attention reads them from an fp8 cache (stored * scale), in bf16 for the flash
        kernels (exact for scale 1: every fp8 value is a bf16 value): gathered fp8 blocks read,
        new activations stored and read back; other caches: unchanged."""
        if cache_dtype not in FP8_DTYPES:
            return k, v
        if k.dtype not in FP8_DTYPES:
            k, v = to_kv(k, cache_dtype, self.k_scale), to_kv(v, cache_dtype, self.v_scale)
        return from_kv(k, torch.bfloat16, self.k_scale), from_kv(v, torch.bfloat16, self.v_scale)

    def _read(self, kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered cache blocks [2, ...] as `dtype` (an fp8 cache times its k/v scales)."""
        if kv.dtype not in FP8_DTYPES:
            return kv.to(dtype)
        return torch.stack((from_kv(kv[0], dtype, self.k_scale), from_kv(kv[1], dtype, self.v_scale)))

    @property
    def _manual(self) -> bool:
        """Soft-capping or sinks: the plain-matmul path (_attend_manual) only."""
        return bool(self.logits_soft_cap) or self.sinks is not None

    def _attend_manual(self, q, k, v, allowed, sink_shape=()):
        """q [..., Q, D] against k/v [..., S, D] (broadcast over heads), float32 softmax; the sinks
        viewed as `sink_shape` (the query heads' axes of q, 1 for the rest) join each denominator."""
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        if self.logits_soft_cap:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        if self.sinks is None:
            return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
        sink = self.sinks.float().view(sink_shape).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs, v.float()).to(q.dtype)
