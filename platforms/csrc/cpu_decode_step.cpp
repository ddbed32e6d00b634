// The cpu platform's fused decode step (platforms/cpu_fused_decode.py): one call runs a range of a
// decoder's layers for a few decoding tokens — embedding (times the model's embedding scale), then
// per layer the layer vocabulary of platforms/interface.py LayerStructure: RMSNorm (weights handed
// in already as offset + w) or LayerNorm (with or without bias) before attention, after it, before
// and after the FFN, or none (each slot a null pointer when the placement has no norm there); QKV
// matmul (+ bias), q/k norms per head or over the whole projection, rotary embedding rotating
// halves or GPT-J pairs over the leading rotary_dim dims from the layer's own table (or none:
// NoPE), paged attention (the attention backend's own kernel, e.g. paged_decode.cpp's, through a
// function pointer with the ABI of attention_backends/interface.py NATIVE_DECODE_ABI) over the
// layer's KV group's slots and block tables, O projection, a gated (SiLU, GELU-tanh, GELU, xIELU)
// or plain FFN, sequential or parallel blocks, residual scaling — and the final norm.
//
// A layer range: the Python side runs the layers this step cannot express eagerly in between
// (first_layer > 0 reads the residual stream from `stream`, last_layer < num_layers writes it there).
//
// The same matmuls also serve one mixture-of-experts layer's experts per call (fused_moe: tokens
// sorted by expert, each active expert's weights read once, for platforms/cpu_moe.py), and a
// layer's FFN may be such an expert FFN inside the step (FusedLayer.moe: router, top-k, fused_moe,
// shared expert).
//
// Why: a one-token step through torch is ~1,300 small ops, ctypes calls and Python across 30
// layers, more time than the arithmetic. Here the Python side makes one call per step.
//
// Weights, re-laid out once by the Python side, in blocks of 16 output rows so one 512-bit
// register holds one value for each of 16 rows (no horizontal sums):
//  * Q4 (quantization="int4"): per group of 32 inputs, w = scale * q + low, q in 0..15. Per
//    (row block, group): 4 x 64 bytes, vector j holding for each row r the 4 inputs of chunk 2j
//    (low nibbles) and chunk 2j + 1 (high nibbles); scales and lows as fp16 [block][group][16].
//    The activation is quantized per 32 inputs to int8 (scale sa, as llama.cpp's Q8 operand),
//    so a group is 8 VNNI u8 x s8 dot products: y += scale*sa*sum(q*a8) + low*sa*sum(a8).
//  * Q8 (the LM head under quantization="int4"): w = scale * w8 per group of 32, w8 signed,
//    [block][group][8 chunks][16 rows][4]; the activation as u8 = a8 + 128 (VNNI multiplies u8 by
//    s8), so y += scale*sa*dot(u8, w8) - sa * (128 * scale * sum(w8)).
//  * S8 (batches under quantization="int4", every step under "int8"): w = scale[row] * w8, one
//    scale per output row, w8 signed [block][K/4][16 rows][4], and per (block, group of 32) the
//    int32 -128 * sum(w8) of each row. The activation as u8 = a8 + 128 (per 32 inputs, as Q8): a
//    group's int32 dot starts from that correction, so it comes out as sum(a8 * w8) exactly and
//    costs one convert and one multiply-add per 8 dot products (Q8's per-group weight scale and
//    float correction cost three more); the row scale is applied once at the end. Tiles of 2
//    blocks x 6 tokens share each weight load across 6 tokens and each broadcast across 2 blocks.
//  * BF16 (dtype=bfloat16): [block][K/2][16][2] bf16 pairs, the activation rounded to bf16,
//    AVX512-BF16 dot products accumulating in float32, or AMX tiles where the CPU has them.
//  * GGUF kept quantized (quantization="gguf"): the quantization method's own packed parts
//    (platforms/cpu_gguf_kernels.py), used in place: Q4 (Q4_0, Q4_1), Q8 (Q8_0) and the
//    Q4K / Q6K kinds below; the embedding rows come looked up by the caller.
// Plain C++ with OpenMP and intrinsics, no torch headers (built by platforms/native_build.py).
//
// Instruction sets: the library needs AVX512-VNNI (every quantized kind, the activation
// quantization): a target without it gets no library (tokenmill_cpu.h refuses the build;
// native_build reports "this CPU has no AVX512-VNNI" and the callers run their torch paths).
// BF16 weights need AVX512-BF16 and AMX tiles AMX-BF16: optional, reported by fused_decode_caps()
// (& 2, & 4), which the Python side checks before handing over such weights; their code
// exists only under TM_AVX512_BF16 / TM_AMX_BF16.
#define TOKENMILL_REQUIRES_AVX512_VNNI 1
#include "tokenmill_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

namespace {

namespace tm = tokenmill_cpu;

constexpr int64_t kRows = 16;     // output rows per block
constexpr int64_t kGroup = 32;    // Q4 group along the input
constexpr int64_t kTok = 8;       // tokens sharing one pass over a weight block
// Steps of at least this many tokens run their per-token work (norms, rope, SiLU, activation
// rounding) on every thread; below it a parallel region costs more than the rows it splits.
constexpr int64_t kParallelRows = 8;

typedef void (*AttendFn)(const float* q, const float* k, const float* v, void* kv_cache, const int64_t* slots,
                         const int32_t* tables, int64_t table_stride, const int32_t* lens, float* out,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                         int64_t block_size, int64_t num_blocks, float scale, int64_t window, float k_scale,
                         float v_scale, float softcap);

}  // namespace

extern "C" {

struct FusedLinear {
  int64_t kind;             // 0 = Q4, 1 = BF16, 2 = Q8, 3 = Q4K, 4 = Q6K (fused_matmul only), 5 = S8
  int64_t n, k;             // output rows (multiple of 16), inputs (multiple of 32; 256: Q4K, Q6K)
  const uint8_t* weight;
  const uint16_t* scales;   // Q4, Q8: fp16 [n/16][k/32][16]; Q4K, Q6K: records [n/16][k/256] (below)
  const uint16_t* lows;     // Q4: fp16 lows; Q8: float32 128 * scale * sum(w8) of the group;
                            // null: Q4 low = -8 * scale, Q8 the sums computed on the fly (GGUF Q4_0/Q8_0)
                            // S8: scales is float32 [n] (per row), lows int32 [n/16][k/32][16]
  const float* bias;        // [n] or null
};

// One mixture-of-experts layer's experts (fused_moe). w13[e]: expert e's gate rows then up rows
// (n = 2 * inter, k = hidden); w2[e]: its down projection (n = hidden, k = inter). Every w13 of
// a layer has one kind, every w2 one kind (they may differ: GGUF files mix them).
struct FusedMoeLayer {
  int64_t num_experts, hidden, inter, activation;   // activation: moe_activate's codes
  const FusedLinear* w13;
  const FusedLinear* w2;
  const float* b13;         // [num_experts, 2 * inter] gate then up biases, or null (GPT-OSS has them)
  const float* b2;          // [num_experts, hidden], or null
  float alpha, limit;       // activation 4's constants
};

// A layer's expert FFN inside the step (FusedLayer.moe, platforms/cpu_fused_moe.py): the router
// (logits = x W^T + bias; with bf16 weights x and the logits rounded to bf16, as torch's bf16
// linear gives them), scores by softmax or sigmoid, the top_k by score (+ correction bias, which
// picks experts without weighting them; DeepSeek's groups: only the best topk_groups of num_groups
// groups eligible), renormalized, times routed_scaling, rounded to bf16 where the model multiplies
// them in bf16; the experts (fused_moe); a shared expert every token runs, times sigmoid of its
// gate where it has one.
struct FusedMoeFfn {
  FusedMoeLayer experts;
  const void* router;             // [num_experts, hidden] float32, or bf16 (router_bf16)
  const float* router_bias;       // [num_experts] or null
  const float* correction_bias;   // [num_experts] or null
  int64_t router_bf16;
  int64_t top_k;                  // <= 64
  int64_t scoring;                // 0 softmax, 1 sigmoid
  int64_t renormalize;
  int64_t num_groups, topk_groups;   // num_groups <= 1: no groups
  int64_t round_weights;          // 1: routing weights rounded to bf16 before they multiply
  float routed_scaling;
  FusedLinear shared_gate_up;     // the shared expert's [gate | up] (n 0: no shared expert)
  FusedLinear shared_down;
  const void* shared_gate;        // [hidden] weight of its sigmoid gate (as the router's dtype), or null
  // Where the step copies its routing (ids [tokens, top_k]) for the per-expert token counts
  // (core/layers/expert_tokens.py), room for noted_rows tokens; null: not counted.
  int64_t* noted_ids;
  int64_t noted_rows;
};

// One layer. Norm weights are float32 [hidden] (null: no norm in that slot); biases null unless
// norm_kind is 1 (LayerNorm with bias).
struct FusedLayer {
  const float* input_norm;        // before attention
  const float* post_norm;         // before the FFN
  const float* attn_out_norm;     // on attention's output (sandwich / post placements)
  const float* ffn_out_norm;      // on the FFN's output
  const float* input_norm_bias;
  const float* post_norm_bias;
  const float* attn_out_norm_bias;
  const float* ffn_out_norm_bias;
  const float* q_norm;            // RMSNorm of q: [head_size] (per head) or [num_heads * head_size]
  const float* k_norm;
  FusedLinear qkv, o, gate_up, down;  // gate_up: [gate | up] when gated, up alone when plain
  void* kv_cache;
  const float* cos_sin;           // [positions, rotary_dim]: cos | sin; null: no rotary (NoPE)
  int64_t window;                 // sliding window, 0 = none
  int64_t group;                  // KV group: which of the step's slots / block tables
  int64_t norm_kind;              // 0 RMSNorm, 1 LayerNorm (+ bias where given)
  int64_t qk_norm;                // 0 none, 1 per head, 2 over the whole projection
  int64_t rope_gptj;              // 0 rotate halves, 1 GPT-J pairs
  int64_t rotary_dim;             // leading dims of each head that rotate
  int64_t activation;             // 0 SiLU, 1 GELU (tanh), 2 GELU (erf), 3 xIELU
  int64_t gated;                  // 1: act(gate) * up; 0: act(up)
  int64_t parallel_block;         // attention and FFN from the same normed input
  float residual_scale;           // each block's output times this before the residual add
  float attn_scale;
  float k_scale, v_scale;         // an fp8 cache's per-tensor scales (1 for other caches)
  float act_alpha_p, act_alpha_n, act_beta, act_eps;   // xIELU's constants (softplus applied)
  float attn_softcap;             // attention logit soft-cap, 0 = none
  const FusedMoeFfn* moe;         // an expert FFN instead of gate_up / down (null: dense or plain)
};

struct FusedModel {
  int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_size;
  int64_t num_blocks, block_size;
  float eps, embedding_scale;
  const void* embedding;    // [vocab, hidden]
  int64_t embedding_bf16;
  const float* final_norm;
  const float* final_norm_bias;
  int64_t final_norm_kind;
  const FusedLayer* layers;
  void* attend;             // AttendFn
};

// One step's inputs. slots / tables / table_strides: one per KV group (hybrid KV: sliding and full
// layers hold separate block tables); lens [tokens] the context length of each row.
struct FusedStep {
  const int64_t* ids;
  const int64_t* positions;
  const int64_t* const* slots;
  const int32_t* const* tables;
  const int64_t* table_strides;
  const int32_t* lens;
  int64_t tokens;
  int64_t first_layer, last_layer;
  float* stream;            // [tokens, hidden]: the residual stream in (first_layer > 0) / out (last_layer < num_layers)
  const float* embedded;    // [tokens, hidden] rows already looked up (an embedding only the model reads), or null
  void* out;                // [tokens, hidden] after the final norm (last_layer == num_layers)
  int64_t out_bf16;
};

}  // extern "C"

namespace {

// Per-token scratch: the activation in the form a matmul reads.
struct QuantizedInput {
  std::vector<int8_t> q;        // [tokens, k]
  std::vector<uint8_t> qu;      // [tokens, k]: q + 128
  std::vector<float> scale;     // [tokens, k/32]: sa
  std::vector<float> offset;    // [tokens, k/32]: sa * sum(a8)
  std::vector<uint16_t> bf16;   // [tokens, k]
};

void quantize_q8(const float* x, int64_t tokens, int64_t k, QuantizedInput& in) {
  const int64_t groups = k / kGroup;
  in.q.resize(tokens * k);
  in.qu.resize(tokens * k);
  in.scale.resize(tokens * groups);
  in.offset.resize(tokens * groups);
#pragma omp parallel for schedule(static) if (tokens >= kParallelRows)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = x + t * k + g * kGroup;
      {  // 16 lanes at a time (cvtps rounds to nearest even, as nearbyint would)
        const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float sa = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(sa > 0.0f ? 1.0f / sa : 0.0f);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        const __m128i blo = _mm512_cvtsepi32_epi8(qlo), bhi = _mm512_cvtsepi32_epi8(qhi);
        int8_t* dst = in.q.data() + t * k + g * kGroup;
        uint8_t* dst_u = in.qu.data() + t * k + g * kGroup;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), blo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), bhi);
        const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst_u), _mm_xor_si128(blo, flip));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst_u + 16), _mm_xor_si128(bhi, flip));
        in.scale[t * groups + g] = sa;
        in.offset[t * groups + g] = sa * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
      }
    }
}

void round_bf16(const float* x, int64_t count, QuantizedInput& in, int64_t rows = 1) {
  in.bf16.resize(count);
#pragma omp parallel for schedule(static) if (rows >= kParallelRows)
  for (int64_t i = 0; i < count; ++i) in.bf16[i] = tm::f32_to_bf16(x[i]);   // nearest even, as torch
}

// One group of 32 inputs of a 4-bit block (16 rows) into the T tokens' accumulators:
// acc += scale * sa * dot(q, a) + low * offset (the activation's per-group scale and offset).
// Nibbles as stored: 4 x 64 bytes, low halves inputs 0-15 of a row pair, high halves 16-31.
template <int T>
inline void q4_group(const uint8_t* gw, __m512 scale, __m512 low, const QuantizedInput& in, int64_t t0,
                     int64_t k, int64_t groups, int64_t g, __m512* acc) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i wv[8];
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(gw + j * 64);
    wv[2 * j] = _mm512_and_si512(v, nibble);
    wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
  for (int t = 0; t < T; ++t) {
    const int32_t* a = reinterpret_cast<const int32_t*>(in.q.data() + (t0 + t) * k + g * kGroup);
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      even = _mm512_dpbusd_epi32(even, wv[c], _mm512_set1_epi32(a[c]));
      odd = _mm512_dpbusd_epi32(odd, wv[c + 1], _mm512_set1_epi32(a[c + 1]));
    }
    const float sa = in.scale[(t0 + t) * groups + g];
    const float off = in.offset[(t0 + t) * groups + g];
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
    acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(sa)), acc[t]);
    acc[t] = _mm512_fmadd_ps(low, _mm512_set1_ps(off), acc[t]);
  }
}

// y[t, rows of block b] for up to kTok tokens.
template <int T>
inline void q4_block(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t t0, float* y,
                     int64_t y_stride) {
  const int64_t groups = w.k / kGroup;
  const uint8_t* wb = w.weight + b * groups * 256;
  const uint16_t* sb = w.scales + b * groups * kRows;
  const uint16_t* lb = w.lows ? w.lows + b * groups * kRows : nullptr;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + g * kRows)));
    // lows null: GGUF Q4_0's w = d * (q - 8), so low = -8 * scale (no second array to read).
    const __m512 low = w.lows ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lb + g * kRows)))
                              : _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f));
    q4_group<T>(wb + g * 256, scale, low, in, t0, w.k, groups, g, acc);
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (t0 + t) * y_stride + b * kRows, acc[t]);
}

template <int T>
inline void q8_block(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t t0, float* y,
                     int64_t y_stride) {
  const int64_t groups = w.k / kGroup;
  const uint8_t* wb = w.weight + b * groups * 512;
  const uint16_t* sb = w.scales + b * groups * kRows;
  const float* cb = w.lows ? reinterpret_cast<const float*>(w.lows) + b * groups * kRows : nullptr;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + g * kRows)));
    __m512 corr;                                            // float32: it cancels a large term
    if (w.lows) {
      corr = _mm512_loadu_ps(cb + g * kRows);
    } else {  // not stored (GGUF Q8_0 kept at the file's size): 128 * scale * sum(w8), summed here
      __m512i sum = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), _mm512_loadu_si512(wb + g * 512 + c * 64));
      corr = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale), _mm512_set1_ps(128.0f));
    }
    for (int t = 0; t < T; ++t) {
      const int32_t* a = reinterpret_cast<const int32_t*>(in.qu.data() + (t0 + t) * w.k + g * kGroup);
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        even = _mm512_dpbusd_epi32(even, _mm512_set1_epi32(a[c]), _mm512_loadu_si512(wb + g * 512 + c * 64));
        odd = _mm512_dpbusd_epi32(odd, _mm512_set1_epi32(a[c + 1]), _mm512_loadu_si512(wb + g * 512 + c * 64 + 64));
      }
      const float sa = in.scale[(t0 + t) * groups + g];
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(sa)), acc[t]);
      acc[t] = _mm512_fnmadd_ps(corr, _mm512_set1_ps(sa), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (t0 + t) * y_stride + b * kRows, acc[t]);
}

// S8: NB consecutive row blocks from b for T tokens (see the layout notes at the top). Per row
// the same integer dots and the same float sequence (one multiply-add per group, in group order,
// then the row scale) whatever NB and T are, so a row's result does not depend on its tile.
template <int NB, int T>
inline void s8_tile(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t t0, float* y,
                    int64_t y_stride) {
  const int64_t groups = w.k / kGroup;
  const int64_t block_bytes = w.k * kRows;
  const uint8_t* wb = w.weight + b * block_bytes;
  const int32_t* cb = reinterpret_cast<const int32_t*>(w.lows) + b * groups * kRows;
  const float* row_scale = reinterpret_cast<const float*>(w.scales) + b * kRows;
  __m512 acc[T][NB];
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < NB; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[T][NB];
    for (int j = 0; j < NB; ++j) {
      const __m512i corr = _mm512_loadu_si512(cb + (j * groups + g) * kRows);
      for (int t = 0; t < T; ++t) dot[t][j] = corr;
    }
    const uint8_t* wg = wb + g * 512;
    for (int c = 0; c < 8; ++c) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wg + j * block_bytes + c * 64);
      for (int t = 0; t < T; ++t) {
        int32_t four;
        std::memcpy(&four, in.qu.data() + (t0 + t) * w.k + g * kGroup + c * 4, sizeof four);
        const __m512i a = _mm512_set1_epi32(four);
        for (int j = 0; j < NB; ++j) dot[t][j] = _mm512_dpbusd_epi32(dot[t][j], a, wv[j]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 sa = _mm512_set1_ps(in.scale[(t0 + t) * groups + g]);
      for (int j = 0; j < NB; ++j) acc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][j]), sa, acc[t][j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 scale = _mm512_loadu_ps(row_scale + j * kRows);
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (t0 + t) * y_stride + (b + j) * kRows, _mm512_mul_ps(acc[t][j], scale));
  }
}

// All tokens for the NB blocks from b: tiles of 6 tokens, then the rest.
template <int NB>
inline void s8_blocks(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t tokens, float* y) {
  int64_t t0 = 0;
  for (; t0 + 6 <= tokens; t0 += 6) s8_tile<NB, 6>(w, b, in, t0, y, w.n);
  switch (tokens - t0) {
    case 5: s8_tile<NB, 5>(w, b, in, t0, y, w.n); break;
    case 4: s8_tile<NB, 4>(w, b, in, t0, y, w.n); break;
    case 3: s8_tile<NB, 3>(w, b, in, t0, y, w.n); break;
    case 2: s8_tile<NB, 2>(w, b, in, t0, y, w.n); break;
    case 1: s8_tile<NB, 1>(w, b, in, t0, y, w.n); break;
    default: break;
  }
}

void s8_matmul(const FusedLinear& w, const QuantizedInput& in, int64_t tokens, float* y) {
  const int64_t blocks = w.n / kRows;
  if (tokens == 1) {
    // One token reads the weights once: 4 blocks a pass keep more loads in flight.
#pragma omp parallel for schedule(static)
    for (int64_t bq = 0; bq < blocks / 4; ++bq) s8_tile<4, 1>(w, 4 * bq, in, 0, y, w.n);
    for (int64_t b = blocks / 4 * 4; b < blocks; ++b) s8_tile<1, 1>(w, b, in, 0, y, w.n);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t bp = 0; bp < blocks / 2; ++bp) s8_blocks<2>(w, 2 * bp, in, tokens, y);
  if (blocks % 2) s8_blocks<1>(w, blocks - 1, in, tokens, y);
}

#if TM_AVX512_BF16

template <int T>
inline void bf16_block(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t t0, float* y,
                       int64_t y_stride) {
  const int64_t pairs = w.k / 2;
  const uint8_t* wb = w.weight + b * pairs * 64;
  // Two accumulators per token: the dot products' latency, not their count, bounds one row block.
  __m512 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + p * 64);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + (p + 1) * 64);
    for (int t = 0; t < T; ++t) {
      const int32_t* a = reinterpret_cast<const int32_t*>(in.bf16.data() + (t0 + t) * w.k);
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w0, (__m512bh)_mm512_set1_epi32(a[p]));
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], w1, (__m512bh)_mm512_set1_epi32(a[p + 1]));
    }
  }
  for (int t = 0; t < T; ++t)
    _mm512_storeu_ps(y + (t0 + t) * y_stride + b * kRows, _mm512_add_ps(acc[t][0], acc[t][1]));
}
// Blocks b and b + 1 (32 output rows) for T tokens: each token's broadcast serves two weight
// vectors, so a pass loads 4 weights + 2T activations for 4T dot products (bf16_block: 2 + 2T
// for 2T). Per row the same two accumulators over the same pairs as bf16_block, so a row's
// result does not depend on which tile computed it.
template <int T>
inline void bf16_block2(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t t0, float* y,
                        int64_t y_stride) {
  const int64_t pairs = w.k / 2;
  const uint8_t* wa = w.weight + b * pairs * 64;
  const uint8_t* wb = wa + pairs * 64;
  __m512 acc[T][2][2];     // token, block, even/odd pair
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < 2; ++j) acc[t][j][0] = acc[t][j][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 2) {
    const __m512bh a0 = (__m512bh)_mm512_loadu_si512(wa + p * 64);
    const __m512bh a1 = (__m512bh)_mm512_loadu_si512(wa + (p + 1) * 64);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(wb + p * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(wb + (p + 1) * 64);
    for (int t = 0; t < T; ++t) {
      const int32_t* a = reinterpret_cast<const int32_t*>(in.bf16.data() + (t0 + t) * w.k);
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(a[p]), x1 = (__m512bh)_mm512_set1_epi32(a[p + 1]);
      acc[t][0][0] = _mm512_dpbf16_ps(acc[t][0][0], a0, x0);
      acc[t][0][1] = _mm512_dpbf16_ps(acc[t][0][1], a1, x1);
      acc[t][1][0] = _mm512_dpbf16_ps(acc[t][1][0], b0, x0);
      acc[t][1][1] = _mm512_dpbf16_ps(acc[t][1][1], b1, x1);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < 2; ++j)
      _mm512_storeu_ps(y + (t0 + t) * y_stride + (b + j) * kRows, _mm512_add_ps(acc[t][j][0], acc[t][j][1]));
}

#if TM_AMX_BF16
// AMX (Sapphire Rapids and later): bf16 steps of kAmxTokens+ tokens as 16 x 16 float32 tiles,
// C += A (16 tokens x 32 inputs) . B (16 input pairs x 16 rows x 2). The BF16 weight layout
// [block][K/2][16][2] is already B's: a block's 16 pairs of a 32-input chunk are 1 KiB, 64 bytes
// a pair row. The tiles outrun vdpbf16ps (whose rate does not grow with rows) and oneDNN's own
// AMX GEMM from 16 rows up (`tokenmill bench gemm`); one row reads the weights as fast as the
// vector path, so every row count takes the tiles and a row's result does not depend on its batch.
constexpr int64_t kAmxTokens = 1;

using tm::amx_ready;

// Where a matmul's activation tiles come from and where its output tiles go. Activations: bf16
// rows, `k` inputs each; a tile starting at or past `tail_start` reads `tail` (the last partial
// tile, zero-padded to 16 rows) so the rows need no copy. Output: float32 rows into y (the fused
// step) or bf16 rows into y_bf16 with the bias added first (the eager bf16 linears).
struct AmxOperands {
  const uint8_t* rows;
  const uint8_t* tail;
  int64_t tail_start, tokens;
  float* y;
  uint16_t* y_bf16;
  const float* bias;
  const uint8_t* tile(int64_t t0, int64_t stride) const {
    return t0 >= tail_start ? tail + (t0 - tail_start) * stride : rows + t0 * stride;
  }
};

// Output tile (token tile t0, block b) from tile register C: straight into y when all 16 tokens
// are real and y is float32, else through a scratch tile (padding rows dropped; bias added and
// rounded to nearest even for bf16 output, as torch rounds). A macro: gcc's tile intrinsics take
// the register number as a literal.
#define TM_AMX_STORE(C, t0_, b_)                                                              \
  do {                                                                                        \
    const int64_t first = (t0_), block = (b_);                                                \
    if (!op.y_bf16 && first + 16 <= op.tokens) {                                              \
      _tile_stored(C, op.y + first * w.n + block * kRows, w.n * 4);                           \
    } else {                                                                                  \
      _tile_stored(C, scratch, 64);                                                           \
      const int64_t last = std::min(first + 16, op.tokens);                                   \
      if (op.y_bf16) {                                                                        \
        const __m512 bias = op.bias ? _mm512_loadu_ps(op.bias + block * kRows) : _mm512_setzero_ps(); \
        for (int64_t t = first; t < last; ++t) {                                              \
          const __m512 v = _mm512_add_ps(_mm512_load_ps(scratch + (t - first) * 16), bias);   \
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(op.y_bf16 + t * w.n + block * kRows),  \
                              tm::f32x16_to_bf16(v));                                         \
        }                                                                                     \
      } else {                                                                                \
        for (int64_t t = first; t < last; ++t)                                                \
          std::memcpy(op.y + t * w.n + block * kRows, scratch + (t - first) * 16, 64);        \
      }                                                                                       \
    }                                                                                         \
  } while (0)

// Up to 2 blocks x 2 token tiles: tiles 0-3 accumulate, 4-5 hold activations, 6-7 weights.
template <bool TwoBlocks, bool TwoTiles>
inline void amx_bf16_item(const FusedLinear& w, const AmxOperands& op, int64_t b, int64_t t0, float* scratch) {
  const int64_t a_stride = w.k * 2, chunks = w.k / 32, block_bytes = w.k * kRows * 2;
  const uint8_t* w0 = w.weight + b * block_bytes;
  const uint8_t* a0 = op.tile(t0, a_stride);
  const uint8_t* a1 = TwoTiles ? op.tile(t0 + 16, a_stride) : nullptr;
  _tile_zero(0);
  if (TwoBlocks) _tile_zero(1);
  if (TwoTiles) _tile_zero(2);
  if (TwoBlocks && TwoTiles) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, a0 + c * 64, a_stride);
    _tile_loadd(6, w0 + c * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TwoBlocks) {
      _tile_loadd(7, w0 + block_bytes + c * 1024, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (TwoTiles) {
      _tile_loadd(5, a1 + c * 64, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (TwoBlocks) _tile_dpbf16ps(3, 5, 7);
    }
  }
  TM_AMX_STORE(0, t0, b);
  if (TwoBlocks) TM_AMX_STORE(1, t0, b + 1);
  if (TwoTiles) TM_AMX_STORE(2, t0 + 16, b);
  if (TwoBlocks && TwoTiles) TM_AMX_STORE(3, t0 + 16, b + 1);
}
#undef TM_AMX_STORE

// Token tiles a work item sweeps: 256 tokens of a 576-input activation are 288 KiB, so a chunk
// stays in L2 while the item's thread walks the weight blocks (a prompt of 2048 tokens otherwise
// streamed its whole activation once per block pair).
constexpr int64_t kAmxChunkTiles = 16;

// y = activations x W^T on tiles. Items of (chunk of token tiles, pair of blocks), chunk-major;
// each item runs 2 blocks x 2 token tiles at a time. Every tile's sum runs over the same chunks
// in the same order whatever the item, so a row's result does not depend on its batch.
void amx_bf16_run(const FusedLinear& w, const AmxOperands& op) {
  const int64_t tiles = (op.tokens + 15) / 16, blocks = w.n / kRows;
  const int64_t block_pairs = (blocks + 1) / 2, chunks = (tiles + kAmxChunkTiles - 1) / kAmxChunkTiles;
#pragma omp parallel
  {
    tm::configure_tiles();
    alignas(64) float scratch[16 * 16];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < chunks * block_pairs; ++item) {
      const int64_t b = 2 * (item % block_pairs), chunk = item / block_pairs;
      const bool two_blocks = b + 1 < blocks;
      const int64_t end = std::min(tiles, (chunk + 1) * kAmxChunkTiles);
      for (int64_t tile = chunk * kAmxChunkTiles; tile < end; tile += 2) {
        const int64_t t0 = 16 * tile;
        const bool two_tiles = tile + 1 < end;
        if (two_blocks && two_tiles) amx_bf16_item<true, true>(w, op, b, t0, scratch);
        else if (two_blocks) amx_bf16_item<true, false>(w, op, b, t0, scratch);
        else if (two_tiles) amx_bf16_item<false, true>(w, op, b, t0, scratch);
        else amx_bf16_item<false, false>(w, op, b, t0, scratch);
      }
    }
    _tile_release();
  }
}

// The fused step's matmul: y [tokens, n] float32 = bf16 activations (in.bf16, padded here to
// whole tiles of 16 tokens) x W^T.
bool amx_bf16_matmul(const FusedLinear& w, QuantizedInput& in, int64_t tokens, float* y) {
  if (tokens < kAmxTokens || !amx_ready()) return false;
  const int64_t padded = (tokens + 15) / 16 * 16;
  in.bf16.resize(padded * w.k);
  std::fill(in.bf16.begin() + tokens * w.k, in.bf16.end(), 0);
  const uint8_t* a = reinterpret_cast<const uint8_t*>(in.bf16.data());
  amx_bf16_run(w, AmxOperands{a, a, padded, tokens, y, nullptr, nullptr});
  return true;
}

// The eager path's bf16 linears: x [tokens, k] bf16 as torch holds it, y [tokens, n] bf16.
bool amx_bf16_linear(const FusedLinear& w, const uint16_t* x, int64_t tokens, const float* bias, uint16_t* y) {
  if (!amx_ready()) return false;
  thread_local std::vector<uint16_t> tail;
  const int64_t tail_start = tokens / 16 * 16, tail_rows = tokens - tail_start;
  tail.assign(16 * w.k, 0);
  std::memcpy(tail.data(), x + tail_start * w.k, tail_rows * w.k * sizeof(uint16_t));
  amx_bf16_run(w, AmxOperands{reinterpret_cast<const uint8_t*>(x), reinterpret_cast<const uint8_t*>(tail.data()),
                              tail_start, tokens, nullptr, y, bias});
  return true;
}
#endif  // TM_AMX_BF16
#endif  // TM_AVX512_BF16

// GGUF K-quants kept at the file's size (platforms/cpu_gguf_kernels.py packs them). Super-blocks
// of 256 inputs = 8 groups of 32; per (row block, super-block) one metadata record in `scales`:
//  * Q4K: nibbles exactly as Q4; record = d fp16[16], dmin fp16[16], sc u8[8][16], m u8[8][16]
//    (320 bytes): w = d*sc*q - dmin*m, ggml's Q4_K arithmetic (d*sc exact in float32).
//  * Q6K: per (row block, group) 384 bytes: 4 x 64 bytes of low nibbles as Q4, then 2 x 64 bytes
//    of high bit pairs (vector h, byte bits 2c..2c+1 = chunk 4h + c); record = d fp16[16], then
//    int8 scales [16 sub-groups of 16][16 rows] (288 bytes): w = d*sc16*(q - 32). The 6-bit
//    values become s8 (q - 32) times the u8 activation (a8 + 128), as Q8, with the two 16-wide
//    halves of a group summed apart (each has its own scale) and 128*sum(w) subtracted exactly.
constexpr int64_t kSuper = 256;
constexpr int64_t kQ4KRecord = 320, kQ6KRecord = 288, kQ6KGroupBytes = 384;

inline __m512 load_fp16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load_s8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int T>
inline void q4k_block(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t t0, float* y,
                      int64_t y_stride) {
  const int64_t groups = w.k / kGroup, supers = w.k / kSuper;
  const uint8_t* wb = w.weight + b * groups * 256;
  const uint8_t* rb = reinterpret_cast<const uint8_t*>(w.scales) + b * supers * kQ4KRecord;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* rec = rb + s * kQ4KRecord;
    const __m512 d = load_fp16x16(rec), dmin = load_fp16x16(rec + 32);
    for (int64_t gi = 0; gi < kSuper / kGroup; ++gi) {
      const int64_t g = s * (kSuper / kGroup) + gi;
      const __m512 scale = _mm512_mul_ps(d, load_u8x16(rec + 64 + gi * kRows));       // d * sc
      // Q4_K: w = d * sc * q - dmin * m, so low = -(dmin * m) (negation is exact).
      const __m512 low = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, load_u8x16(rec + 192 + gi * kRows)));
      q4_group<T>(wb + g * 256, scale, low, in, t0, w.k, groups, g, acc);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (t0 + t) * y_stride + b * kRows, acc[t]);
}

template <int T>
inline void q6k_block(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t t0, float* y,
                      int64_t y_stride) {
  const int64_t groups = w.k / kGroup, supers = w.k / kSuper;
  const __m512i nibble = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
  const __m512i ones = _mm512_set1_epi8(1);
  const uint8_t* wb = w.weight + b * groups * kQ6KGroupBytes;
  const uint8_t* rb = reinterpret_cast<const uint8_t*>(w.scales) + b * supers * kQ6KRecord;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* rec = rb + s * kQ6KRecord;
    const __m512 d = load_fp16x16(rec);
    for (int64_t gi = 0; gi < kSuper / kGroup; ++gi) {
      const int64_t g = s * (kSuper / kGroup) + gi;
      const uint8_t* gw = wb + g * kQ6KGroupBytes;
      const __m512i h0 = _mm512_loadu_si512(gw + 256), h1 = _mm512_loadu_si512(gw + 320);
      // High pair of chunk c sits at bits 2(c%4) of vector c/4; moved to bits 4..5 (16-bit shifts
      // only carry bits across bytes into positions the 0x30 mask drops).
      const __m512i high[8] = {
          _mm512_and_si512(_mm512_slli_epi16(h0, 4), pair), _mm512_and_si512(_mm512_slli_epi16(h0, 2), pair),
          _mm512_and_si512(h0, pair), _mm512_and_si512(_mm512_srli_epi16(h0, 2), pair),
          _mm512_and_si512(_mm512_slli_epi16(h1, 4), pair), _mm512_and_si512(_mm512_slli_epi16(h1, 2), pair),
          _mm512_and_si512(h1, pair), _mm512_and_si512(_mm512_srli_epi16(h1, 2), pair)};
      __m512i wv[8];
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(gw + j * 64);
        wv[2 * j] = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(v, nibble), high[2 * j]), bias);
        wv[2 * j + 1] = _mm512_sub_epi8(
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), high[2 * j + 1]), bias);
      }
      // The u8 operand is a8 + 128: 128 * sum(w) of each half comes off its integer dot.
      __m512i sum_lo = _mm512_setzero_si512(), sum_hi = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        sum_lo = _mm512_dpbusd_epi32(sum_lo, ones, wv[c]);
        sum_hi = _mm512_dpbusd_epi32(sum_hi, ones, wv[c + 4]);
      }
      sum_lo = _mm512_slli_epi32(sum_lo, 7);
      sum_hi = _mm512_slli_epi32(sum_hi, 7);
      const __m512 scale_lo = _mm512_mul_ps(d, load_s8x16(rec + 32 + (2 * gi) * kRows));
      const __m512 scale_hi = _mm512_mul_ps(d, load_s8x16(rec + 32 + (2 * gi + 1) * kRows));
      for (int t = 0; t < T; ++t) {
        const int32_t* a = reinterpret_cast<const int32_t*>(in.qu.data() + (t0 + t) * w.k + g * kGroup);
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          lo = _mm512_dpbusd_epi32(lo, _mm512_set1_epi32(a[c]), wv[c]);
          hi = _mm512_dpbusd_epi32(hi, _mm512_set1_epi32(a[c + 4]), wv[c + 4]);
        }
        const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, sum_hi)), scale_hi,
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, sum_lo)), scale_lo));
        acc[t] = _mm512_fmadd_ps(dot, _mm512_set1_ps(in.scale[(t0 + t) * groups + g]), acc[t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (t0 + t) * y_stride + b * kRows, acc[t]);
}

template <int T>
inline void any_block(const FusedLinear& w, int64_t b, const QuantizedInput& in, int64_t t0, float* y) {
  if (w.kind == 0)
    q4_block<T>(w, b, in, t0, y, w.n);
  else if (w.kind == 2)
    q8_block<T>(w, b, in, t0, y, w.n);
  else if (w.kind == 3)
    q4k_block<T>(w, b, in, t0, y, w.n);
  else if (w.kind == 4)
    q6k_block<T>(w, b, in, t0, y, w.n);
  else
#if TM_AVX512_BF16
    bf16_block<T>(w, b, in, t0, y, w.n);
#else
    tm::refuse_call("a BF16 weight (FusedLinear kind 1) needs AVX512-BF16, which this build lacks "
                    "(fused_decode_caps() & 2 is 0)");
#endif
}

// y [tokens, n] = x [tokens, k] W^T (+ bias), threads over row blocks.
void matmul(const FusedLinear& w, const float* x, int64_t tokens, float* y, QuantizedInput& in) {
  if (w.kind != 1)
    quantize_q8(x, tokens, w.k, in);
  else
    round_bf16(x, tokens * w.k, in, tokens);
  const int64_t blocks = w.n / kRows;
  if (w.kind == 5) {
    s8_matmul(w, in, tokens, y);
#if TM_AMX_BF16
  } else if (w.kind == 1 && amx_bf16_matmul(w, in, tokens, y)) {
    // done on AMX tiles
#endif
#if TM_AVX512_BF16
  } else if (w.kind == 1 && tokens >= kTok && blocks % 2 == 0) {
    // Batches of bf16 rows: pairs of blocks, 6 tokens a pass (24 accumulators).
#pragma omp parallel for schedule(static)
    for (int64_t bp = 0; bp < blocks / 2; ++bp) {
      const int64_t b = 2 * bp;
      int64_t t0 = 0;
      for (; t0 + 6 <= tokens; t0 += 6) bf16_block2<6>(w, b, in, t0, y, w.n);
      switch (tokens - t0) {
        case 5: bf16_block2<5>(w, b, in, t0, y, w.n); break;
        case 4: bf16_block2<4>(w, b, in, t0, y, w.n); break;
        case 3: bf16_block2<3>(w, b, in, t0, y, w.n); break;
        case 2: bf16_block2<2>(w, b, in, t0, y, w.n); break;
        case 1: bf16_block2<1>(w, b, in, t0, y, w.n); break;
        default: break;
      }
    }
#endif
  } else {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t t0 = 0;
    for (; t0 + kTok <= tokens; t0 += kTok) any_block<kTok>(w, b, in, t0, y);
    switch (tokens - t0) {
      case 7: any_block<7>(w, b, in, t0, y); break;
      case 6: any_block<6>(w, b, in, t0, y); break;
      case 5: any_block<5>(w, b, in, t0, y); break;
      case 4: any_block<4>(w, b, in, t0, y); break;
      case 3: any_block<3>(w, b, in, t0, y); break;
      case 2: any_block<2>(w, b, in, t0, y); break;
      case 1: any_block<1>(w, b, in, t0, y); break;
      default: break;
    }
  }
  }
  if (w.bias)
#pragma omp parallel for schedule(static) if (tokens >= kParallelRows)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = 0; i < w.n; ++i) y[t * w.n + i] += w.bias[i];
}

void rms_norm(const float* x, const float* weight, float eps, int64_t cols, float* out) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < cols; ++c) ss += x[c] * x[c];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) out[c] = x[c] * inv * weight[c];
}

void layer_norm(const float* x, const float* weight, const float* bias, float eps, int64_t cols, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < cols; ++c) sum += x[c];
  const float mean = sum / static_cast<float>(cols);
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < cols; ++c) ss += (x[c] - mean) * (x[c] - mean);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
  if (bias) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) out[c] = (x[c] - mean) * inv * weight[c] + bias[c];
  } else {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) out[c] = (x[c] - mean) * inv * weight[c];
  }
}

void norm(int64_t kind, const float* x, const float* weight, const float* bias, float eps, int64_t cols,
          float* out) {
  if (kind == 0) rms_norm(x, weight, eps, cols, out);
  else layer_norm(x, weight, bias, eps, cols, out);
}

// The leading `rot` dims of a head: halves (x_i, x_{i+rot/2}) or GPT-J pairs (x_2i, x_2i+1) turn by
// angle i; cos_sin holds cos | sin of those rot/2 angles.
void rope(float* x, const float* cos_sin, int64_t rot, bool gptj) {
  const int64_t half = rot / 2;
  const float* sn = cos_sin + half;
  if (gptj) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[2 * i], x2 = x[2 * i + 1];
      x[2 * i] = x1 * cos_sin[i] - x2 * sn[i];
      x[2 * i + 1] = x2 * cos_sin[i] + x1 * sn[i];
    }
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * cos_sin[i] - x2 * sn[i];
    x[half + i] = x2 * cos_sin[i] + x1 * sn[i];
  }
}

// The FFN's activation over `n` values: a = act(gate) * up (up null: act(gate)).
void activate(const FusedLayer& layer, const float* gate, const float* up, int64_t n, float* a) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kInvSqrt2 = 0.7071067811865476f;
  switch (layer.activation) {
    case 0:
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) a[i] = gate[i] / (1.0f + std::exp(-gate[i]));
      break;
    case 1:
      // 0.5 * (1 + tanh(z)) = 1 / (1 + exp(-2z)): the form that vectorizes like SiLU's.
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        a[i] = g / (1.0f + std::exp(-2.0f * kSqrt2OverPi * (g + 0.044715f * g * g * g)));
      }
      break;
    case 2:
      for (int64_t i = 0; i < n; ++i) a[i] = 0.5f * gate[i] * (1.0f + std::erf(gate[i] * kInvSqrt2));
      break;
    default:
      for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        a[i] = g > 0.0f ? layer.act_alpha_p * g * g + layer.act_beta * g
                        : (std::expm1(std::min(g, layer.act_eps)) - g) * layer.act_alpha_n + layer.act_beta * g;
      }
  }
  if (up) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) a[i] *= up[i];
  }
}

// ---- Mixture-of-experts (fused_moe) ----------------------------------------------------------

// T tokens (rows t0.. of `in` and of y, stride w.n) times blocks [b, b + nb) of w, in the tile
// shapes `matmul` uses for that kind (a row's result does not depend on its tile).
template <int T>
void moe_tile(const FusedLinear& w, int64_t b, int64_t nb, const QuantizedInput& in, int64_t t0, float* y) {
  int64_t j = 0;
  if (w.kind == 5) {
    if (T == 1)
      for (; j + 4 <= nb; j += 4) s8_tile<4, 1>(w, b + j, in, t0, y, w.n);
    for (; j + 2 <= nb; j += 2) s8_tile<2, T>(w, b + j, in, t0, y, w.n);
    for (; j < nb; ++j) s8_tile<1, T>(w, b + j, in, t0, y, w.n);
    return;
  }
#if TM_AVX512_BF16
  if (w.kind == 1)
    for (; j + 2 <= nb; j += 2) bf16_block2<T>(w, b + j, in, t0, y, w.n);
#endif
  for (; j < nb; ++j) any_block<T>(w, b + j, in, t0, y);
}

// Rows [r0, r0 + rows) (one expert's tokens) times blocks [b, b + nb) of w: tiles of 6 tokens.
void moe_rows(const FusedLinear& w, int64_t b, int64_t nb, const QuantizedInput& in, int64_t r0, int64_t rows,
              float* y) {
  int64_t t = r0;
  const int64_t end = r0 + rows;
  for (; t + 6 <= end; t += 6) moe_tile<6>(w, b, nb, in, t, y);
  switch (end - t) {
    case 5: moe_tile<5>(w, b, nb, in, t, y); break;
    case 4: moe_tile<4>(w, b, nb, in, t, y); break;
    case 3: moe_tile<3>(w, b, nb, in, t, y); break;
    case 2: moe_tile<2>(w, b, nb, in, t, y); break;
    case 1: moe_tile<1>(w, b, nb, in, t, y); break;
    default: break;
  }
}

// The activation a matmul of this kind reads: int8 groups, or bf16 for BF16 weights (then 16
// zero rows past the last, which AMX tiles may read).
void moe_input(const FusedLinear& w, const float* x, int64_t rows, QuantizedInput& in) {
  if (w.kind == 1) {
    round_bf16(x, rows * w.k, in, rows);
    in.bf16.resize((rows + 16) * w.k, 0);
    std::fill(in.bf16.begin() + rows * w.k, in.bf16.end(), 0);
  } else {
    quantize_q8(x, rows, w.k, in);
  }
}

// Blocks of 16 rows a work item covers: 64 output rows, so a one-token step of a layer with
// 8 experts x (512 + 1024) rows has a few hundred items to share among the threads.
constexpr int64_t kMoeItemBlocks = 4;

#if TM_AMX_BF16
// BF16 experts on AMX tiles: items (expert, chunk of kAmxChunkTiles token tiles of its rows, pair
// of row blocks), as amx_bf16_run runs one matrix. A tile's 16 rows may run past the expert's
// rows into the next expert's (or the zero padding after the last): their outputs are dropped.
// in.bf16 holds 16 rows of padding past the last (moe_input_padded).
void moe_matmul_amx(const FusedLinear* experts, const std::vector<int64_t>& active, const std::vector<int64_t>& start,
                    const QuantizedInput& in, float* y) {
  const FusedLinear& first = experts[active[0]];
  const int64_t n = first.n, k = first.k, blocks = n / kRows, block_pairs = (blocks + 1) / 2;
  thread_local std::vector<int64_t> item_start;       // each active expert's first item
  item_start.assign(1, 0);
  for (int64_t e : active) {
    const int64_t tiles = (start[e + 1] - start[e] + 15) / 16;
    item_start.push_back(item_start.back() + (tiles + kAmxChunkTiles - 1) / kAmxChunkTiles * block_pairs);
  }
  const int64_t items = item_start.back();
  const int64_t* item_of = item_start.data();
  const uint8_t* a = reinterpret_cast<const uint8_t*>(in.bf16.data());
#pragma omp parallel
  {
    tm::configure_tiles();
    alignas(64) float scratch[16 * 16];
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = std::upper_bound(item_of, item_of + active.size() + 1, item) - item_of - 1;
      const int64_t e = active[i], local = item - item_of[i];
      const int64_t r0 = start[e], rows = start[e + 1] - r0;
      const FusedLinear& w = experts[e];
      const AmxOperands op{a + r0 * k * 2, nullptr, INT64_MAX, rows, y + r0 * n, nullptr, nullptr};
      const int64_t b = 2 * (local % block_pairs), chunk = local / block_pairs;
      const bool two_blocks = b + 1 < blocks;
      const int64_t end = std::min((rows + 15) / 16, (chunk + 1) * kAmxChunkTiles);
      for (int64_t tile = chunk * kAmxChunkTiles; tile < end; tile += 2) {
        const int64_t t0 = 16 * tile;
        const bool two_tiles = tile + 1 < end;
        if (two_blocks && two_tiles) amx_bf16_item<true, true>(w, op, b, t0, scratch);
        else if (two_blocks) amx_bf16_item<true, false>(w, op, b, t0, scratch);
        else if (two_tiles) amx_bf16_item<false, true>(w, op, b, t0, scratch);
        else amx_bf16_item<false, false>(w, op, b, t0, scratch);
      }
    }
    _tile_release();
  }
}
#endif

// One matmul over every expert that has tokens: items (expert, kMoeItemBlocks row blocks) shared
// among the threads, each over all of its expert's rows (start[e] .. start[e + 1]). BF16 experts
// run on AMX tiles where the CPU has them (moe_matmul_amx).
void moe_matmul(const FusedLinear* experts, const std::vector<int64_t>& active, const std::vector<int64_t>& start,
                const QuantizedInput& in, float* y) {
#if TM_AMX_BF16
  if (experts[active[0]].kind == 1 && amx_ready()) {
    moe_matmul_amx(experts, active, start, in, y);
    return;
  }
#endif
  const int64_t blocks = experts[active[0]].n / kRows;
  const int64_t per_expert = (blocks + kMoeItemBlocks - 1) / kMoeItemBlocks;
  const int64_t items = static_cast<int64_t>(active.size()) * per_expert;
#pragma omp parallel for schedule(dynamic)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t e = active[item / per_expert], b = (item % per_expert) * kMoeItemBlocks;
    moe_rows(experts[e], b, std::min(kMoeItemBlocks, blocks - b), in, start[e], start[e + 1] - start[e], y);
  }
}

// a = act(gate) * up over n values: 0 SiLU, 1 GELU (tanh), 2 GELU (erf), 3 ReLU; 4 GPT-OSS's
// clamped SwiGLU, (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
void moe_activate(int64_t kind, const float* gate, const float* up, int64_t n, float* a, float alpha, float limit) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kInvSqrt2 = 0.7071067811865476f;
  if (kind == 4) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = std::min(gate[i], limit), u = std::min(std::max(up[i], -limit), limit);
      a[i] = (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
    }
    return;
  }
  if (kind == 0) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) a[i] = gate[i] / (1.0f + std::exp(-gate[i]));
  } else if (kind == 1) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = gate[i];
      a[i] = g / (1.0f + std::exp(-2.0f * kSqrt2OverPi * (g + 0.044715f * g * g * g)));
    }
  } else if (kind == 2) {
    for (int64_t i = 0; i < n; ++i) a[i] = 0.5f * gate[i] * (1.0f + std::erf(gate[i] * kInvSqrt2));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) a[i] = gate[i] > 0.0f ? gate[i] : 0.0f;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] *= up[i];
}

struct MoeScratch {
  std::vector<int64_t> start, fill, active, row_of_pair, token_of_row, expert_of_row;
  std::vector<float> x, gate_up, act, down;
  QuantizedInput in, in_down;
};

struct Scratch {
  std::vector<float> residual, normed, qkv, q, k, v, attn, proj, gate_up, act, ffn;
  QuantizedInput in;
  // An expert FFN's: the router's input and logits, each token's experts and weights, the shared
  // expert's rows.
  std::vector<float> router_x, logits, choice, route_weights, shared_gate_up, shared_act, shared;
  std::vector<int64_t> route_ids;
};

}  // namespace

extern "C" {

int tokenmill_kernels_abi_version() { return 8; }

// Bit 0: Q4 matmuls run here (AVX512-VNNI: always, a build without it is refused); bit 1: BF16
// matmuls (AVX512-BF16); bit 2: those on AMX tiles. Callers check a bit before using its kinds.
int64_t fused_decode_caps() {
  int64_t caps = 1 | (TM_AVX512_BF16 ? 2 : 0);
  if (tm::amx_usable()) caps |= 4;
  return caps;
}

// The machine's int8 peak as the matmuls here could reach it: every thread runs `iterations` x 16
// independent AVX512-VNNI dot products (64 u8 x s8 multiply-adds each) on registers only. Returns
// the number of threads that ran; the caller times the call (ops = 2 * 64 * 16 * iterations * threads).
int64_t vnni_peak_loop(int64_t iterations) {
  int64_t threads = 1;
#pragma omp parallel
  {
#pragma omp single
    threads = omp_get_num_threads();
    // Named registers, not an array: an array would live on the stack, each step a load and a store.
    __m512i c0 = _mm512_set1_epi32(0), c1 = _mm512_set1_epi32(1), c2 = _mm512_set1_epi32(2),
            c3 = _mm512_set1_epi32(3), c4 = _mm512_set1_epi32(4), c5 = _mm512_set1_epi32(5),
            c6 = _mm512_set1_epi32(6), c7 = _mm512_set1_epi32(7), c8 = _mm512_set1_epi32(8),
            c9 = _mm512_set1_epi32(9), c10 = _mm512_set1_epi32(10), c11 = _mm512_set1_epi32(11),
            c12 = _mm512_set1_epi32(12), c13 = _mm512_set1_epi32(13), c14 = _mm512_set1_epi32(14),
            c15 = _mm512_set1_epi32(15);
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (int64_t it = 0; it < iterations; ++it) {
#define TM_DP(x) x = _mm512_dpbusd_epi32(x, a, b)
      TM_DP(c0); TM_DP(c1); TM_DP(c2); TM_DP(c3); TM_DP(c4); TM_DP(c5); TM_DP(c6); TM_DP(c7);
      TM_DP(c8); TM_DP(c9); TM_DP(c10); TM_DP(c11); TM_DP(c12); TM_DP(c13); TM_DP(c14); TM_DP(c15);
#undef TM_DP
      // Keeps the compiler from folding the loop into a closed form.
      __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7));
      __asm__ volatile("" : "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11), "+v"(c12), "+v"(c13), "+v"(c14), "+v"(c15));
    }
    __m512i sum = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                   _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)),
                                                 _mm512_add_epi32(_mm512_add_epi32(c12, c13), _mm512_add_epi32(c14, c15))));
    volatile int sink = _mm512_reduce_add_epi32(sum);
    (void)sink;
  }
  return threads;
}

// y [tokens, n] float32 = x [tokens, k] float32 times one of the layouts above (the LM head's
// kernel under quantization="int4", GGUF weights kept quantized; any number of tokens).
void fused_matmul(const FusedLinear* w, const float* x, int64_t tokens, float* y) {
  thread_local QuantizedInput in;
  matmul(*w, x, tokens, y, in);
}

// out [tokens, hidden] float32 = for each token, the sum over its top_k slots j of
// weights[t, j] * down(act(gate x) * up x) of expert ids[t, j], added in increasing expert order
// (moe_reference's order). The (token, slot) pairs are sorted by expert (a counting sort), the
// pairs' rows gathered so each expert's are contiguous, and each matmul runs over every active
// expert at once (moe_matmul): every expert's weights are read once per call, whatever its
// number of tokens. Returns 0, or -1 (out untouched) when an id is outside [0, num_experts).
int64_t fused_moe(const FusedMoeLayer* m, const float* x, int64_t tokens, int64_t top_k, const int64_t* ids,
                  const float* weights, float* out) {
  // Reused, so a warm call allocates nothing; referenced through `s`, a plain local the parallel
  // regions share (a thread_local named inside one would be each worker's own, empty copy).
  thread_local MoeScratch scratch;
  MoeScratch& s = scratch;
  const int64_t num = m->num_experts, h = m->hidden, inter = m->inter, pairs = tokens * top_k;
  for (int64_t p = 0; p < pairs; ++p)
    if (ids[p] < 0 || ids[p] >= num) return -1;
  s.start.assign(num + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++s.start[ids[p] + 1];
  s.active.clear();
  for (int64_t e = 0; e < num; ++e) {
    if (s.start[e + 1]) s.active.push_back(e);
    s.start[e + 1] += s.start[e];
  }
  if (pairs == 0) return 0;
  s.fill.assign(s.start.begin(), s.start.end() - 1);
  s.row_of_pair.resize(pairs);
  s.token_of_row.resize(pairs);
  s.expert_of_row.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t row = s.fill[ids[p]]++;
    s.row_of_pair[p] = row;
    s.token_of_row[row] = p / top_k;
    s.expert_of_row[row] = ids[p];
  }
  s.x.resize(pairs * h);
  s.gate_up.resize(pairs * 2 * inter);
  s.act.resize(pairs * inter);
  s.down.resize(pairs * h);
  float* xs = s.x.data();
#pragma omp parallel for schedule(static) if (pairs >= kParallelRows)
  for (int64_t r = 0; r < pairs; ++r) std::memcpy(xs + r * h, x + s.token_of_row[r] * h, h * sizeof(float));
  moe_input(m->w13[s.active[0]], xs, pairs, s.in);
  moe_matmul(m->w13, s.active, s.start, s.in, s.gate_up.data());
  float* gate_up = s.gate_up.data();
  float* act = s.act.data();
  const int64_t* expert_of_row = s.expert_of_row.data();
#pragma omp parallel for schedule(static) if (pairs >= kParallelRows)
  for (int64_t r = 0; r < pairs; ++r) {
    float* row = gate_up + r * 2 * inter;
    if (m->b13) {
      const float* bias = m->b13 + expert_of_row[r] * 2 * inter;
#pragma omp simd
      for (int64_t c = 0; c < 2 * inter; ++c) row[c] += bias[c];
    }
    moe_activate(m->activation, row, row + inter, inter, act + r * inter, m->alpha, m->limit);
  }
  moe_input(m->w2[s.active[0]], act, pairs, s.in_down);
  moe_matmul(m->w2, s.active, s.start, s.in_down, s.down.data());
  const float* down = s.down.data();
#pragma omp parallel for schedule(static) if (tokens >= kParallelRows)
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t order[64];      // the token's slots by increasing expert id (top_k <= 64: checked by the caller)
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t i = j;
      for (; i > 0 && ids[t * top_k + order[i - 1]] > ids[t * top_k + j]; --i) order[i] = order[i - 1];
      order[i] = j;
    }
    float* o = out + t * h;
    std::fill(o, o + h, 0.0f);
    for (int64_t jj = 0; jj < top_k; ++jj) {
      const int64_t p = t * top_k + order[jj];
      const float wt = weights[p];
      const float* d = down + s.row_of_pair[p] * h;
      if (m->b2) {
        const float* bias = m->b2 + ids[p] * h;
#pragma omp simd
        for (int64_t c = 0; c < h; ++c) o[c] += wt * (d[c] + bias[c]);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < h; ++c) o[c] += wt * d[c];
      }
    }
  }
  return 0;
}

// y [tokens, n] bf16 = x [tokens, k] bf16 times a BF16 layout (+ bias, float32 [n] or null), on
// AMX tiles: the eager path's dense linears under dtype=bfloat16. Returns 1 when done, 0 (y
// untouched) where this CPU or build has no AMX (fused_decode_caps() & 4 is 0): the caller
// keeps its own GEMM.
int64_t bf16_linear(const FusedLinear* w, const uint16_t* x, int64_t tokens, const float* bias, uint16_t* y) {
#if TM_AMX_BF16
  return w->kind == 1 && amx_bf16_linear(*w, x, tokens, bias, y) ? 1 : 0;
#else
  (void)w, (void)x, (void)tokens, (void)bias, (void)y;
  return 0;
#endif
}

}  // extern "C"

namespace {

// ---- An expert FFN inside the step (FusedMoeFfn) -----------------------------------------------

// dot(x, w) over n values (a multiple of 16), w float32 or bf16.
inline float dot_row(const float* x, const void* w, bool bf16, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  if (bf16) {
    const uint16_t* wb = static_cast<const uint16_t*>(w);
    for (int64_t i = 0; i < n; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i),
                            tm::bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i))), acc);
  } else {
    const float* wf = static_cast<const float*>(w);
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(wf + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// The k largest of `values` [n] (entries of `eligible` only, where given) into `top` in decreasing
// order, an earlier index first among equals (torch.topk's order on CPU): one pass, each value
// inserted into the kept list only when it beats its last entry.
void top_k(const float* values, const uint8_t* eligible, int64_t n, int64_t k, int64_t* top) {
  int64_t kept = 0;
  for (int64_t e = 0; e < n; ++e) {
    if (eligible && !eligible[e]) continue;
    const float v = values[e];
    if (kept == k && !(v > values[top[k - 1]])) continue;
    int64_t i = kept < k ? kept++ : k - 1;
    for (; i > 0 && v > values[top[i - 1]]; --i) top[i] = top[i - 1];
    top[i] = e;
  }
}

// Each token's top_k experts (ids [tokens, top_k]) and their weights, from the router's logits
// [tokens, num_experts] (select_experts in core/layers/moe.py, step for step).
void moe_select(const FusedMoeFfn& f, const float* logits, int64_t tokens, int64_t* ids, float* weights,
                std::vector<float>& scratch) {
  const int64_t num = f.experts.num_experts, k = f.top_k;
  const bool grouped = f.num_groups > 1;
  scratch.resize(2 * num + f.num_groups + 2 * k);
  float* scores = scratch.data();
  float* choice = scores + num;
  float* group_score = choice + num;
  std::vector<uint8_t> eligible(grouped ? num : 0);
  std::vector<int64_t> groups(grouped ? f.topk_groups : 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * num;
    if (f.scoring == 0) {
      float mx = l[0], sum = 0.0f;
      for (int64_t e = 1; e < num; ++e) mx = std::max(mx, l[e]);
      for (int64_t e = 0; e < num; ++e) sum += (scores[e] = std::exp(l[e] - mx));
      for (int64_t e = 0; e < num; ++e) scores[e] /= sum;
    } else {
      for (int64_t e = 0; e < num; ++e) scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
    }
    for (int64_t e = 0; e < num; ++e) choice[e] = scores[e] + (f.correction_bias ? f.correction_bias[e] : 0.0f);
    int64_t* top = ids + t * k;
    if (grouped) {
      // A group's rank: its best expert's choice, or (with a correction bias) its best two's sum.
      const int64_t size = num / f.num_groups;
      for (int64_t g = 0; g < f.num_groups; ++g) {
        int64_t best[2] = {0, 0};
        top_k(choice + g * size, nullptr, size, 2, best);
        group_score[g] = f.correction_bias ? choice[g * size + best[0]] + choice[g * size + best[1]]
                                           : choice[g * size + best[0]];
      }
      top_k(group_score, nullptr, f.num_groups, f.topk_groups, groups.data());
      std::fill(eligible.begin(), eligible.end(), 0);
      for (int64_t g : groups) std::fill(eligible.begin() + g * size, eligible.begin() + (g + 1) * size, 1);
    }
    top_k(choice, grouped ? eligible.data() : nullptr, num, k, top);
    float* w = weights + t * k;
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += (w[j] = scores[top[j]]);
    for (int64_t j = 0; j < k; ++j) {
      if (f.renormalize) w[j] /= sum;
      if (f.routed_scaling != 1.0f) w[j] *= f.routed_scaling;
      if (f.round_weights) w[j] = tm::round_to_bf16(w[j]);
    }
  }
}

// Each token's experts and weights into s.route_ids / s.route_weights [tokens, top_k]; s.router_x
// holds the router's input after (x itself, or rounded to bf16).
const float* moe_route(const FusedMoeFfn& f, const float* x, int64_t tokens, int64_t hidden, Scratch& s) {
  const int64_t num = f.experts.num_experts, k = f.top_k;
  const bool bf16 = f.router_bf16;
  // torch's bf16 router multiplies bf16 activations and rounds its logits to bf16.
  const float* xr = x;
  if (bf16) {
    s.router_x.resize(tokens * hidden);
    for (int64_t i = 0; i < tokens * hidden; ++i) s.router_x[i] = tm::round_to_bf16(x[i]);
    xr = s.router_x.data();
  }
  s.logits.resize(tokens * num);
  float* logits = s.logits.data();
  const size_t row_bytes = bf16 ? 2 : 4;
  const char* router = static_cast<const char*>(f.router);
#pragma omp parallel for collapse(2) schedule(static) if (tokens * num * hidden >= (1 << 17))
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < num; ++e) {
      float v = dot_row(xr + t * hidden, router + e * hidden * row_bytes, bf16, hidden);
      if (f.router_bias) v += f.router_bias[e];
      logits[t * num + e] = bf16 ? tm::round_to_bf16(v) : v;
    }
  s.route_ids.resize(tokens * k);
  s.route_weights.resize(tokens * k);
  moe_select(f, logits, tokens, s.route_ids.data(), s.route_weights.data(), s.choice);
  return xr;
}

// The layer's expert FFN on `x` [tokens, hidden] into s.ffn: route, the experts (fused_moe), the
// shared expert (times sigmoid of its gate) added.
void moe_ffn(const FusedLayer& layer, const float* x, int64_t tokens, int64_t hidden, Scratch& s) {
  const FusedMoeFfn& f = *layer.moe;
  const bool bf16 = f.router_bf16;
  const float* xr = moe_route(f, x, tokens, hidden, s);
  if (f.noted_ids && tokens <= f.noted_rows)
    std::memcpy(f.noted_ids, s.route_ids.data(), tokens * f.top_k * sizeof(int64_t));
  fused_moe(&f.experts, x, tokens, f.top_k, s.route_ids.data(), s.route_weights.data(), s.ffn.data());
  if (!f.shared_gate_up.n) return;
  const int64_t inter = f.shared_gate_up.n / 2;
  s.shared_gate_up.resize(tokens * 2 * inter);
  s.shared_act.resize(tokens * inter);
  s.shared.resize(tokens * hidden);
  matmul(f.shared_gate_up, x, tokens, s.shared_gate_up.data(), s.in);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* gate = s.shared_gate_up.data() + t * 2 * inter;
    activate(layer, gate, gate + inter, inter, s.shared_act.data() + t * inter);
  }
  matmul(f.shared_down, s.shared_act.data(), tokens, s.shared.data(), s.in);
  for (int64_t t = 0; t < tokens; ++t) {
    float g = 1.0f;
    if (f.shared_gate) {
      const float z = dot_row(xr + t * hidden, f.shared_gate, bf16, hidden);
      g = 1.0f / (1.0f + std::exp(-(bf16 ? tm::round_to_bf16(z) : z)));
    }
    float* o = s.ffn.data() + t * hidden;
    const float* sh = s.shared.data() + t * hidden;
#pragma omp simd
    for (int64_t c = 0; c < hidden; ++c) o[c] += g * sh[c];
  }
}

}  // namespace

extern "C" {

// The router of an expert FFN alone (tests): ids [tokens, top_k] int64 and weights float32 as the
// step routes x [tokens, hidden].
void fused_moe_route(const FusedMoeFfn* f, const float* x, int64_t tokens, int64_t* ids, float* weights) {
  thread_local Scratch scratch;
  moe_route(*f, x, tokens, f->experts.hidden, scratch);
  std::memcpy(ids, scratch.route_ids.data(), tokens * f->top_k * sizeof(int64_t));
  std::memcpy(weights, scratch.route_weights.data(), tokens * f->top_k * sizeof(float));
}

// Layers [first_layer, last_layer) of one step for `a->tokens` rows, one new token each (see
// FusedStep): from the embedding (first_layer 0) or the stream handed in; to the final norm in `out`
// (float32 or bfloat16) when last_layer is num_layers, else the stream handed back.
void fused_decode_step(const FusedModel* m, const FusedStep* a) {
  // Reused, so a step allocates nothing once warm. Referenced through `s`: inside the parallel
  // loops the name of a thread_local would mean each worker's own (empty) copy.
  thread_local Scratch scratch;
  Scratch& s = scratch;
  const int64_t tokens = a->tokens, hidden = m->hidden, hd = m->head_size, inter = m->intermediate;
  const int64_t q_size = m->num_heads * hd, kv_size = m->num_kv_heads * hd;
  const int64_t qkv_size = q_size + 2 * kv_size;
  s.residual.resize(tokens * hidden);
  s.normed.resize(tokens * hidden);
  s.qkv.resize(tokens * qkv_size);
  s.q.resize(tokens * q_size);
  s.k.resize(tokens * kv_size);
  s.v.resize(tokens * kv_size);
  s.attn.resize(tokens * q_size);
  s.proj.resize(tokens * hidden);
  s.ffn.resize(tokens * hidden);
  s.gate_up.resize(tokens * 2 * inter);
  s.act.resize(tokens * inter);
  AttendFn attend = reinterpret_cast<AttendFn>(m->attend);
  const float eps = m->eps;

  const bool rows_parallel = tokens >= kParallelRows;
  if (a->first_layer == 0) {
#pragma omp parallel for schedule(static) if (rows_parallel)
    for (int64_t t = 0; t < tokens; ++t) {
      float* dst = s.residual.data() + t * hidden;
      if (a->embedded) {
        std::memcpy(dst, a->embedded + t * hidden, hidden * sizeof(float));
      } else if (m->embedding_bf16) {
        const uint16_t* row = static_cast<const uint16_t*>(m->embedding) + a->ids[t] * hidden;
        for (int64_t c = 0; c < hidden; ++c) dst[c] = tm::bf16_to_f32(row[c]);
      } else {
        std::memcpy(dst, static_cast<const float*>(m->embedding) + a->ids[t] * hidden, hidden * sizeof(float));
      }
      if (m->embedding_scale != 1.0f)
        for (int64_t c = 0; c < hidden; ++c) dst[c] *= m->embedding_scale;
    }
  } else {
    std::memcpy(s.residual.data(), a->stream, tokens * hidden * sizeof(float));
  }
  for (int64_t l = a->first_layer; l < a->last_layer; ++l) {
    const FusedLayer& layer = m->layers[l];
    const int64_t kind = layer.norm_kind;
    // The attention block's input: the normed stream, or the stream itself (post-norm placement).
    const float* attn_in = s.residual.data();
    if (layer.input_norm) {
#pragma omp parallel for schedule(static) if (rows_parallel)
      for (int64_t t = 0; t < tokens; ++t)
        norm(kind, s.residual.data() + t * hidden, layer.input_norm, layer.input_norm_bias, eps, hidden,
             s.normed.data() + t * hidden);
      attn_in = s.normed.data();
    }
    matmul(layer.qkv, attn_in, tokens, s.qkv.data(), s.in);
    const int64_t rot = layer.rotary_dim;
#pragma omp parallel for schedule(static) if (rows_parallel)
    for (int64_t t = 0; t < tokens; ++t) {
      const float* row = s.qkv.data() + t * qkv_size;
      float* q = s.q.data() + t * q_size;
      float* k = s.k.data() + t * kv_size;
      std::memcpy(q, row, q_size * sizeof(float));
      std::memcpy(k, row + q_size, kv_size * sizeof(float));
      std::memcpy(s.v.data() + t * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
      if (layer.qk_norm == 2) {
        rms_norm(q, layer.q_norm, eps, q_size, q);
        rms_norm(k, layer.k_norm, eps, kv_size, k);
      }
      const float* cs = layer.cos_sin ? layer.cos_sin + a->positions[t] * rot : nullptr;
      for (int64_t h = 0; h < m->num_heads; ++h) {
        if (layer.qk_norm == 1) rms_norm(q + h * hd, layer.q_norm, eps, hd, q + h * hd);
        if (cs) rope(q + h * hd, cs, rot, layer.rope_gptj);
      }
      for (int64_t h = 0; h < m->num_kv_heads; ++h) {
        if (layer.qk_norm == 1) rms_norm(k + h * hd, layer.k_norm, eps, hd, k + h * hd);
        if (cs) rope(k + h * hd, cs, rot, layer.rope_gptj);
      }
    }
    const int64_t g = layer.group;
    attend(s.q.data(), s.k.data(), s.v.data(), layer.kv_cache, a->slots[g], a->tables[g], a->table_strides[g],
           a->lens, s.attn.data(), tokens, m->num_heads, m->num_kv_heads, hd, m->block_size, m->num_blocks,
           layer.attn_scale, layer.window, layer.k_scale, layer.v_scale, layer.attn_softcap);
    matmul(layer.o, s.attn.data(), tokens, s.proj.data(), s.in);
    const float scale = layer.residual_scale;
    if (!layer.parallel_block) {
      // x += scale * attn_out_norm(attn); the FFN reads post_norm(x) (or x).
#pragma omp parallel for schedule(static) if (rows_parallel)
      for (int64_t t = 0; t < tokens; ++t) {
        float* r = s.residual.data() + t * hidden;
        float* p = s.proj.data() + t * hidden;
        if (layer.attn_out_norm) norm(kind, p, layer.attn_out_norm, layer.attn_out_norm_bias, eps, hidden, p);
        for (int64_t c = 0; c < hidden; ++c) r[c] += scale * p[c];
        if (layer.post_norm)
          norm(kind, r, layer.post_norm, layer.post_norm_bias, eps, hidden, s.normed.data() + t * hidden);
      }
    }
    const float* ffn_in = layer.parallel_block || layer.post_norm ? s.normed.data() : s.residual.data();
    if (layer.moe) {
      moe_ffn(layer, ffn_in, tokens, hidden, s);
    } else {
      matmul(layer.gate_up, ffn_in, tokens, s.gate_up.data(), s.in);
      const int64_t up_width = layer.gated ? 2 * inter : inter;
#pragma omp parallel for schedule(static) if (rows_parallel)
      for (int64_t t = 0; t < tokens; ++t) {
        const float* gate = s.gate_up.data() + t * up_width;
        activate(layer, gate, layer.gated ? gate + inter : nullptr, inter, s.act.data() + t * inter);
      }
      matmul(layer.down, s.act.data(), tokens, s.ffn.data(), s.in);
    }
#pragma omp parallel for schedule(static) if (rows_parallel)
    for (int64_t t = 0; t < tokens; ++t) {
      float* r = s.residual.data() + t * hidden;
      float* f = s.ffn.data() + t * hidden;
      if (layer.ffn_out_norm) norm(kind, f, layer.ffn_out_norm, layer.ffn_out_norm_bias, eps, hidden, f);
      if (layer.parallel_block) {
        const float* p = s.proj.data() + t * hidden;
        for (int64_t c = 0; c < hidden; ++c) r[c] += scale * (p[c] + f[c]);
      } else {
        for (int64_t c = 0; c < hidden; ++c) r[c] += scale * f[c];
      }
    }
  }
  if (a->last_layer < m->num_layers) {
    std::memcpy(a->stream, s.residual.data(), tokens * hidden * sizeof(float));
    return;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    norm(m->final_norm_kind, s.residual.data() + t * hidden, m->final_norm, m->final_norm_bias, eps, hidden,
         s.normed.data() + t * hidden);
    if (a->out_bf16) {
      round_bf16(s.normed.data() + t * hidden, hidden, s.in);
      std::memcpy(static_cast<uint16_t*>(a->out) + t * hidden, s.in.bf16.data(), hidden * sizeof(uint16_t));
    } else {
      std::memcpy(static_cast<float*>(a->out) + t * hidden, s.normed.data() + t * hidden, hidden * sizeof(float));
    }
  }
}

}  // extern "C"
