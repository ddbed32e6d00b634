"""Triton paged attention: a prefill kernel and a split-KV decode kernel over the paged KV cache.

The default backend on CUDA/ROCm. On the CPU it runs only under the Triton interpreter
(`TRITON_INTERPRET=1`, set before the first forward), which is how the tests exercise it.

Kernels (the KV write itself is torch's `index_copy_`, see interface.write_kv):
  * decode: grid (num_decodes, num_heads, num_splits). Each program walks its share of one
    sequence's KV blocks through the block table with an online softmax (float32) and writes a
    partial (max, sum, accumulator); a second kernel merges the splits.
  * prefill: grid (num_prefill_seqs, num_heads, query blocks). Each program takes BLOCK_M query
    rows of one sequence and walks the KV blocks the causal mask allows (cached context
    included), `tl.dot` for both products, online softmax in float32.
Head sizes that are not powers of two (80) are padded to the next power of two with masks.
Logits soft-cap, sliding window and attention sinks (one more logit per head in the softmax's
denominator: the decode merge and the prefill's last step add it) are supported in both kernels.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from .interface import FP8_DTYPES, AttentionBackend, AttentionConfig, AttentionMetadata, write_kv

_MAX_SPLITS = 8


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """Define the kernels on first use, so TRITON_INTERPRET is read when they are decorated."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode_split_kernel(Q, KV, BT, SEQ_LENS, M_OUT, L_OUT, ACC_OUT,
                            stride_qt, stride_qh, stride_kv_c, stride_kv_b, stride_kv_s, stride_kv_h,
                            stride_bt, num_heads, blocks_per_split, scale, soft_cap, sliding_window,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                            USE_CAP: tl.constexpr, USE_WINDOW: tl.constexpr):
        # one program: one sequence, one KV head (all GROUP query heads that share it), one split
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(SEQ_LENS + b)
        g = tl.arange(0, GROUP_PAD)
        gmask = g < GROUP
        h = kvh * GROUP + g
        d = tl.arange(0, HEAD_PAD)
        dmask = d < HEAD
        q = tl.load(Q + b * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)      # [G, D]
        offs = tl.arange(0, BLOCK_SIZE)
        m = tl.full([GROUP_PAD], -1.0e30, tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        first = sp * blocks_per_split
        last = tl.minimum(first + blocks_per_split, num_blocks)
        for j in range(first, last):
            blk = tl.load(BT + b * stride_bt + j).to(tl.int64)
            pos = j * BLOCK_SIZE + offs
            valid = pos < seq_len
            if USE_WINDOW:
                valid = valid & (pos > seq_len - 1 - sliding_window)
            kv_off = blk * stride_kv_b + kvh * stride_kv_h + offs[:, None] * stride_kv_s + d[None, :]
            lmask = valid[:, None] & dmask[None, :]
            k = tl.load(KV + kv_off, mask=lmask, other=0.0).to(tl.float32)             # [BS, D]
            s = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale                      # [G, BS]
            if USE_CAP:
                s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)   # cap * tanh(s / cap)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(KV + stride_kv_c + kv_off, mask=lmask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        part = (b * num_heads + h) * NUM_SPLITS + sp                                    # [G]
        tl.store(M_OUT + part, m, mask=gmask)
        tl.store(L_OUT + part, l, mask=gmask)
        tl.store(ACC_OUT + part[:, None] * HEAD_PAD + d[None, :], acc, mask=gmask[:, None])

    @triton.jit
    def decode_reduce_kernel(OUT, M_IN, L_IN, ACC_IN, SINKS, stride_ot, stride_oh,
                             HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                             SPLITS_PAD: tl.constexpr, USE_SINKS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        num_heads = tl.num_programs(1)
        sp = tl.arange(0, SPLITS_PAD)
        smask = sp < NUM_SPLITS
        base = (b * num_heads + h) * NUM_SPLITS
        m = tl.load(M_IN + base + sp, mask=smask, other=-1.0e30)
        l = tl.load(L_IN + base + sp, mask=smask, other=0.0)
        d = tl.arange(0, HEAD_PAD)
        acc = tl.load(ACC_IN + (base + sp)[:, None] * HEAD_PAD + d[None, :], mask=smask[:, None], other=0.0)
        m_all = tl.max(m, 0)
        if USE_SINKS:
            sink = tl.load(SINKS + h).to(tl.float32)
            m_all = tl.maximum(m_all, sink)
        w = tl.exp(m - m_all)
        total = tl.sum(l * w, 0)
        if USE_SINKS:
            total += tl.exp(sink - m_all)
        out = tl.sum(acc * w[:, None], 0) / total
        tl.store(OUT + b * stride_ot + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d < HEAD)

    @triton.jit
    def prefill_kernel(Q, KV, OUT, BT, SEQ_LENS, QSL, SINKS,
                       stride_qt, stride_qh, stride_ot, stride_oh,
                       stride_kv_c, stride_kv_b, stride_kv_s, stride_kv_h, stride_bt,
                       num_decodes, scale, soft_cap, sliding_window,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       USE_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
                       USE_SINKS: tl.constexpr):
        # one program: BLOCK_M query rows of one sequence x the GROUP heads sharing one KV head,
        # flattened into BLOCK_M * GROUP_PAD rows of the tile
        seq = num_decodes + tl.program_id(0)
        kvh = tl.program_id(1)
        mb = tl.program_id(2)
        q_start = tl.load(QSL + seq)
        q_len = tl.load(QSL + seq + 1) - q_start
        if mb * BLOCK_M < q_len:
            seq_len = tl.load(SEQ_LENS + seq)
            ctx = seq_len - q_len
            i = tl.arange(0, BLOCK_M * GROUP_PAD)
            row = mb * BLOCK_M + i // GROUP_PAD
            g = i % GROUP_PAD
            h = kvh * GROUP + g
            rmask = (row < q_len) & (g < GROUP)
            d = tl.arange(0, HEAD_PAD)
            dmask = d < HEAD
            q = tl.load(Q + (q_start + row)[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                        mask=rmask[:, None] & dmask[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            q_pos = ctx + row
            offs = tl.arange(0, BLOCK_SIZE)
            m = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, tl.float32)
            l = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
            acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_PAD], tl.float32)
            end_pos = tl.minimum(ctx + (mb + 1) * BLOCK_M, seq_len)
            num_blocks = (end_pos + BLOCK_SIZE - 1) // BLOCK_SIZE
            first = 0
            if USE_WINDOW:
                first = tl.maximum(ctx + mb * BLOCK_M - sliding_window + 1, 0) // BLOCK_SIZE
            for j in range(first, num_blocks):
                blk = tl.load(BT + seq * stride_bt + j).to(tl.int64)
                pos = j * BLOCK_SIZE + offs
                valid = pos < seq_len
                kv_off = blk * stride_kv_b + kvh * stride_kv_h + offs[:, None] * stride_kv_s + d[None, :]
                lmask = valid[:, None] & dmask[None, :]
                k = tl.load(KV + kv_off, mask=lmask, other=0.0).to(q.dtype)
                if UPCAST:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale
                if USE_CAP:
                    s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)   # cap * tanh(s / cap)
                allowed = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
                if USE_WINDOW:
                    allowed = allowed & (pos[None, :] > q_pos[:, None] - sliding_window)
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                v = tl.load(KV + stride_kv_c + kv_off, mask=lmask, other=0.0).to(q.dtype)
                if UPCAST:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(q.dtype), v)
                acc = acc * alpha[:, None] + pv
                l = l * alpha + tl.sum(p, 1)
                m = m_new
            if USE_SINKS:       # the sink joins the denominator as one more (value-less) key
                sink = tl.load(SINKS + h, mask=g < GROUP, other=0.0).to(tl.float32)
                m_new = tl.maximum(m, sink)
                alpha = tl.exp(m - m_new)
                acc = acc * alpha[:, None]
                l = l * alpha + tl.exp(sink - m_new)
            out = acc / tl.where(l > 0, l, 1.0)[:, None]     # padded rows have l == 0
            tl.store(OUT + (q_start + row)[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
                     out.to(OUT.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])

    return decode_split_kernel, decode_reduce_kernel, prefill_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonPagedAttention(AttentionBackend):
    name = "triton_paged"
    supported_devices = ("cuda", "rocm", "xpu", "cpu")     # cpu: only under TRITON_INTERPRET=1
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_block_sizes = (16, 32, 64)
    supported_head_sizes = None   # any; non-powers of two are padded
    supports_gqa = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_attention_sinks = True
    supported_graph_modes = ("none",)
    block_rows = 64          # prefill tile rows (query rows x padded GQA group)

    @classmethod
    def probe(cls) -> Optional[str]:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except Exception as exc:
            return f"triton is not importable ({type(exc).__name__}: {exc}); pip install triton"
        return None

    @classmethod
    def validate(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate(config)
        if config.device == "cpu" and not cls.probe():
            if not _interpreting():
                reasons.append("on CPU tensors Triton runs only in its interpreter: set TRITON_INTERPRET=1 "
                               "before the first forward")
            elif config.kv_cache_dtype != "auto":
                reasons.append("fp8 KV cache is not supported by the Triton interpreter (numpy has no fp8)")
        if config.head_size > 256:
            reasons.append(f"head size {config.head_size} > 256 not supported")
        return reasons

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        write_kv(key, value, kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        decode_split, decode_reduce, prefill = _kernels(_interpreting())
        # fp8 scales without touching the kernels: q.(k_scale k) = k_scale (q.k) folds into the
        # softmax scale, and sum p (v_scale v) = v_scale (sum p v) scales the output.
        fp8 = kv_cache.dtype in FP8_DTYPES
        k_scale, v_scale = (self.k_scale, self.v_scale) if fp8 else (1.0, 1.0)
        softmax_scale = float(self.scale) * k_scale
        num_tokens = metadata.num_tokens
        out = torch.empty_like(query[:num_tokens])
        if num_tokens == 0:
            return out
        q = query[:num_tokens]
        if q.stride(-1) != 1:
            q = q.contiguous()
        head, hkv = self.head_size, self.num_kv_heads
        group = self.num_heads // hkv
        head_pad = max(16, _next_pow2(head))
        group_pad = _next_pow2(group)
        bs = metadata.block_size
        assert kv_cache.shape[-1] == head and kv_cache.stride(-1) == 1
        skv = kv_cache.stride()
        bt = metadata.block_tables
        use_cap = bool(self.logits_soft_cap)
        cap = float(self.logits_soft_cap or 1.0)
        use_window = self.sliding_window is not None
        window = int(self.sliding_window or 0)
        use_sinks = self.sinks is not None
        sinks = self.sinks if use_sinks else out        # a pointer the kernels do not read without sinks
        nd = metadata.num_decodes
        if nd:
            max_blocks = (max(metadata.seq_lens_cpu[:nd]) + bs - 1) // bs
            blocks_per_split = max(1, -(-max_blocks // _MAX_SPLITS))
            num_splits = -(-max_blocks // blocks_per_split)
            dev = query.device
            m_buf = torch.empty(nd * self.num_heads * num_splits, dtype=torch.float32, device=dev)
            l_buf = torch.empty_like(m_buf)
            acc_buf = torch.empty(nd * self.num_heads * num_splits * head_pad, dtype=torch.float32, device=dev)
            decode_split[(nd, hkv, num_splits)](
                q, kv_cache, bt, metadata.seq_lens, m_buf, l_buf, acc_buf,
                q.stride(0), q.stride(1), skv[0], skv[1], skv[2], skv[3], bt.stride(0),
                self.num_heads, blocks_per_split, softmax_scale, cap, window,
                GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=bs, HEAD=head, HEAD_PAD=head_pad,
                NUM_SPLITS=num_splits, USE_CAP=use_cap, USE_WINDOW=use_window)
            decode_reduce[(nd, self.num_heads)](
                out, m_buf, l_buf, acc_buf, sinks, out.stride(0), out.stride(1),
                HEAD=head, HEAD_PAD=head_pad, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, _next_pow2(num_splits)),
                USE_SINKS=use_sinks)
        num_prefills = metadata.num_seqs - nd
        if num_prefills:
            qsl = metadata.query_start_loc_cpu
            max_q = max(qsl[i + 1] - qsl[i] for i in range(nd, metadata.num_seqs))
            block_m = max(1, self.block_rows // group_pad)
            while block_m > 1 and block_m // 2 >= max_q:     # short chunks: smaller tiles
                block_m //= 2
            if block_m * group_pad < 16:                      # tl.dot needs at least 16 rows
                block_m = 16 // group_pad
            prefill[(num_prefills, hkv, -(-max_q // block_m))](
                q, kv_cache, out, bt, metadata.seq_lens, metadata.query_start_loc, sinks,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                skv[0], skv[1], skv[2], skv[3], bt.stride(0),
                nd, softmax_scale, cap, window,
                GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=bs, HEAD=head, HEAD_PAD=head_pad,
                BLOCK_M=block_m, USE_CAP=use_cap, USE_WINDOW=use_window,
                UPCAST=q.dtype == torch.float32 or _interpreting(), USE_SINKS=use_sinks)
        if v_scale != 1.0:
            out.mul_(v_scale)
        return out
