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
//
// Builds for any target: the float32 loops are portable C++, the vector loops need AVX-512
// (TM_AVX512F), the bf16 dot-product kernels AVX512-BF16 (TM_AVX512_BF16), each existing only
// under its macro; the paged_prefill entries answer -1 ("does not run here") without the latter.
#include "tokenmill_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if TM_AVX512_BF16
#include "flash_tiles.h"
#endif

namespace {

namespace tm = tokenmill_cpu;

template <typename KV>
inline float to_float(KV x);
template <>
inline float to_float<float>(float x) { return x; }
template <>
inline float to_float<uint16_t>(uint16_t x) { return tm::bf16_to_f32(x); }   // bfloat16 bits

template <typename KV>
inline KV from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline uint16_t from_float<uint16_t>(float x) { return tm::f32_to_bf16(x); }   // as torch's .to(bfloat16)

// fp8 caches (kv_cache_dtype "fp8" / "fp8_e4m3" and "fp8_e5m2", as vLLM's): a byte holds x / scale
// rounded to nearest even and saturated to the format's largest finite value, as torch's
// to_kv (clamp, then .to()) stores it; attention reads stored * scale, with k_scale folded into
// the query and v_scale into the output, so the loops see the stored values themselves.
template <int MantissaBits, int Bias, uint32_t MaxBits>
struct Fp8 {
  uint8_t bits;
  static constexpr int kMantissa = MantissaBits;
  static constexpr int kBias = Bias;
  static constexpr uint32_t kMax = MaxBits;      // float32 bits of the largest finite value
  // The value of the smallest normal's exponent field in float32, and one subnormal step.
  static constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(128 - Bias) << 23;
  static float ulp() { return std::ldexp(1.0f, 1 - Bias - MantissaBits); }
  // bf16 bits of m subnormal steps (m < 2^MantissaBits), a vpermw table.
  static constexpr uint16_t subnormal_bf16(int m) {
    int p = 0;
    while (m > 0 && (2 << p) <= m) ++p;
    return m == 0 ? 0 : static_cast<uint16_t>(((p + 1 - Bias - MantissaBits + 127) << 7) | ((m - (1 << p)) << (7 - p)));
  }
};
using E4M3 = Fp8<3, 7, 0x43E00000u>;     // largest 448
using E5M2 = Fp8<2, 15, 0x47600000u>;    // largest 57344
static_assert(sizeof(E4M3) == 1 && sizeof(E5M2) == 1, "one byte per value");

template <typename KV>
inline float to_float(KV x) {       // fp8
  const uint32_t mag = x.bits & 0x7Fu;
  float v;
  if (mag < (1u << KV::kMantissa)) {
    v = static_cast<float>(mag) * KV::ulp();
  } else {
    const uint32_t b = (mag << (23 - KV::kMantissa)) + (static_cast<uint32_t>(127 - KV::kBias) << 23);
    __builtin_memcpy(&v, &b, sizeof v);
  }
  return x.bits & 0x80 ? -v : v;
}

template <typename KV>
inline KV from_float(float x) {     // fp8
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  bits &= 0x7FFFFFFFu;
  constexpr int drop = 23 - KV::kMantissa;
  constexpr uint32_t rebias = static_cast<uint32_t>(127 - KV::kBias) << KV::kMantissa;
  if (bits > 0x7F800000u) return KV{static_cast<uint8_t>(sign | 0x7F)};                  // NaN
  if (bits >= KV::kMax) return KV{static_cast<uint8_t>(sign | ((KV::kMax >> drop) - rebias))};
  if (bits < KV::kMinNormalBits) {          // multiples of the subnormal step (2^M of them: the smallest normal)
    float a;
    __builtin_memcpy(&a, &bits, sizeof a);
    return KV{static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a / KV::ulp())))};
  }
  bits += (1u << (drop - 1)) - 1 + ((bits >> drop) & 1);
  return KV{static_cast<uint8_t>(sign | ((bits >> drop) - rebias))};
}

#if TM_AVX512F
// Sixteen values of a K/V row as float32 (bf16 widens exactly: its bits are a float's top half).
template <typename KV>
inline __m512 load16(const KV* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<uint16_t>(const uint16_t* p) {
  return tm::bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename F>
inline __m512 fp8x16_to_f32(const F* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - F::kMantissa), _mm512_set1_epi32((127 - F::kBias) << 23)));
  const __m512 tiny = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(F::ulp()));
  const __mmask16 sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(1 << F::kMantissa));
  const __m512i v = _mm512_castps_si512(_mm512_mask_blend_ps(sub, normal, tiny));
  return _mm512_castsi512_ps(_mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24)));
}
template <>
inline __m512 load16<E4M3>(const E4M3* p) { return fp8x16_to_f32(p); }
template <>
inline __m512 load16<E5M2>(const E5M2* p) { return fp8x16_to_f32(p); }

// Thirty-two values of a K/V row as bf16 bits: a bf16 row as it is, an fp8 row widened exactly
// (every fp8 value is a bf16 value): the exponent re-biased, subnormals from a vpermw table.
template <typename KV>
inline __m512i bf16x32(const KV* p) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
  const __m512i normal =
      _mm512_add_epi16(_mm512_slli_epi16(mag, 7 - KV::kMantissa), _mm512_set1_epi16((127 - KV::kBias) << 7));
  alignas(64) static constexpr uint16_t table[32] = {
      KV::subnormal_bf16(0), KV::subnormal_bf16(1), KV::subnormal_bf16(2), KV::subnormal_bf16(3),
      KV::subnormal_bf16(4), KV::subnormal_bf16(5), KV::subnormal_bf16(6), KV::subnormal_bf16(7)};
  const __m512i tiny = _mm512_permutexvar_epi16(mag, _mm512_load_si512(table));
  const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(1 << KV::kMantissa));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
  return _mm512_or_si512(_mm512_mask_blend_epi16(sub, normal, tiny), sign);
}
template <>
inline __m512i bf16x32<uint16_t>(const uint16_t* p) { return _mm512_loadu_si512(p); }

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}
inline void prefetch_row_l2(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T1);
}

// Lane j of the result = the sum of v[j]'s 16 lanes: a transpose-and-add tree, 45 instructions
// for 16 dot products where a horizontal sum each would take ~8 apiece.
inline __m512 sum16(const __m512* v) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];   // per 128-bit lane: partial sums of v[4i..4i+3]
  for (int i = 0; i < 4; ++i)
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Widen rows [t0, t0 + cnt) of KV heads [g0, g1) into buf [cnt][(g1 - g0) * D]: one contiguous
// read per row, and a prefetch of the row 64 positions ahead (blocks sit anywhere in the pool,
// so the hardware prefetcher cannot see the next block coming).
template <typename KV, int D>
inline void widen_rows(const KV* kv, const int32_t* table, int64_t block_size, int64_t row, int64_t g0, int64_t g1,
                       int64_t t0, int cnt, int64_t len, float* buf) {
  const int64_t width = (g1 - g0) * D;
  for (int j = 0; j < cnt; ++j) {
    const int64_t t = t0 + j;
    const KV* src = kv + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row + g0 * D;
    const int64_t ahead = t + 64;
    if (ahead < len)
      prefetch_row(kv + (static_cast<int64_t>(table[ahead / block_size]) * block_size + ahead % block_size) * row +
                       g0 * D, width * static_cast<int64_t>(sizeof(KV)));
    for (int64_t c = 0; c < width; c += 16) _mm512_storeu_ps(buf + j * width + c, load16<KV>(src + c));
  }
}

// scores[h * n + i] = q_h . k_(start + i) for query heads [h0, h1) (KV heads [g0, g1)), 16
// positions at a time: each K row is widened once and read by every head of its group.
template <typename KV, int D>
void qk_scores(const float* qf, const KV* kv, const int32_t* table, int64_t block_size, int64_t row, int64_t group,
               int64_t h0, int64_t h1, int64_t start, int64_t len, float* scores, int64_t n, float* buf) {
  constexpr int C = D / 16;
  const int64_t g0 = h0 / group, g1 = (h1 - 1) / group + 1, width = (g1 - g0) * D;
  for (int64_t t0 = start; t0 < len; t0 += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, len - t0));
    widen_rows<KV, D>(kv, table, block_size, row, g0, g1, t0, cnt, len, buf);
    const __mmask16 valid = static_cast<__mmask16>((1u << cnt) - 1);
    for (int64_t h = h0; h < h1; ++h) {
      const float* kf = buf + (h / group - g0) * D;
      __m512 qr[C];
      for (int c = 0; c < C; ++c) qr[c] = _mm512_loadu_ps(qf + h * D + 16 * c);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        if (j < cnt) {
          __m512 a = _mm512_mul_ps(qr[0], _mm512_loadu_ps(kf + j * width));
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kf + j * width + 16 * c), a);
          acc[j] = a;
        } else {
          acc[j] = _mm512_setzero_ps();
        }
      }
      _mm512_mask_storeu_ps(scores + h * n + (t0 - start), valid, sum16(acc));
    }
  }
}

// out[h] += sum_j p[h][t0 + j] v_j over the cnt widened rows in buf, for HC heads from h, the
// accumulators in registers.
template <int D, int HC>
inline void pv_chunk(const float* scores, int64_t n, int64_t offset, int cnt, const float* buf, int64_t width,
                     int64_t group, int64_t g0, int64_t h, float* out) {
  constexpr int C = D / 16;
  __m512 acc[HC][C];
  for (int i = 0; i < HC; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_loadu_ps(out + (h + i) * D + 16 * c);
  for (int j = 0; j < cnt; ++j)
    for (int i = 0; i < HC; ++i) {
      const float* vf = buf + j * width + ((h + i) / group - g0) * D;
      const __m512 p = _mm512_set1_ps(scores[(h + i) * n + offset + j]);
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vf + 16 * c), acc[i][c]);
    }
  for (int i = 0; i < HC; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (h + i) * D + 16 * c, acc[i][c]);
}

// out[h] = sum_i p[h][i] v_(start + i) for query heads [h0, h1) (out zeroed by the caller), 16
// rows at a time, heads in chunks whose accumulators fit the 32 vector registers.
template <typename KV, int D>
void pv_scores(const float* scores, int64_t n, const KV* kv, const int32_t* table, int64_t block_size,
               int64_t row, int64_t group, int64_t h0, int64_t h1, int64_t start, int64_t len, float* out,
               float* buf) {
  constexpr int kMaxHeads = D == 64 ? 4 : 2;
  const int64_t g0 = h0 / group, g1 = (h1 - 1) / group + 1, width = (g1 - g0) * D;
  for (int64_t t0 = start; t0 < len; t0 += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, len - t0));
    widen_rows<KV, D>(kv, table, block_size, row, g0, g1, t0, cnt, len, buf);
    for (int64_t h = h0; h < h1;) {
      const int64_t chunk = std::min<int64_t>(kMaxHeads, h1 - h);
      const int64_t offset = t0 - start;
      switch (chunk) {
        case 4: pv_chunk<D, (kMaxHeads >= 4 ? 4 : 1)>(scores, n, offset, cnt, buf, width, group, g0, h, out); break;
        case 3: pv_chunk<D, (kMaxHeads >= 3 ? 3 : 1)>(scores, n, offset, cnt, buf, width, group, g0, h, out); break;
        case 2: pv_chunk<D, 2>(scores, n, offset, cnt, buf, width, group, g0, h, out); break;
        default: pv_chunk<D, 1>(scores, n, offset, cnt, buf, width, group, g0, h, out); break;
      }
      h += chunk;
    }
  }
}
#endif  // TM_AVX512F

// row[i] = exp(row[i] - max) over n scores; returns their sum, the maximum in mx.
inline float exp_row(float* row, int64_t n, float& mx) {
  mx = row[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, row[i]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    row[i] = std::exp(row[i] - mx);
    sum += row[i];
  }
  return sum;
}

// Logit soft-capping (Gemma 2): each scaled score s becomes cap * tanh(s / cap) before the softmax.
inline void cap_scores(float* scores, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] * inv);
}

template <typename KV, int D>
void decode(const float* q, const KV* kv, const int32_t* tables, int64_t table_stride,
            const int32_t* lens, float* out, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_size_rt, int64_t block_size, int64_t num_blocks,
            float scale, int64_t window, int64_t first_pos, float* lse, float k_scale, float v_scale,
            float softcap) {
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
    std::vector<float> kf;
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
      for (int64_t i = h0 * hd; i < h1 * hd; ++i) qf[i] = qs[i] * (scale * k_scale);
      const int32_t* table = tables + s * table_stride;

      // D a multiple of 16 (64, 128) runs the vector loops (AVX-512); any other size the scalar ones.
#if TM_AVX512F
      constexpr bool vector = D > 0 && D % 16 == 0;
      if (vector) {
        kf.resize(16 * row);
        qk_scores<KV, (vector ? D : 16)>(qf.data(), kv, table, block_size, row, group, h0, h1, start, len,
                                         scores.data(), n, kf.data());
      }
#else
      constexpr bool vector = false;
#endif
      for (int64_t t = start; t < (vector ? start : len); ++t) {
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
        float mx;
        if (softcap > 0.0f) cap_scores(sh, n, softcap);
        const float sum = exp_row(sh, n, mx);
        inv_sum[h] = v_scale / sum;
        if (lse) lse[s * num_heads + h] = mx + std::log(sum);
      }
#if TM_AVX512F
      if (vector)
        pv_scores<KV, (vector ? D : 16)>(scores.data(), n, kv + v_offset, table, block_size, row, group, h0, h1,
                                         start, len, acc.data(), kf.data());
#endif
      for (int64_t t = start; t < (vector ? start : len); ++t) {
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

#if TM_AVX512_BF16
// decode<uint16_t, D> on AVX512-BF16 dot products: K and V rows are read straight from their
// blocks (the float32 loops widen every row into a buffer first, and a long-context decode step
// read its K/V at half the machine's memory bandwidth that way). The query and
// the probabilities are split into two bf16 halves each (x = hi + lo, ~16 significant bits), so
// scores and outputs stay within ~1e-6 of the float32 loops'; the softmax itself is float32.
// q . k: 16 positions per head as in qk_scores; P . V: pairs of V rows interleaved in registers
// (vpunpck{l,h}wd), each lane's float32 sum over two positions, dimensions permuted within
// 128-bit lanes and put back at the end.
template <typename KV, int D, int HC>
inline void pv_pairs(const uint16_t* p_hi, const uint16_t* p_lo, int64_t n2, const KV* const* vrows,
                     int64_t n, int64_t g_off, float* acc_out, int64_t prefetch_off, int64_t prefetch_bytes) {
  constexpr int C = D / 32;
  alignas(64) static const KV zeros[D] = {};
  __m512 acc[HC][2 * C];
  for (int k = 0; k < HC; ++k)
    for (int c = 0; c < 2 * C; ++c) acc[k][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    if (prefetch_bytes && i + 64 < n) {   // the first pass over these rows: the next blocks' rows
      prefetch_row(vrows[i + 64] + prefetch_off, prefetch_bytes);
      if (i + 65 < n) prefetch_row(vrows[i + 65] + prefetch_off, prefetch_bytes);
    }
    const KV* v0 = vrows[i] + g_off;
    const KV* v1 = i + 1 < n ? vrows[i + 1] + g_off : zeros;
    __m512bh lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i a = bf16x32<KV>(v0 + 32 * c), b = bf16x32<KV>(v1 + 32 * c);
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int k = 0; k < HC; ++k) {
      int32_t ph, pl;
      std::memcpy(&ph, p_hi + k * n2 + i, 4);
      std::memcpy(&pl, p_lo + k * n2 + i, 4);
      const __m512bh bh = (__m512bh)_mm512_set1_epi32(ph), bl = (__m512bh)_mm512_set1_epi32(pl);
      for (int c = 0; c < C; ++c) {
        acc[k][2 * c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[k][2 * c], bh, lo[c]), bl, lo[c]);
        acc[k][2 * c + 1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[k][2 * c + 1], bh, hi[c]), bl, hi[c]);
      }
    }
  }
  // Lane 4j + m of the unpacklo sums is dimension 8j + m of its 32, of the unpackhi sums 8j + 4 + m.
  for (int k = 0; k < HC; ++k)
    for (int c = 0; c < C; ++c) {
      alignas(64) float l[16], h[16];
      _mm512_store_ps(l, acc[k][2 * c]);
      _mm512_store_ps(h, acc[k][2 * c + 1]);
      float* o = acc_out + k * D + 32 * c;
      for (int j = 0; j < 4; ++j)
        for (int m = 0; m < 4; ++m) {
          o[8 * j + m] = l[4 * j + m];
          o[8 * j + 4 + m] = h[4 * j + m];
        }
    }
}

constexpr int64_t kPrefetchNext = 192;

template <typename KV, int D>
void decode_bf16_dots(const float* q, const KV* kv, const int32_t* tables, int64_t table_stride,
                      const int32_t* lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t block_size, int64_t num_blocks, float scale, int64_t window, int64_t first_pos,
                      float* lse, float k_scale, float v_scale, float softcap) {
  namespace tf = tokenmill_flash;
  constexpr int C = D / 32;
  constexpr int kMaxHeads = D == 64 ? 4 : 2;     // accumulators of a P . V chunk in registers
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * D;
  const int64_t v_offset = num_blocks * block_size * row;
  const int64_t splits = num_seqs < 2 * omp_get_max_threads() ? num_kv_heads : 1;
  const int64_t heads_per_item = num_heads / splits;
#pragma omp parallel
  {
    std::vector<float> scores, acc;
    std::vector<uint16_t> q_hi, q_lo, p_hi, p_lo;
    std::vector<const KV*> krows, vrows;
    std::vector<float> inv_sum;
    alignas(64) uint16_t kbuf[16 * D];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * splits; ++item) {
      const int64_t s = item / splits;
      const int64_t h0 = (item % splits) * heads_per_item, h1 = h0 + heads_per_item;
      const int64_t len = lens[s];
      const int64_t start = std::max<int64_t>(first_pos, window > 0 ? len - window : 0);
      const int64_t n = len - start, n2 = (n + 1) & ~int64_t{1};
      if (n <= 0) continue;
      const int64_t g0 = h0 / group, g1 = (h1 - 1) / group + 1;
      const int32_t* table = tables + s * table_stride;
      krows.resize(n);
      vrows.resize(n);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = start + i;
        krows[i] = kv + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
        vrows[i] = krows[i] + v_offset;
      }
      q_hi.resize(num_heads * D);
      q_lo.resize(num_heads * D);
      const float* qs = q + s * num_heads * D;
      for (int64_t i = h0 * D; i < h1 * D; ++i) {
        const float x = qs[i] * (scale * k_scale);
        q_hi[i] = tm::f32_to_bf16(x);
        q_lo[i] = tm::f32_to_bf16(x - to_float<uint16_t>(q_hi[i]));
      }
      scores.resize(num_heads * n);
      const int64_t width_bytes = (g1 - g0) * D * static_cast<int64_t>(sizeof(KV));
      // The K pass streams its rows 64 positions ahead (the first 64 up front: issued together,
      // their misses overlap) and pulls each V row into L2 behind it, so P . V reads no DRAM.
      for (int64_t i = 0; i < std::min<int64_t>(n, 64); ++i) prefetch_row(krows[i] + g0 * D, width_bytes);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int cnt = static_cast<int>(std::min<int64_t>(16, n - t0));
        for (int j = 0; j < cnt; ++j) {
          if (t0 + j + 64 < n) prefetch_row(krows[t0 + j + 64] + g0 * D, width_bytes);
          prefetch_row_l2(vrows[t0 + j] + g0 * D, width_bytes);
        }
        for (int64_t g = g0; g < g1; ++g) {
          // This KV head's rows of the chunk as bf16: a bf16 cache's in place, an fp8 cache's
          // widened once into kbuf for all the group's query heads.
          const uint16_t* kr[16];
          for (int j = 0; j < cnt; ++j) {
            if constexpr (std::is_same<KV, uint16_t>::value) {
              kr[j] = krows[t0 + j] + g * D;
            } else {
              for (int c = 0; c < C; ++c) _mm512_store_si512(kbuf + j * D + 32 * c, bf16x32<KV>(krows[t0 + j] + g * D + 32 * c));
              kr[j] = kbuf + j * D;
            }
          }
          for (int64_t h = std::max(h0, g * group); h < std::min(h1, (g + 1) * group); ++h) {
            __m512bh qh[C], ql[C];
            for (int c = 0; c < C; ++c) {
              qh[c] = (__m512bh)bf16x32<uint16_t>(q_hi.data() + h * D + 32 * c);
              ql[c] = (__m512bh)bf16x32<uint16_t>(q_lo.data() + h * D + 32 * c);
            }
            __m512 dots[16];
            for (int j = 0; j < 16; ++j) {
              if (j < cnt) {
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < C; ++c) {
                  const __m512bh kc = (__m512bh)bf16x32<uint16_t>(kr[j] + 32 * c);
                  a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a, qh[c], kc), ql[c], kc);
                }
                dots[j] = a;
              } else {
                dots[j] = _mm512_setzero_ps();
              }
            }
            _mm512_mask_storeu_ps(scores.data() + h * n + t0, static_cast<__mmask16>((1u << cnt) - 1), sum16(dots));
          }
        }
      }
      // Softmax in float32; the unnormalized probabilities (<= 1) as hi + lo bf16 halves, each
      // head's row padded to an even length with zeros (the pairs P . V reads).
      p_hi.assign((h1 - h0) * n2, 0);
      p_lo.assign((h1 - h0) * n2, 0);
      inv_sum.resize(h1 - h0);
      for (int64_t h = h0; h < h1; ++h) {
        float* sh = scores.data() + h * n;
        float mx;
        if (softcap > 0.0f) cap_scores(sh, n, softcap);
        const float sum = exp_row(sh, n, mx);
        inv_sum[h - h0] = v_scale / sum;
        if (lse) lse[s * num_heads + h] = mx + std::log(sum);
        uint16_t* ph = p_hi.data() + (h - h0) * n2;
        uint16_t* pl = p_lo.data() + (h - h0) * n2;
        for (int64_t i = 0; i < n; ++i) {
          ph[i] = tm::f32_to_bf16(sh[i]);
          pl[i] = tm::f32_to_bf16(sh[i] - to_float<uint16_t>(ph[i]));
        }
      }
      // The K rows of the item this thread most likely takes next (items go out in turn) into
      // L2 while P . V computes on rows already there: the stall at the start of its K pass is
      // what the row prefetches cannot hide (~6 % of a W1-shaped step).
      const int64_t next = item + omp_get_num_threads();
      if (next < num_seqs * splits) {
        const int64_t s2 = next / splits, len2 = lens[s2];
        const int64_t start2 = std::max<int64_t>(first_pos, window > 0 ? len2 - window : 0);
        const int32_t* table2 = tables + s2 * table_stride;
        for (int64_t t = start2; t < std::min<int64_t>(len2, start2 + kPrefetchNext); ++t)
          prefetch_row_l2(kv + (static_cast<int64_t>(table2[t / block_size]) * block_size + t % block_size) * row,
                          row * static_cast<int64_t>(sizeof(KV)));
      }
      acc.resize(num_heads * D);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t hb = std::max(h0, g * group), he = std::min(h1, (g + 1) * group);
        for (int64_t h = hb; h < he;) {
          const int64_t chunk = std::min<int64_t>(kMaxHeads, he - h);
          const uint16_t* ph = p_hi.data() + (h - h0) * n2;
          const uint16_t* pl = p_lo.data() + (h - h0) * n2;
          float* a = acc.data() + h * D;
          const int64_t first = h == h0 ? width_bytes : 0;
          switch (chunk) {
            case 4: pv_pairs<KV, D, (kMaxHeads >= 4 ? 4 : 1)>(ph, pl, n2, vrows.data(), n, g * D, a, g0 * D, first); break;
            case 3: pv_pairs<KV, D, (kMaxHeads >= 3 ? 3 : 1)>(ph, pl, n2, vrows.data(), n, g * D, a, g0 * D, first); break;
            case 2: pv_pairs<KV, D, 2>(ph, pl, n2, vrows.data(), n, g * D, a, g0 * D, first); break;
            default: pv_pairs<KV, D, 1>(ph, pl, n2, vrows.data(), n, g * D, a, g0 * D, first); break;
          }
          h += chunk;
        }
      }
      float* os = out + s * num_heads * D;
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t d = 0; d < D; ++d) os[h * D + d] = acc[h * D + d] * inv_sum[h - h0];
    }
  }
}
#endif

template <typename KV>
void dispatch(const float* q, const KV* kv, const int32_t* tables, int64_t table_stride,
              const int32_t* lens, float* out, int64_t num_seqs, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
              float scale, int64_t window, int64_t first_pos, float* lse, float k_scale, float v_scale,
              float softcap = 0.0f) {
#if TM_AVX512_BF16
  if constexpr (!std::is_same<KV, float>::value) {     // bf16 and fp8 caches
    if (head_size == 64)
      return decode_bf16_dots<KV, 64>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                                      block_size, num_blocks, scale, window, first_pos, lse, k_scale, v_scale, softcap);
    if (head_size == 128)
      return decode_bf16_dots<KV, 128>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                                       block_size, num_blocks, scale, window, first_pos, lse, k_scale, v_scale, softcap);
  }
#endif
  switch (head_size) {
    case 64:
      return decode<KV, 64>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                            head_size, block_size, num_blocks, scale, window, first_pos, lse, k_scale, v_scale, softcap);
    case 128:
      return decode<KV, 128>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                             head_size, block_size, num_blocks, scale, window, first_pos, lse, k_scale, v_scale, softcap);
    default:
      return decode<KV, 0>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                           head_size, block_size, num_blocks, scale, window, first_pos, lse, k_scale, v_scale, softcap);
  }
}

#if TM_AVX512F
// Cascade attention for a prefix every row shares (prefix caching: the same physical blocks at
// the start of every block table): each K/V row of the prefix is read once for all query rows
// instead of once per sequence. Query rows (sequence, head) of one KV head run in tiles; each
// tile streams the prefix in chunks of 16 positions with an online softmax. Out: the prefix's
// attention [num_seqs, num_heads, D] and its log-sum-exp [num_seqs, num_heads].
template <typename KV, int D>
void shared_prefix(const float* q, const KV* kv, const int32_t* blocks, int64_t prefix_len, int64_t block_size,
                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t v_offset, float scale,
                   float* out, float* lse, float k_scale, float v_scale) {
  constexpr int C = D / 16;
  constexpr int64_t kTile = 16;
  const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * D;
  const int64_t rows_per_head = num_seqs * group;
  const int64_t tiles = (rows_per_head + kTile - 1) / kTile;
#pragma omp parallel
  {
    std::vector<float> kf(16 * D), vf(16 * D), qt(kTile * D), acc(kTile * D), m(kTile), l(kTile);
    std::vector<float> sc(kTile * 16), rescale(kTile, 0.0f);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_kv_heads * tiles; ++item) {
      const int64_t g = item / tiles, r0 = (item % tiles) * kTile;
      const int64_t nr = std::min(kTile, rows_per_head - r0);
      for (int64_t r = 0; r < nr; ++r) {     // row r0 + r = (sequence, head in group)
        const int64_t s = (r0 + r) / group, h = g * group + (r0 + r) % group;
        for (int64_t d = 0; d < D; ++d) qt[r * D + d] = q[(s * num_heads + h) * D + d] * (scale * k_scale);
        m[r] = -1e30f;   // finite: -ffast-math assumes no infinities
        l[r] = 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t0 = 0; t0 < prefix_len; t0 += 16) {
        const int cnt = static_cast<int>(std::min<int64_t>(16, prefix_len - t0));
        for (int j = 0; j < cnt; ++j) {
          const int64_t t = t0 + j;
          const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
          for (int c = 0; c < C; ++c) {
            _mm512_storeu_ps(kf.data() + j * D + 16 * c, load16<KV>(kv + slot * row + g * D + 16 * c));
            _mm512_storeu_ps(vf.data() + j * D + 16 * c, load16<KV>(kv + v_offset + slot * row + g * D + 16 * c));
          }
        }
        const __mmask16 valid = static_cast<__mmask16>((1u << cnt) - 1);
        // Scores of every row first (independent rows keep the vector units busy), then each
        // row's softmax update, then P.V with two accumulator sets (even/odd positions) so the
        // FMA chains are half as long.
        for (int64_t r = 0; r < nr; ++r) {
          __m512 qr[C];
          for (int c = 0; c < C; ++c) qr[c] = _mm512_loadu_ps(qt.data() + r * D + 16 * c);
          __m512 dots[16];
          for (int j = 0; j < 16; ++j) {
            if (j < cnt) {
              __m512 a = _mm512_mul_ps(qr[0], _mm512_loadu_ps(kf.data() + j * D));
              for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kf.data() + j * D + 16 * c), a);
              dots[j] = a;
            } else {
              dots[j] = _mm512_setzero_ps();
            }
          }
          _mm512_storeu_ps(sc.data() + r * 16, sum16(dots));
        }
        for (int64_t r = 0; r < nr; ++r) {
          const __m512 scores = _mm512_loadu_ps(sc.data() + r * 16);
          const float top = std::max(m[r], _mm512_mask_reduce_max_ps(valid, scores));
          float* pr = sc.data() + r * 16;
          _mm512_storeu_ps(pr, _mm512_sub_ps(scores, _mm512_set1_ps(top)));
#pragma omp simd
          for (int j = 0; j < 16; ++j) pr[j] = j < cnt ? std::exp(pr[j]) : 0.0f;
          rescale[r] = m[r] - top;
          m[r] = top;
        }
#pragma omp simd
        for (int64_t r = 0; r < kTile; ++r) rescale[r] = std::exp(rescale[r]);   // 0 on the first chunk (m = -1e30)
        for (int64_t r = 0; r < nr; ++r) {
          const float* pr = sc.data() + r * 16;
          l[r] = l[r] * rescale[r] + _mm512_reduce_add_ps(_mm512_loadu_ps(pr));
          __m512 even[C], odd[C];
          const __m512 rs = _mm512_set1_ps(rescale[r]);
          for (int c = 0; c < C; ++c) {
            even[c] = _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * D + 16 * c), rs);
            odd[c] = _mm512_setzero_ps();
          }
          int j = 0;
          for (; j + 1 < cnt; j += 2) {
            const __m512 p0 = _mm512_set1_ps(pr[j]), p1 = _mm512_set1_ps(pr[j + 1]);
            for (int c = 0; c < C; ++c) {
              even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vf.data() + j * D + 16 * c), even[c]);
              odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vf.data() + (j + 1) * D + 16 * c), odd[c]);
            }
          }
          if (j < cnt) {
            const __m512 p0 = _mm512_set1_ps(pr[j]);
            for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vf.data() + j * D + 16 * c), even[c]);
          }
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc.data() + r * D + 16 * c, _mm512_add_ps(even[c], odd[c]));
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t s = (r0 + r) / group, h = g * group + (r0 + r) % group;
        const float inv = v_scale / l[r];
        for (int64_t d = 0; d < D; ++d) out[(s * num_heads + h) * D + d] = acc[r * D + d] * inv;
        lse[s * num_heads + h] = m[r] + std::log(l[r]);
      }
    }
  }
}
#endif

#if TM_AVX512_BF16
// n cache values (a multiple of 32) as bf16: copied, or fp8 widened exactly.
template <typename KV>
inline void widen_bf16(const KV* src, int64_t n, uint16_t* dst) {
  if constexpr (std::is_same<KV, uint16_t>::value) {
    std::memcpy(dst, src, n * 2);
  } else {
    for (int64_t i = 0; i < n; i += 32) _mm512_storeu_si512(dst + i, bf16x32<KV>(src + i));
  }
}

// shared_prefix on bf16 dot products for a bf16 cache: the prefix's blocks gathered and re-laid
// out once (flash_tiles.h's pair layouts), each KV head's queries (every row's heads of its
// group, rounded to bf16 as the prompt kernels round them) in tiles over it: AMX tiles of 16
// where the CPU has them, else AVX512-BF16 tiles of 8. With many rows over a long shared prefix
// (W3) the float32 kernel was a sizeable share of a run. (Without AVX512-BF16 the caller keeps
// the float32 kernel.)
template <typename KV, int D>
bool shared_prefix_bf16(const float* q, const KV* kv, const int32_t* blocks, int64_t prefix_len,
                        int64_t block_size, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t v_offset,
                        float scale, float* out, float* lse, float k_scale, float v_scale) {
  namespace tf = tokenmill_flash;
  const bool amx = tm::amx_usable();
  const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * D, rows = num_seqs * group;
  const int64_t head = (prefix_len + tf::kKeys - 1) / tf::kKeys * tf::kKeys * D;
  thread_local std::vector<uint16_t> kflat, vflat, kp, vp, qb;
  thread_local std::vector<float> ob, lb;
  kflat.resize(prefix_len * row);
  vflat.resize(prefix_len * row);
  for (int64_t b = 0; b * block_size < prefix_len; ++b) {      // prefix_len: whole blocks
    const int64_t n = std::min(block_size, prefix_len - b * block_size) * row;
    const KV* k = kv + blocks[b] * block_size * row;
    widen_bf16(k, n, kflat.data() + b * block_size * row);
    widen_bf16(k + v_offset, n, vflat.data() + b * block_size * row);
  }
  kp.assign(num_kv_heads * head + tf::kKeys * D, 0);      // + a zero block: AMX passes read two blocks
  vp.assign(num_kv_heads * head + tf::kKeys * D, 0);
  tf::pack_kv(kflat.data(), row, vflat.data(), row, prefix_len, num_kv_heads, D, kp.data(), vp.data());
  qb.resize(num_kv_heads * rows * D);
  ob.resize(num_kv_heads * rows * D);
  lb.resize(num_kv_heads * rows);
  for (int64_t g = 0; g < num_kv_heads; ++g)
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = q + ((r / group) * num_heads + g * group + r % group) * D;
      for (int64_t d = 0; d < D; ++d) qb[(g * rows + r) * D + d] = tm::f32_to_bf16(src[d]);
    }
  const int64_t tile_rows = amx ? tf::kAmxRows : tf::kRows;
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  // Plain pointers: inside the parallel loop a thread_local's name means each worker's own copy.
  const uint16_t *qd = qb.data(), *kd = kp.data(), *vd = vp.data();
  float *od = ob.data(), *ld = lb.data();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_kv_heads * tiles; ++item) {
    const int64_t g = item / tiles, i0 = (item % tiles) * tile_rows;
    tf::tile_kernel<D, float>(amx)(
        qd + g * rows * D, D, kd + g * head, vd + g * head, od + g * rows * D, D, 0, i0, std::min(tile_rows, rows - i0),
        prefix_len, scale * k_scale, 0, false, ld + g * rows, rows, 0);
  }
  for (int64_t g = 0; g < num_kv_heads; ++g)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = (r / group) * num_heads + g * group + r % group;
      for (int64_t d = 0; d < D; ++d) out[i * D + d] = ob[(g * rows + r) * D + d] * v_scale;
      lse[i] = lb[g * rows + r];
    }
  return true;
}
#endif  // TM_AVX512_BF16

// The number of leading blocks every sequence's table shares, each sequence keeping its queries
// after them (starts: query rows [num_seqs + 1]; null: one query a sequence, a decode batch).
inline int64_t common_blocks(const int32_t* tables, int64_t table_stride, const int32_t* lens, const int64_t* starts,
                             int64_t num_seqs, int64_t block_size) {
  if (num_seqs < 2) return 0;
  int64_t limit = INT64_MAX;
  for (int64_t s = 0; s < num_seqs; ++s)
    limit = std::min<int64_t>(limit, (lens[s] - (starts ? starts[s + 1] - starts[s] : 1)) / block_size);
  int64_t shared = 0;
  for (; shared < limit; ++shared) {
    const int32_t b = tables[shared];
    bool same = true;
    for (int64_t s = 1; s < num_seqs && same; ++s) same = tables[s * table_stride + shared] == b;
    if (!same) break;
  }
  return shared;
}

#if TM_AVX512_BF16
// Prompt chunks whose keys are all in the cache (written before the call; a chunk after cached
// context, or after a prefix other sequences share): chunk s is query rows starts[s] ..
// starts[s + 1] - 1 of q, at positions lens[s] - n_s + i, attending causally to positions 0 ..
// its own. The leading blocks every chunk's table shares, before every chunk's first query (W3:
// 63 chunks of 32 after one 512-token prefix), are gathered and re-laid out once; each chunk's
// other positions once per chunk. Each (chunk, head, tile of 8 queries) item then runs the
// AVX512-BF16 tile over the prefix and on over its own positions in one online softmax — no
// partial outputs to merge, and the query converted to bf16 (float32 activations) here, not by
// torch. q and out float32 or (q_bf16) bf16. False on AMX hosts (flash_prefill's AMX tiles win there).
// (Without AVX512-BF16 it does not exist, and the paged_prefill entries answer -1.)
template <typename KV, int D>
bool prefill_bf16(const void* q, int64_t q_stride, bool q_bf16, const KV* kv, const int32_t* tables,
                  int64_t table_stride, const int32_t* lens, const int64_t* starts, void* out, int64_t num_seqs,
                  int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t v_offset, float scale,
                  float k_scale, float v_scale) {
  namespace tf = tokenmill_flash;
  if (tm::amx_usable()) return false;
  const int64_t row = num_kv_heads * D, group = num_heads / num_kv_heads, qrow = num_heads * D;
  const int64_t prefix = common_blocks(tables, table_stride, lens, starts, num_seqs, block_size) * block_size;
  // Spans of keys: 0 the shared prefix, 1 + s chunk s's own positions [prefix, lens[s]).
  const int64_t spans = num_seqs + 1;
  std::vector<int64_t> first(spans + 1, 0), packed(spans + 1, 0), first_block(spans + 1, 0);
  std::vector<int64_t> first_item(num_seqs + 1, 0);
  auto span_len = [&](int64_t p) { return p == 0 ? prefix : lens[p - 1] - prefix; };
  for (int64_t p = 0; p < spans; ++p) {
    const int64_t blocks = (span_len(p) + tf::kKeys - 1) / tf::kKeys;
    first[p + 1] = first[p] + span_len(p);
    packed[p + 1] = packed[p] + num_kv_heads * blocks * tf::kKeys * D;
    first_block[p + 1] = first_block[p] + num_kv_heads * blocks;
  }
  for (int64_t s = 0; s < num_seqs; ++s)
    first_item[s + 1] = first_item[s] + num_heads * ((starts[s + 1] - starts[s] + tf::kRows - 1) / tf::kRows);
  thread_local std::vector<uint16_t> kflat, vflat, kp, vp, qb;
  kflat.resize(first[spans] * row);
  vflat.resize(first[spans] * row);
  kp.assign(packed[spans], 0);
  vp.assign(packed[spans], 0);
  if (!q_bf16) qb.resize(starts[num_seqs] * qrow);
  const int64_t qb_stride = q_bf16 ? q_stride : qrow;
  const float* qf = static_cast<const float*>(q);
  // Plain pointers: inside the parallel loops a thread_local's name means each worker's own copy.
  uint16_t *kf = kflat.data(), *vf = vflat.data(), *kd = kp.data(), *vd = vp.data(), *qd = qb.data();
#pragma omp parallel
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < first[spans]; ++i) {        // gather every span's rows
      const int64_t p = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
      const int64_t pos = (p == 0 ? 0 : prefix) + i - first[p];
      const int32_t* table = tables + (p == 0 ? 0 : (p - 1) * table_stride);
      const KV* k = kv + (table[pos / block_size] * block_size + pos % block_size) * row;
      widen_bf16(k, row, kf + i * row);
      widen_bf16(k + v_offset, row, vf + i * row);
    }
    if (!q_bf16) {      // float32 activations: the query rounded to bf16 once
#pragma omp for schedule(static)
      for (int64_t i = 0; i < starts[num_seqs]; ++i)
        for (int64_t c = 0; c < qrow; ++c) qd[i * qrow + c] = tm::f32_to_bf16(qf[i * q_stride + c]);
    } else {
#pragma omp barrier
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < first_block[spans]; ++item) {     // re-lay out every span's blocks
      const int64_t p = std::upper_bound(first_block.begin(), first_block.end(), item) - first_block.begin() - 1;
      const int64_t blocks = (span_len(p) + tf::kKeys - 1) / tf::kKeys, local = item - first_block[p];
      tf::pack_kv_block(kf + first[p] * row, row, vf + first[p] * row, row, span_len(p), D, local / blocks,
                        local % blocks, kd + packed[p], vd + packed[p]);
    }
  }
  const uint16_t* qbf = q_bf16 ? static_cast<const uint16_t*>(q) : qd;
  const int64_t head0 = packed[1] / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < first_item[num_seqs]; ++item) {
    // Items of one chunk are consecutive; within it, its last tiles first (they see more keys).
    const int64_t s = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t n = starts[s + 1] - starts[s], tiles = (n + tf::kRows - 1) / tf::kRows;
    const int64_t local = item - first_item[s];
    const int64_t tile = tiles - 1 - local / num_heads, h = local % num_heads, g = h / group;
    const int64_t i0 = tile * tf::kRows, rows = std::min(tf::kRows, n - i0);
    tf::Tile<D> t(qbf + (starts[s] + i0) * qb_stride + h * D, qb_stride, rows);
    if (prefix > 0) tf::attend_keys<D>(t, kd + g * head0, vd + g * head0, prefix, scale * k_scale, false, 0);
    const int64_t own = (packed[s + 2] - packed[s + 1]) / num_kv_heads;
    tf::attend_keys<D>(t, kd + packed[s + 1] + g * own, vd + packed[s + 1] + g * own, lens[s] - prefix,
                       scale * k_scale, true, lens[s] - n - prefix + i0);
    if (q_bf16)
      tf::store_rows<D, uint16_t>(t.acc, t.lsum, t.m, 0.6931471805599453f, rows,
                                  static_cast<uint16_t*>(out) + starts[s] * qrow, qrow, h, i0, nullptr, 0, v_scale);
    else
      tf::store_rows<D, float>(t.acc, t.lsum, t.m, 0.6931471805599453f, rows,
                               static_cast<float*>(out) + starts[s] * qrow, qrow, h, i0, nullptr, 0, v_scale);
  }
  return true;
}
#endif  // TM_AVX512_BF16

// A decode batch's shared prefix shorter than this is not worth a pass of its own.
constexpr int64_t kCascadeMinTokens = 128;

template <typename KV>
void write_and_attend(const float* q, const float* k, const float* v, void* kv_cache, const int64_t* slots,
                      const int32_t* tables, int64_t table_stride, const int32_t* lens, float* out,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                      int64_t block_size, int64_t num_blocks, float scale, int64_t window, float k_scale,
                      float v_scale, float softcap) {
  KV* kv = static_cast<KV*>(kv_cache);
  const int64_t row = num_kv_heads * head_size;
  const int64_t v_offset = num_blocks * block_size * row;
  for (int64_t s = 0; s < num_seqs; ++s) {
    KV* kd = kv + slots[s] * row;
    KV* vd = kv + v_offset + slots[s] * row;
    for (int64_t i = 0; i < row; ++i) {
      kd[i] = from_float<KV>(k[s * row + i] / k_scale);    // scales are 1 but for fp8 caches
      vd[i] = from_float<KV>(v[s * row + i] / v_scale);
    }
  }
#if TM_AVX512F
  // The cascade pass's prefix tiles do not cap scores: soft-capped layers take the plain pass.
  const int64_t common = window > 0 || softcap > 0.0f || (head_size != 64 && head_size != 128)
                             ? 0 : common_blocks(tables, table_stride, lens, nullptr, num_seqs, block_size) * block_size;
  const int64_t prefix = common >= kCascadeMinTokens ? common : 0;
  if (prefix > 0) {
    // The prefix once for all rows, each row's own positions after it, merged by log-sum-exp.
    thread_local std::vector<float> part, lse_prefix, lse_own;
    const int64_t n = num_seqs * num_heads;
    part.resize(n * head_size);
    lse_prefix.resize(n);
    lse_own.resize(n);
    bool on_tiles = false;
#if TM_AVX512_BF16
    if constexpr (!std::is_same<KV, float>::value)      // bf16 and fp8 caches
      on_tiles = head_size == 64
                     ? shared_prefix_bf16<KV, 64>(q, kv, tables, prefix, block_size, num_seqs, num_heads, num_kv_heads,
                                                  v_offset, scale, part.data(), lse_prefix.data(), k_scale, v_scale)
                     : shared_prefix_bf16<KV, 128>(q, kv, tables, prefix, block_size, num_seqs, num_heads,
                                                   num_kv_heads, v_offset, scale, part.data(), lse_prefix.data(),
                                                   k_scale, v_scale);
#endif
    if (!on_tiles && head_size == 64)
      shared_prefix<KV, 64>(q, kv, tables, prefix, block_size, num_seqs, num_heads, num_kv_heads, v_offset, scale,
                            part.data(), lse_prefix.data(), k_scale, v_scale);
    else if (!on_tiles)
      shared_prefix<KV, 128>(q, kv, tables, prefix, block_size, num_seqs, num_heads, num_kv_heads, v_offset, scale,
                             part.data(), lse_prefix.data(), k_scale, v_scale);
    dispatch<KV>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads, head_size, block_size,
                 num_blocks, scale, 0, prefix, lse_own.data(), k_scale, v_scale);
    for (int64_t i = 0; i < n; ++i) {
      const float top = std::max(lse_prefix[i], lse_own[i]);
      const float wp = std::exp(lse_prefix[i] - top), wo = std::exp(lse_own[i] - top);
      const float inv = 1.0f / (wp + wo);
      for (int64_t d = 0; d < head_size; ++d)
        out[i * head_size + d] = (part[i * head_size + d] * wp + out[i * head_size + d] * wo) * inv;
    }
    return;
  }
#endif
  dispatch<KV>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads, head_size, block_size,
               num_blocks, scale, window, 0, nullptr, k_scale, v_scale, softcap);
}

}  // namespace

extern "C" {

int tokenmill_kernels_abi_version() { return 6; }

// paged_decode_<cache>: q [num_seqs, num_heads, head_size] float32 attending to positions
// [first_pos, lens[s]) (and the window) of a cache of float32, bf16 or fp8 values; an fp8 cache
// reads stored * k_scale / v_scale (1 for the others). lse optional.
#define TOKENMILL_PAGED_DECODE(NAME, KV)                                                                      \
  void NAME(const float* q, const KV* kv, const int32_t* tables, int64_t table_stride, const int32_t* lens,     \
            float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,           \
            int64_t block_size, int64_t num_blocks, float scale, int64_t window, int64_t first_pos, float* lse, \
            float k_scale, float v_scale) {                                                                     \
    dispatch<KV>(q, kv, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads, head_size,         \
                 block_size, num_blocks, scale, window, first_pos, lse, k_scale, v_scale);                      \
  }
TOKENMILL_PAGED_DECODE(paged_decode_f32, float)
TOKENMILL_PAGED_DECODE(paged_decode_bf16kv, uint16_t)
TOKENMILL_PAGED_DECODE(paged_decode_fp8e4m3, E4M3)
TOKENMILL_PAGED_DECODE(paged_decode_fp8e5m2, E5M2)

// NATIVE_DECODE_ABI (attention_backends/interface.py), what fused decode steps call per layer:
// write each sequence's new K/V row [num_seqs, num_kv_heads, head_size] (float32) to its slot
// (bf16 rounded to nearest even; fp8 as k / k_scale, v / v_scale, saturated), then
// paged_decode over [0, lens).
#define TOKENMILL_PAGED_ATTEND(NAME, KV)                                                                        \
  void NAME(const float* q, const float* k, const float* v, void* kv_cache, const int64_t* slots,               \
            const int32_t* tables, int64_t table_stride, const int32_t* lens, float* out, int64_t num_seqs,     \
            int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks, \
            float scale, int64_t window, float k_scale, float v_scale, float softcap) {                         \
    write_and_attend<KV>(q, k, v, kv_cache, slots, tables, table_stride, lens, out, num_seqs, num_heads,        \
                         num_kv_heads, head_size, block_size, num_blocks, scale, window, k_scale, v_scale,      \
                         softcap);                                                                              \
  }
TOKENMILL_PAGED_ATTEND(paged_attend_f32, float)
TOKENMILL_PAGED_ATTEND(paged_attend_bf16kv, uint16_t)
TOKENMILL_PAGED_ATTEND(paged_attend_fp8e4m3, E4M3)
TOKENMILL_PAGED_ATTEND(paged_attend_fp8e5m2, E5M2)

// paged_prefill_<cache>: prompt chunks whose K/V are in a bf16 or fp8 cache (prefill_bf16): q
// [starts[num_seqs], num_heads, head_size] with rows q_stride elements apart, out the same shape
// contiguous, both float32 (q_bf16 = 0) or bf16; lens [num_seqs]
// each chunk's sequence length through its last query. Returns 0, or -1 where this build or CPU
// does not run it, having touched nothing (an AMX host, head sizes other than 64 and 128, and
// every call of a build without AVX512-BF16: the caller keeps its flash path).
#if TM_AVX512_BF16
#define TOKENMILL_PAGED_PREFILL(NAME, KV)                                                                           \
  int64_t NAME(const void* q, int64_t q_stride, int64_t q_bf16, const KV* kv, const int32_t* tables,                \
               int64_t table_stride, const int32_t* lens, const int64_t* starts, void* out, int64_t num_seqs,       \
               int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,  \
               float scale, float k_scale, float v_scale) {                                                         \
    const int64_t v_offset = num_blocks * block_size * num_kv_heads * head_size;                                    \
    auto run = head_size == 64 ? prefill_bf16<KV, 64> : head_size == 128 ? prefill_bf16<KV, 128> : nullptr;         \
    return run && run(q, q_stride, q_bf16 != 0, kv, tables, table_stride, lens, starts, out, num_seqs, num_heads,   \
                      num_kv_heads, block_size, v_offset, scale, k_scale, v_scale) ? 0 : -1;                        \
  }
#else
#define TOKENMILL_PAGED_PREFILL(NAME, KV)                                                                           \
  int64_t NAME(const void*, int64_t, int64_t, const KV*, const int32_t*, int64_t, const int32_t*, const int64_t*,   \
               void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float, float) {                  \
    return -1;   /* refused: no AVX512-BF16 in this build */                                                        \
  }
#endif
TOKENMILL_PAGED_PREFILL(paged_prefill_bf16kv, uint16_t)
TOKENMILL_PAGED_PREFILL(paged_prefill_fp8e4m3, E4M3)
TOKENMILL_PAGED_PREFILL(paged_prefill_fp8e5m2, E5M2)

// A step's K and V rows into their cache slots, one memcpy of row_bytes each: k row i (src_stride
// bytes apart, the same for v) to k_dst + slots[i] * row_bytes. torch's CPU index_copy_ spends
// ~0.4 us per row, which a long prompt's KV write paid in every layer; one thread copies a 2048-row
// chunk in tens of microseconds, less than waking a second one costs.
void scatter_kv_rows(const char* k, const char* v, int64_t src_stride, char* k_dst, char* v_dst, int64_t row_bytes,
                     const int64_t* slots, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(k_dst + slots[i] * row_bytes, k + i * src_stride, row_bytes);
    std::memcpy(v_dst + slots[i] * row_bytes, v + i * src_stride, row_bytes);
  }
}

}  // extern "C"
