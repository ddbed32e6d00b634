"""What an attention backend is: a kernel over a paged KV cache plus a capability declaration.

A leaf module: it imports nothing else of tokenmill's.

The KV cache of one layer is one tensor of shape
    [2, num_blocks, block_size, num_kv_heads, head_size]     (index 0 = keys, 1 = values)
unless a backend overrides `kv_cache_shape`.

A batch is flattened: all scheduled tokens of all sequences are concatenated along dim 0.
Sequences are ordered decodes first (query length 1), then prefill chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

ATTENTION_API_VERSION = 1

# The C signature of `AttentionBackend.native_decode_fn()`, for fused decode steps (a platform's
# native code calling attention once per layer without going back to Python):
#   void attend(const float* q,        // [num_seqs, num_heads, head_size], one token per sequence
#               const float* k,        // [num_seqs, num_kv_heads, head_size], the new token's key
#               const float* v,        // same, its value
#               void* kv_cache,        // this layer's cache, the backend's kv_cache_shape and dtype
#               const int64_t* slots,  // [num_seqs] where the new K/V go (metadata.slot_mapping)
#               const int32_t* tables, int64_t table_stride,   // [num_seqs, stride] block tables
#               const int32_t* lens,   // [num_seqs] context length including the new token
#               float* out,            // [num_seqs, num_heads, head_size]
#               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
#               int64_t block_size, int64_t num_blocks, float scale,
#               int64_t window,        // sliding window, 0 = none
#               float k_scale, float v_scale,    // an fp8 cache's scales (it stores k / k_scale), else 1
#               float softcap);        // logit soft-cap (scores -> cap * tanh(score / cap)), 0 = none
NATIVE_DECODE_ABI = "tokenmill_paged_attend_v3"


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of mixed prefill chunks and decodes.

    For sequence i, its query tokens are rows query_start_loc[i]:query_start_loc[i+1] of q/k/v;
    they sit at positions seq_lens[i] - query_len_i ... seq_lens[i] - 1 of that sequence, so
    each attends causally to every cached token before it plus itself.
    """
    query_start_loc: torch.Tensor   # int32 [num_seqs + 1], on the device
    seq_lens: torch.Tensor          # int32 [num_seqs], context length after this step's tokens
    block_tables: torch.Tensor      # int32 [num_seqs, max_blocks_per_seq]; padding entries are 0
    slot_mapping: torch.Tensor      # int64 [num_tokens]: block_id * block_size + offset for each new token
    num_decodes: int                # the first num_decodes sequences have query length 1
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so Python-side backends need no device sync.
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # False: every query token attends to every token of its sequence (encoders, e.g. BERT). Only
    # backends with supports_non_causal are chosen for such models; their prompt runs in one step.
    causal: bool = True
    # Hybrid KV (core/kv_groups.py): the batch once per layer group, with that group's block_tables
    # and slot_mapping; each attention layer reads its group's. None: one group, this metadata.
    groups: Optional[list["AttentionMetadata"]] = None
    # Recurrent layers (linear attention, state-space: core/state_cache.py RecurrentBatch): each
    # entry's state slot and start. None: the model has none. Attention backends never read it.
    state: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1] if self.query_start_loc_cpu else 0

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


@dataclass(frozen=True)
class AttentionConfig:
    """What a caller wants to run; backends say whether they can."""
    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"          # "auto" = same as dtype; "bfloat16"; "fp8" / "fp8_e4m3" / "fp8_e5m2"
    block_size: int = 16
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    attention_sinks: bool = False          # a learned per-head logit in the softmax (GPT-OSS)
    graph_capture: str = "none"           # "none", "torch.compile", "cuda_graphs", "xla"
    device: str = "cpu"
    causal: bool = True                   # False: bidirectional attention (encoder models)
    # Multi-head latent attention (DeepSeek V2/V3): the cache holds one compressed latent and rope key
    # per token (head_size = their width, one KV head), attended through `forward_mla`.
    mla: bool = False


class AttentionBackend:
    """One attention implementation. Subclass, declare capabilities, implement `forward`."""
    api_version: ClassVar[int] = ATTENTION_API_VERSION
    name: ClassVar[str] = ""
    supported_head_sizes: ClassVar[Optional[tuple[int, ...]]] = None   # None = any
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_block_sizes: ClassVar[Optional[tuple[int, ...]]] = None  # None = any power of two
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)   # platforms' dispatch keys; "*" = any
    supports_gqa: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    supports_attention_sinks: ClassVar[bool] = False
    supports_non_causal: ClassVar[bool] = False        # honours AttentionMetadata.causal=False
    supports_mla: ClassVar[bool] = False               # implements forward_mla (multi-head latent attention)
    supported_graph_modes: ClassVar[tuple[str, ...]] = ("none",)

    @classmethod
    def probe(cls) -> Optional[str]:
        """None when the backend's packages import here, else the reason they do not."""
        return None

    @classmethod
    def validate(cls, config: AttentionConfig) -> list[str]:
        """Every reason this backend cannot run `config`; empty when it can."""
        reasons: list[str] = []
        missing = cls.probe()
        if missing:
            reasons.append(missing)
        if "*" not in cls.supported_devices and config.device not in cls.supported_devices:
            reasons.append(f"device {config.device!r} not supported (supports {list(cls.supported_devices)})")
        if cls.supported_head_sizes is not None and config.head_size not in cls.supported_head_sizes:
            reasons.append(f"head size {config.head_size} not supported (supports {list(cls.supported_head_sizes)})")
        if config.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {config.dtype} not supported")
        if config.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(f"kv cache dtype {config.kv_cache_dtype!r} not supported "
                           f"(supports {list(cls.supported_kv_cache_dtypes)})")
        if cls.supported_block_sizes is not None and config.block_size not in cls.supported_block_sizes:
            reasons.append(f"block size {config.block_size} not supported "
                           f"(supports {list(cls.supported_block_sizes)})")
        if config.num_heads % config.num_kv_heads:
            reasons.append(f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}")
        elif config.num_heads != config.num_kv_heads and not cls.supports_gqa:
            reasons.append("grouped-query attention not supported")
        if config.sliding_window is not None and not cls.supports_sliding_window:
            reasons.append("sliding window not supported")
        if config.logits_soft_cap is not None and not cls.supports_logits_soft_cap:
            reasons.append("logits soft-cap not supported")
        if config.attention_sinks and not cls.supports_attention_sinks:
            reasons.append("attention sinks not supported")
        if config.mla and not cls.supports_mla:
            reasons.append("multi-head latent attention (MLA) not supported")
        if not config.causal and not cls.supports_non_causal:
            reasons.append("non-causal (bidirectional) attention not supported")
        if config.graph_capture not in cls.supported_graph_modes:
            reasons.append(f"graph capture {config.graph_capture!r} not supported "
                           f"(supports {list(cls.supported_graph_modes)})")
        return reasons

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: Optional[int] = None, logits_soft_cap: Optional[float] = None,
                 kv_cache_dtype: str = "auto") -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        # Per-tensor fp8 KV scales (vLLM's k_scale / v_scale): the cache holds x / scale, reads
        # give back stored * scale. 1.0 unless the checkpoint carries calibrated ones
        # (core/loaders/kv_scales.py); only an fp8 cache uses them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # Attention sinks (backends with supports_attention_sinks): a learned logit per query head
        # [num_heads], float32 or the model dtype, in each softmax's denominator and attending to no
        # value. Set by the attention layer after construction; None: none.
        self.sinks: Optional[torch.Tensor] = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Write key/value [T, Hkv, D] into kv_cache at metadata.slot_mapping, then attend.

        query: [T, H, D]. Returns [T, H, D] in query's dtype.
        """
        raise NotImplementedError

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                    kv_cache: torch.Tensor, metadata: AttentionMetadata, kv_b_weight: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention (backends with supports_mla): write latent [T, L] | k_pe [T, R]
        into kv_cache [num_blocks, block_size, L + R] at metadata.slot_mapping, then attend.

        q_nope [T, H, N], q_pe [T, H, R] (rotated); kv_b_weight [H, N + V, L] expands a latent into each
        head's key (its first N rows) and value (the last V): key = (W_UK latent | k_pe), value =
        W_UV latent. Returns [T, H, V] in q_nope's dtype."""
        raise NotImplementedError

    def native_decode_fn(self, kv_cache: torch.Tensor) -> Optional[int]:
        """The address of a C function with the NATIVE_DECODE_ABI signature that does what
        `forward` does for a decode-only batch over `kv_cache`, or None (the default) when this
        backend has none for it: fused decode steps then run the model eagerly."""
        return None


class AttentionBackendUnavailable(ValueError):
    """An explicitly requested backend cannot run the requested configuration."""

    def __init__(self, backend: str, reasons: list[str]) -> None:
        self.backend = backend
        self.reasons = list(reasons)
        super().__init__(f"attention backend {backend!r} cannot run here: " + "; ".join(self.reasons))


def check_backend(cls: type[AttentionBackend], config: AttentionConfig) -> None:
    """Raise AttentionBackendUnavailable (a ValueError) listing every reason `cls` cannot run `config`."""
    reasons = cls.validate(config)
    if reasons:
        raise AttentionBackendUnavailable(cls.name or cls.__name__, reasons)


def build_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: "torch.device | str" = "cpu",
                   num_decodes: Optional[int] = None) -> AttentionMetadata:
    """AttentionMetadata from per-sequence host lists (decodes must come first).

    block_tables[i] lists sequence i's physical blocks in order; it must cover seq_lens[i].
    The slot mapping covers each sequence's new tokens (positions seq_len - query_len ... seq_len - 1).
    """
    assert len(query_lens) == len(seq_lens) == len(block_tables)
    if num_decodes is None:
        num_decodes = 0
        for q in query_lens:
            if q != 1:
                break
            num_decodes += 1
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    slots: list[int] = []
    for q, s, table in zip(query_lens, seq_lens, block_tables):
        if len(table) * block_size < s:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {s} tokens")
        for pos in range(s - q, s):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max([len(t) for t in block_tables] + [1])
    bt = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for i, table in enumerate(block_tables):
        if table:
            bt[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=bt.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decodes=num_decodes,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )


KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype a `kv_cache_dtype` name stands for ("auto": the model's activations)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not known; choose auto or one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values as an fp8 cache stores them: x / scale, saturated to the format's finite range
    (a plain cast would turn e4m3's overflow into NaN); other cache dtypes: a cast."""
    if cache_dtype not in FP8_DTYPES:
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    scaled = x.float() / scale if scale != 1.0 else x.float()      # (x itself for float32 x: no in-place ops)
    return scaled.clamp(-limit, limit).to(cache_dtype)


def from_kv(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What attention reads back from the cache, in `dtype`: stored * scale for fp8."""
    if stored.dtype not in FP8_DTYPES or scale == 1.0:
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def kv_round_trip(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as attention sees it after a write to and a read from a cache of `cache_dtype`."""
    return x if cache_dtype == x.dtype else from_kv(to_kv(x, cache_dtype, scale), x.dtype, scale)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter this step's keys/values into their paged slots (the default cache layout); an
    fp8 cache stores key / k_scale and value / v_scale, saturated (to_kv)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    # One row of heads x head_size per slot: torch's CPU index_copy_ copies 2-D rows one contiguous
    # memcpy each, and the same bytes as [slots, heads, head_size] slices element by element, far
    # slower.
    width = kv_cache.shape[3] * kv_cache.shape[4]
    flat = kv_cache.view(2, num_blocks * block_size, width)
    key = to_kv(key, flat.dtype, k_scale).reshape(-1, width)
    value = to_kv(value, flat.dtype, v_scale).reshape(-1, width)
    if flat.element_size() == 1 and flat.dtype != torch.uint8:   # fp8: index_copy_ has no fp8 kernel on CPU
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)
