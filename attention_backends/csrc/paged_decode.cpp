// Paged decode attention for the cpu_sdpa backend (attention_backends/cpu_sdpa.py): one query
// token per sequence, K/V read in place from the block pool (no gather copy), grouped-query heads
// sharing each K/V row they read.
//
// Plain C++ with OpenMP, no torch headers: it compiles in about a second and is called through
// ctypes (attention_backends/cpu_paged_decode.py, built by platforms/native_build.py). libgomp.so.1
// resolves to the runtime torch has already loaded, so torch.set_num_threads governs these threads too.
//
// Layouts (all contiguous, row-major):
//   q      [num_seqs, num_heads, head_size]
//   kv     [2, num_blocks, block_size, num_kv_heads, head_size]   (K then V)
//   tables [num_seqs, table_stride] int32 block ids
//   lens   [num_seqs] int32 context length including the new token
//   out    [num_seqs, num_heads, head_size]
// Query head h reads KV head h / group (group = num_heads / num_kv_heads), as HF's repeat_kv.
// Only positions [max(first_pos, len - window), len) are read (window <= 0: no window), so no
// masking values (and no infinities) are ever needed. With lse non-null, the log-sum-exp of
// each head's scaled scores goes to lse [num_seqs, num_heads] (for merging partial attentions).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

namespace {

template <typename KV>
inline float to_float(KV x);
template <>
inline float to_float<float>(float x) { return x; }
template <>
inline float to_float<uint16_t>(uint16_t x) {   // bfloat16 bits
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename KV>
inline KV from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline uint16_t from_float<uint16_t>(float x) {   // round to nearest even, as torch's .to(bfloat16)
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename KV, int D>
void decode(const float* q, const KV* kv, const int32_t* tables, int64_t table_stride,
            const int32_t* lens, float* out, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_size_rt, int64_t block_size, int64_t num_blocks,
            float scale, int64_t window, int64_t first_pos, float* lse) {
  const int64_t hd = D > 0 ? D : head_size_rt;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * hd;                 // elements per token slot
  const int64_t v_offset = num_blocks * block_size * row;
  // One work item per sequence, all heads: each token's K (then V) row is read once, whole,
  // by one thread (per-(sequence, kv head) items made three threads fetch the same lines).
  // With fewer sequences than 2 per thread, items split by kv head so every thread works.
  const int64_t splits = num_seqs < 2 * omp_get_max_threads() ? num_kv_heads : 1;
  const int64_t heads_per_item = num_heads / splits;
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<float> acc;
    std::vector<float> qf;
    std::vector<float> inv_sum;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * splits; ++item) {
      const int64_t s = item / splits;
      const int64_t h0 = (item % splits) * heads_per_item;
      const int64_t h1 = h0 + heads_per_item;
      const int64_t len = lens[s];
      const int64_t start = std::max<int64_t>(first_pos, window > 0 ? len - window : 0);
      const int64_t n = len - start;
      if (n <= 0) continue;
      scores.resize(num_heads * n);
      acc.assign(num_heads * hd, 0.0f);
      qf.resize(num_heads * hd);
      inv_sum.resize(num_heads);
      const float* qs = q + s * num_heads * hd;
      for (int64_t i = h0 * hd; i < h1 * hd; ++i) qf[i] = qs[i] * scale;
      const int32_t* table = tables + s * table_stride;

      for (int64_t t = start; t < len; ++t) {
        const KV* k = kv + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
        for (int64_t h = h0; h < h1; ++h) {
          const float* qh = qf.data() + h * hd;
          const KV* kh = k + (h / group) * hd;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < hd; ++d) dot += qh[d] * to_float<KV>(kh[d]);
          scores[h * n + (t - start)] = dot;
        }
      }
      for (int64_t h = h0; h < h1; ++h) {
        float* sh = scores.data() + h * n;
        float mx = sh[0];
        for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sh[i]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          sh[i] = std::exp(sh[i] - mx);
          sum += sh[i];
        }
        inv_sum[h] = 1.0f / sum;
        if (lse) lse[s * num_heads + h] = mx + std::log(sum);
      }
      for (int64_t t = start; t < len; ++t) {
        const KV* v = kv + v_offset +
                      (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
        for (int64_t h = h0; h < h1; ++h) {
          const float p = scores[h * n + (t - start)];
          const KV* vh = v + (h / group) * hd;
          float* ah = acc.data() + h * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) ah[d] += p * to_float<KV>(vh[d]);
        }
      }
      float* os = out + s * num_heads * hd;
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t d = 0; d < hd; ++d) os[h * hd + d] = acc[h * hd + d] * inv_sum[h];
    }
  }
}

template <typename KV>
void dispatch(const float* q, const KV* kv, const int32_t* tables, int64_t table_stride,
              const int32_t* lens, float* out, int64_t num_seqs, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
              float scale, int64_t window, int64_t first_pos, float* lse) {
  switch (head_size) {
    case 64:
      return decode<KV, 64>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                            head_size, block_size, num_blocks, scale, window, first_pos, lse);
    case 128:
      return decode<KV, 128>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                             head_size, block_size, num_blocks, scale, window, first_pos, lse);
    default:
      return decode<KV, 0>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                           head_size, block_size, num_blocks, scale, window, first_pos, lse);
  }
}

template <typename KV>
void write_and_attend(const float* q, const float* k, const float* v, void* kv_cache, const int64_t* slots,
                      const int32_t* tables, int64_t table_stride, const int32_t* lens, float* out,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                      int64_t block_size, int64_t num_blocks, float scale, int64_t window) {
  KV* kv = static_cast<KV*>(kv_cache);
  const int64_t row = num_kv_heads * head_size;
  const int64_t v_offset = num_blocks * block_size * row;
  for (int64_t s = 0; s < num_seqs; ++s) {
    KV* kd = kv + slots[s] * row;
    KV* vd = kv + v_offset + slots[s] * row;
    for (int64_t i = 0; i < row; ++i) {
      kd[i] = from_float<KV>(k[s * row + i]);
      vd[i] = from_float<KV>(v[s * row + i]);
    }
  }
  dispatch<KV>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads, head_size, block_size,
               num_blocks, scale, window, 0, nullptr);
}

}  // namespace

extern "C" {

int tokenmill_kernels_abi_version() { return 2; }

void paged_decode_f32(const float* q, const float* kv, const int32_t* tables, int64_t table_stride,
                      const int32_t* lens, float* out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
                      float scale, int64_t window, int64_t first_pos, float* lse) {
  dispatch<float>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads, head_size,
                  block_size, num_blocks, scale, window, first_pos, lse);
}

void paged_decode_bf16kv(const float* q, const uint16_t* kv, const int32_t* tables, int64_t table_stride,
                         const int32_t* lens, float* out, int64_t num_seqs, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
                         float scale, int64_t window, int64_t first_pos, float* lse) {
  dispatch<uint16_t>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads, head_size,
                     block_size, num_blocks, scale, window, first_pos, lse);
}

// NATIVE_DECODE_ABI (attention_backends/interface.py), what fused decode steps call per layer:
// write each sequence's new K/V row [num_seqs, num_kv_heads, head_size] (float32) to its slot,
// then paged_decode over [0, lens). The cache is float32 or bfloat16 (rounded to nearest even).
void paged_attend_f32(const float* q, const float* k, const float* v, void* kv_cache, const int64_t* slots,
                      const int32_t* tables, int64_t table_stride, const int32_t* lens, float* out,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                      int64_t block_size, int64_t num_blocks, float scale, int64_t window) {
  write_and_attend<float>(q, k, v, kv_cache, slots, tables, table_stride, lens, out, num_seqs, num_heads,
                          num_kv_heads, head_size, block_size, num_blocks, scale, window);
}

void paged_attend_bf16kv(const float* q, const float* k, const float* v, void* kv_cache, const int64_t* slots,
                         const int32_t* tables, int64_t table_stride, const int32_t* lens, float* out,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                         int64_t block_size, int64_t num_blocks, float scale, int64_t window) {
  write_and_attend<uint16_t>(q, k, v, kv_cache, slots, tables, table_stride, lens, out, num_seqs, num_heads,
                             num_kv_heads, head_size, block_size, num_blocks, scale, window);
}

}  // extern "C"
