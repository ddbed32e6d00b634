// Causal (or full) attention of a prompt chunk for the cpu_sdpa backend, bf16 in and out, on
// AVX512-BF16 dot products: flash attention with an online softmax, float32 scores and
// accumulators, the probabilities rounded to bf16 for P.V (as GPU flash kernels do).
//
// torch's CPU flash kernel runs its small per-block GEMMs at ~120 GFLOP/s on a 2048-token
// prompt of SmolLM2 (9 heads of 64); here K and V are first re-laid out once per call into
// the pair layouts vdpbf16ps reads, then every (head, 8-query tile) item streams them:
//   Kp [kv head][key block of 16][D/2 pairs][16 keys][2]   lanes = keys: 16 scores per dot step
//   Vp [kv head][key pair][D][2]                           lanes = dims: 16 outputs per dot step
//
// Layouts (row-major; token strides in elements, each head's D values contiguous):
//   q   [tq, num_heads, D]      query i sits at position q_offset + i
//   k,v [tk, num_kv_heads, D]   keys at positions 0 .. tk - 1
//   out [tq, num_heads, D]      bf16 (round to nearest even)
//   lse [num_heads, tq]         float32 log-sum-exp of the scaled scores, or null
// Causal: query i sees keys 0 .. q_offset + i; otherwise every key. Plain C++ with OpenMP and
// no torch headers, built by platforms/native_build.py like paged_decode.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "../../platforms/csrc/amx_tiles.h"
#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

extern "C" int tokenmill_kernels_abi_version() { return 2; }

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kKeys = 16;   // keys per block: one 512-bit register of float32 scores
constexpr int64_t kRows = 8;    // query rows per tile: 8 score accumulators + the K pair
// The running maximum before any score: finite, since -ffast-math assumes no infinities.
constexpr float kNone = -1e30f;

inline uint16_t round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// Key block b (kKeys keys) of KV head g of one prompt of tk keys into the kernel's layouts: K as
// [d/2][16][2] pairs, V as key pairs [d][2]; kp/vp point at the prompt's packed heads.
inline void pack_kv_block(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int64_t tk,
                          int64_t d, int64_t g, int64_t b, uint16_t* kp, uint16_t* vp) {
  const int64_t blocks = (tk + kKeys - 1) / kKeys, pairs = (tk + 1) / 2;
  const int64_t head = blocks * kKeys * d;
  uint16_t* dst = kp + g * head + b * kKeys * d;
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t t = b * kKeys + j;
    for (int64_t p = 0; p < d / 2; ++p) {
      uint16_t lo = 0, hi = 0;
      if (t < tk) {
        lo = k[t * k_stride + g * d + 2 * p];
        hi = k[t * k_stride + g * d + 2 * p + 1];
      }
      dst[(p * kKeys + j) * 2] = lo;
      dst[(p * kKeys + j) * 2 + 1] = hi;
    }
  }
  for (int64_t jp = b * kKeys / 2; jp < std::min(pairs, (b + 1) * kKeys / 2); ++jp) {
    uint16_t* row = vp + g * head + jp * 2 * d;
    for (int64_t c = 0; c < d; ++c) {
      row[2 * c] = v[(2 * jp) * v_stride + g * d + c];
      row[2 * c + 1] = 2 * jp + 1 < tk ? v[(2 * jp + 1) * v_stride + g * d + c] : 0;
    }
  }
}

void pack_kv(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int64_t tk, int64_t num_kv_heads, int64_t d,
             uint16_t* kp, uint16_t* vp) {
  const int64_t blocks = (tk + kKeys - 1) / kKeys;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < num_kv_heads; ++g)
    for (int64_t b = 0; b < blocks; ++b)
      pack_kv_block(k, k_stride, v, v_stride, tk, d, g, b, kp, vp);
}

template <int D>
void attend_tile(const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp, uint16_t* out,
                 int64_t out_stride, int64_t h, int64_t i0, int64_t rows, int64_t tk, float scale, int64_t q_offset,
                 bool causal, float* lse, int64_t tq) {
  constexpr int C = D / 16, P = D / 2;
  alignas(64) float acc[kRows][D];
  alignas(64) float prob[kRows][2 * kKeys];
  float m[kRows], l[kRows];
  for (int r = 0; r < kRows; ++r) {       // rows past `rows` keep probability 0 throughout
    m[r] = kNone;
    l[r] = 0.0f;
    for (int c = 0; c < D; ++c) acc[r][c] = 0.0f;
    for (int j = 0; j < 2 * kKeys; ++j) prob[r][j] = 0.0f;
  }
  const int32_t* qrow[kRows];
  for (int r = 0; r < kRows; ++r)
    qrow[r] = reinterpret_cast<const int32_t*>(q + (i0 + std::min<int64_t>(r, rows - 1)) * q_stride + h * D);
  const int64_t last = causal ? std::min(tk, q_offset + i0 + rows) : tk;     // keys [0, last) can be seen
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Two key blocks (32 keys) a pass where there are: 16 score accumulators share each query
  // broadcast, and the per-row softmax bookkeeping runs half as often.
  auto pass = [&](auto blocks_c, int64_t b) {
    constexpr int NB = decltype(blocks_c)::value;
    __m512 s[kRows][NB];
    for (int r = 0; r < kRows; ++r)
      for (int n = 0; n < NB; ++n) s[r][n] = _mm512_setzero_ps();
    const uint16_t* kb = kp + b * kKeys * D;
    for (int p = 0; p < P; ++p) {
      __m512bh kz[NB];
      for (int n = 0; n < NB; ++n) kz[n] = (__m512bh)_mm512_loadu_si512(kb + n * kKeys * D + p * kKeys * 2);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(qrow[r][p]);
        for (int n = 0; n < NB; ++n) s[r][n] = _mm512_dpbf16_ps(s[r][n], qp, kz[n]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t limit = causal ? std::min(tk, q_offset + i0 + r + 1) : tk;   // keys < limit
      __mmask16 visible[NB];
      __m512 scores[NB];
      float top = m[r];
      for (int n = 0; n < NB; ++n) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>((b + n) * kKeys)));
        visible[n] = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(limit)));
        scores[n] = _mm512_mul_ps(s[r][n], vscale);
        if (visible[n]) top = std::max(top, _mm512_mask_reduce_max_ps(visible[n], scores[n]));
      }
      alignas(64) float e[NB * kKeys];
      for (int n = 0; n < NB; ++n) _mm512_store_ps(e + n * kKeys, _mm512_sub_ps(scores[n], _mm512_set1_ps(top)));
#pragma omp simd
      for (int j = 0; j < NB * kKeys; ++j) e[j] = std::exp(e[j]);
      __m512 total = _mm512_setzero_ps();
      for (int n = 0; n < NB; ++n) {
        const __m512 pr = _mm512_maskz_mov_ps(visible[n], _mm512_load_ps(e + n * kKeys));
        total = _mm512_add_ps(total, pr);
        _mm512_store_ps(prob[r] + n * kKeys, pr);
      }
      const float rescale = std::exp(m[r] - top);        // 0 on the first block (m = kNone)
      l[r] = l[r] * rescale + _mm512_reduce_add_ps(total);
      m[r] = top;
      if (rescale != 1.0f) {
        const __m512 rs = _mm512_set1_ps(rescale);
        for (int c = 0; c < C; ++c) _mm512_store_ps(acc[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), rs));
      }
    }
    const uint16_t* vb = vp + b * kKeys * D;      // key pairs 8b .. 8b + 8 NB - 1, [d][2] each
    const int64_t pairs = std::min<int64_t>(NB * kKeys / 2, (last - b * kKeys + 1) / 2);
    // Four rows at a time: each V pair loaded once for 4 x C independent accumulators (one
    // row's C chains alone would wait on the dot product's latency).
    for (int r0 = 0; r0 < rows; r0 += 4) {
      alignas(64) uint16_t pb[4][NB * kKeys];
      for (int i = 0; i < 4; ++i)
        for (int n = 0; n < NB; ++n)
          _mm256_store_si256(reinterpret_cast<__m256i*>(pb[i] + n * kKeys),
                             (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(prob[r0 + i] + n * kKeys)));
      __m512 o[4][C];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < C; ++c) o[i][c] = _mm512_load_ps(acc[r0 + i] + 16 * c);
      for (int64_t jp = 0; jp < pairs; ++jp) {
        __m512bh vv[C];
        for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vb + (jp * D + 16 * c) * 2);
        for (int i = 0; i < 4; ++i) {
          const __m512bh pj = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(pb[i])[jp]);
          for (int c = 0; c < C; ++c) o[i][c] = _mm512_dpbf16_ps(o[i][c], pj, vv[c]);
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < C; ++c) _mm512_store_ps(acc[r0 + i] + 16 * c, o[i][c]);
    }
  };
  int64_t b = 0;
  for (; (b + 1) * kKeys < last; b += 2) pass(std::integral_constant<int, 2>(), b);
  if (b * kKeys < last) pass(std::integral_constant<int, 1>(), b);
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / l[r];
    uint16_t* dst = out + (i0 + r) * out_stride + h * D;
    for (int c = 0; c < D; ++c) dst[c] = round_bf16(acc[r][c] * inv);
    if (lse) lse[h * tq + i0 + r] = m[r] + std::log(l[r]);
  }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// AMX tiles (Sapphire Rapids and later): 16 queries a tile, two key blocks (32 keys) a pass.
// S = Q.K^T as two 16 x 16 float32 tiles (the packed K block's D/2 pairs x 16 keys x 2 is the
// tile's B layout already), the online softmax on vectors (exp by exp2 polynomial: glibc's vector
// expf and torch's Sleef exp were half of torch's flash time), P rounded to bf16 as one 16 x 32
// A tile, P.V into fresh tiles (V's key pairs x D x 2 is B's layout), added to the float32
// accumulators after their rescale. torch's own flash runs on AMX too (its Sleef exp half its
// time): a 2048-token causal SmolLM2 prompt took 7.0 ms here against its 9.5 (2-core Xeon).
constexpr int64_t kAmxRows = 16;

using tokenmill_amx::amx_ready;

// e^x for x <= 0 (down to kNone: 0): 2^(n + f), f in [-1/2, 1/2], a degree-4 polynomial for 2^f
// (relative error < 5e-5, far below P's bf16 rounding), scaled by 2^n.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-120.0f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291076284772e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// attend_tile's contract for up to 16 rows. kp/vp must be readable one key block past the
// head's last (the caller pads the buffers): a pass always loads two blocks, masking the second.
template <int D>
void attend_tile_amx(const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp, uint16_t* out,
                     int64_t out_stride, int64_t h, int64_t i0, int64_t rows, int64_t tk, float scale,
                     int64_t q_offset, bool causal, float* lse, int64_t tq) {
  static_assert(D % 64 == 0, "head size in whole 64-wide tile groups");
  tokenmill_amx::configure_tiles();
  alignas(64) float acc[kAmxRows][D];
  alignas(64) float part[kAmxRows][D];
  alignas(64) float s[2][2][kAmxRows][kKeys];     // [buffer][key block][row][key]
  alignas(64) uint16_t prob[kAmxRows][2 * kKeys];
  alignas(64) uint16_t qpad[kAmxRows][D];
  alignas(64) float m[kAmxRows], rescale[kAmxRows], tops[kAmxRows], sums[kAmxRows][16];
  for (int r = 0; r < kAmxRows; ++r) {
    m[r] = kNone;
    for (int c = 0; c < D; ++c) acc[r][c] = 0.0f;
  }
  // The query tile: in place when 16 rows are real, else padded with zero rows.
  const uint8_t* qbase = reinterpret_cast<const uint8_t*>(q + i0 * q_stride + h * D);
  int64_t qstride = q_stride * 2;
  if (rows < kAmxRows) {
    for (int r = 0; r < kAmxRows; ++r)
      for (int c = 0; c < D; ++c) qpad[r][c] = r < rows ? q[(i0 + r) * q_stride + h * D + c] : 0;
    qbase = reinterpret_cast<const uint8_t*>(&qpad[0][0]);
    qstride = D * 2;
  }
  const uint8_t* kb8 = reinterpret_cast<const uint8_t*>(kp);
  const uint8_t* vb8 = reinterpret_cast<const uint8_t*>(vp);
  const int64_t last = causal ? std::min(tk, q_offset + i0 + rows) : tk;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // S = Q.K^T of the pass from key block b into s[buf] (tiles 0 and 1, stored).
  auto scores = [&](int64_t b, int buf) {
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < D / 32; ++c) {
      _tile_loadd(2, qbase + c * 64, qstride);
      _tile_loadd(3, kb8 + (b * kKeys * D + c * 512) * 2, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(4, kb8 + ((b + 1) * kKeys * D + c * 512) * 2, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, &s[buf][0][0][0], 64);
    _tile_stored(1, &s[buf][1][0][0], 64);
  };
  // Row sums stay 16 lanes wide until the end (no horizontal add per pass).
  alignas(64) float lsum[kAmxRows][16];
  for (int r = 0; r < kAmxRows; ++r) _mm512_store_ps(lsum[r], _mm512_setzero_ps());
  scores(0, 0);
  int buf = 0;
  for (int64_t b = 0; b * kKeys < last; b += 2, buf ^= 1) {
    const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(b * kKeys)));
    const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(static_cast<int32_t>(kKeys)));
    for (int r = 0; r < kAmxRows; ++r) {
      // Padding rows see no key (their probabilities stay 0; nothing of them is stored).
      const int64_t limit = r >= rows ? 0 : causal ? std::min(tk, q_offset + i0 + r + 1) : tk;
      const __m512i lim = _mm512_set1_epi32(static_cast<int32_t>(limit));
      const __mmask16 vis0 = _mm512_cmplt_epi32_mask(key0, lim), vis1 = _mm512_cmplt_epi32_mask(key1, lim);
      const __m512 none = _mm512_set1_ps(kNone);
      const __m512 s0 = _mm512_mask_mul_ps(none, vis0, _mm512_load_ps(s[buf][0][r]), vscale);
      const __m512 s1 = _mm512_mask_mul_ps(none, vis1, _mm512_load_ps(s[buf][1][r]), vscale);
      const float top = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      const __m512 vtop = _mm512_set1_ps(top);
      const __m512 p0 = _mm512_maskz_mov_ps(vis0, exp_nonpositive(_mm512_sub_ps(s0, vtop)));
      const __m512 p1 = _mm512_maskz_mov_ps(vis1, exp_nonpositive(_mm512_sub_ps(s1, vtop)));
      tops[r] = top;
      _mm512_store_ps(sums[r], _mm512_add_ps(p0, p1));
      _mm512_store_si512(prob[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    // The next pass's scores while P's stores reach L1 (a tile load waits for them).
    if ((b + 2) * kKeys < last) scores(b + 2, buf ^ 1);
    {   // every row's rescale e^(m - top) in one vector (0 on a row's first block: m = kNone)
      const __m512 top = _mm512_load_ps(tops), old = _mm512_load_ps(m);
      _mm512_store_ps(rescale, exp_nonpositive(_mm512_sub_ps(old, top)));
      _mm512_store_ps(m, top);
    }
    // P.V for the 32 keys (16 key pairs from pair 8b), 64 output dims a round in tiles 0, 1, 6, 7.
    _tile_loadd(5, &prob[0][0], 64);
    const uint8_t* vpass = vb8 + b * (kKeys / 2) * 2 * D * 2;
    for (int c0 = 0; c0 < D; c0 += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(6);
      _tile_zero(7);
      _tile_loadd(2, vpass + (c0 + 0) * 4, D * 4);
      _tile_dpbf16ps(0, 5, 2);
      _tile_loadd(3, vpass + (c0 + 16) * 4, D * 4);
      _tile_dpbf16ps(1, 5, 3);
      _tile_loadd(4, vpass + (c0 + 32) * 4, D * 4);
      _tile_dpbf16ps(6, 5, 4);
      _tile_loadd(2, vpass + (c0 + 48) * 4, D * 4);
      _tile_dpbf16ps(7, 5, 2);
      _tile_stored(0, &part[0][c0], D * 4);
      _tile_stored(1, &part[0][c0 + 16], D * 4);
      _tile_stored(6, &part[0][c0 + 32], D * 4);
      _tile_stored(7, &part[0][c0 + 48], D * 4);
    }
    for (int r = 0; r < rows; ++r) {
      const __m512 rs = _mm512_set1_ps(rescale[r]);
      _mm512_store_ps(lsum[r], _mm512_fmadd_ps(_mm512_load_ps(lsum[r]), rs, _mm512_load_ps(sums[r])));
      for (int c = 0; c < D; c += 16)
        _mm512_store_ps(acc[r] + c, _mm512_fmadd_ps(_mm512_load_ps(acc[r] + c), rs, _mm512_load_ps(part[r] + c)));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float total = _mm512_reduce_add_ps(_mm512_load_ps(lsum[r]));
    const float inv = 1.0f / total;
    uint16_t* dst = out + (i0 + r) * out_stride + h * D;
    for (int c = 0; c < D; ++c) dst[c] = round_bf16(acc[r][c] * inv);
    if (lse) lse[h * tq + i0 + r] = m[r] + std::log(total);
  }
}
constexpr bool kHasAmx = true;
#else
constexpr int64_t kAmxRows = 16;
constexpr bool kHasAmx = false;
bool amx_ready() { return false; }
template <int D>
void attend_tile_amx(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                     int64_t, int64_t, float, int64_t, bool, float*, int64_t) {}
#endif

template <int D>
void run(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride, const uint16_t* v,
         int64_t v_stride, uint16_t* out,
         int64_t out_stride, int64_t tq, int64_t tk, int64_t num_heads, int64_t num_kv_heads, float scale,
         int64_t q_offset, bool causal, float* lse) {
  const int64_t blocks = (tk + kKeys - 1) / kKeys;
  const int64_t head = blocks * kKeys * D;    // both packed per KV head in whole blocks of keys
  static thread_local std::vector<uint16_t> kp, vp;
  kp.assign(num_kv_heads * head + kKeys * D, 0);     // + a zero block: AMX passes read two blocks
  vp.assign(num_kv_heads * head + kKeys * D, 0);
  pack_kv(k, k_stride, v, v_stride, tk, num_kv_heads, D, kp.data(), vp.data());
  const bool amx = kHasAmx && amx_ready();
  const int64_t tile_rows = amx ? kAmxRows : kRows;
  const int64_t group = num_heads / num_kv_heads, tiles = (tq + tile_rows - 1) / tile_rows;
  const uint16_t* kpd = kp.data();
  const uint16_t* vpd = vp.data();
  // Later tiles of a causal chunk see more keys: hand them out first, one at a time.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_heads * tiles; ++item) {
    const int64_t tile = tiles - 1 - item / num_heads, h = item % num_heads, g = h / group;
    const int64_t i0 = tile * tile_rows;
    (amx ? attend_tile_amx<D> : attend_tile<D>)(q, q_stride, kpd + g * head, vpd + g * head, out, out_stride, h, i0,
                                                std::min(tile_rows, tq - i0), tk, scale, q_offset, causal, lse, tq);
  }
}

// Whole prompts back to back (prompt p: rows starts[p] .. starts[p + 1] - 1 of q, k, v and out,
// each attending to its own keys only, from position 0): one pass packs every prompt's K/V,
// one parallel loop runs every (prompt, head, tile) item, longest prompts' last tiles first.
template <int D>
void run_batch(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride, const uint16_t* v,
               int64_t v_stride, uint16_t* out, int64_t out_stride, const int64_t* starts, int64_t batch,
               int64_t num_heads, int64_t num_kv_heads, float scale, bool causal, float* lse) {
  std::vector<int64_t> packed(batch + 1, 0);        // offset of each prompt's packed heads
  std::vector<int64_t> first_item(batch + 1, 0);
  const int64_t group = num_heads / num_kv_heads;
  const bool amx = kHasAmx && amx_ready();
  const int64_t tile_rows = amx ? kAmxRows : kRows;
  for (int64_t p = 0; p < batch; ++p) {
    const int64_t len = starts[p + 1] - starts[p];
    packed[p + 1] = packed[p] + num_kv_heads * ((len + kKeys - 1) / kKeys) * kKeys * D;
    first_item[p + 1] = first_item[p] + num_heads * ((len + tile_rows - 1) / tile_rows);
  }
  static thread_local std::vector<uint16_t> kp, vp;
  kp.assign(packed[batch] + kKeys * D, 0);          // + a zero block: AMX passes read two blocks
  vp.assign(packed[batch] + kKeys * D, 0);
  uint16_t* kpd = kp.data();
  uint16_t* vpd = vp.data();
  // Every prompt's (head, key block) in one parallel region: a wake-up of the threads per prompt
  // costs more than packing a short prompt.
  std::vector<int64_t> first_block(batch + 1, 0);
  for (int64_t p = 0; p < batch; ++p)
    first_block[p + 1] = first_block[p] + num_kv_heads * ((starts[p + 1] - starts[p] + kKeys - 1) / kKeys);
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < first_block[batch]; ++item) {
    const int64_t p = std::upper_bound(first_block.begin(), first_block.end(), item) - first_block.begin() - 1;
    const int64_t len = starts[p + 1] - starts[p], blocks = (len + kKeys - 1) / kKeys;
    const int64_t local = item - first_block[p];
    pack_kv_block(k + starts[p] * k_stride, k_stride, v + starts[p] * v_stride, v_stride, len, D, local / blocks,
                  local % blocks, kpd + packed[p], vpd + packed[p]);
  }
  const int64_t items = first_item[batch];
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < items; ++item) {
    // Items of one prompt are consecutive; within it, its last tiles first (they see more keys).
    const int64_t p = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t len = starts[p + 1] - starts[p], tiles = (len + tile_rows - 1) / tile_rows;
    const int64_t local = item - first_item[p];
    const int64_t tile = tiles - 1 - local / num_heads, h = local % num_heads, g = h / group;
    const int64_t head = ((len + kKeys - 1) / kKeys) * kKeys * D, i0 = tile * tile_rows;
    (amx ? attend_tile_amx<D> : attend_tile<D>)(
        q + starts[p] * q_stride, q_stride, kpd + packed[p] + g * head, vpd + packed[p] + g * head,
        out + starts[p] * out_stride, out_stride, h, i0, std::min(tile_rows, len - i0), len, scale, 0, causal,
        lse ? lse + starts[p] : nullptr, starts[batch]);
  }
}

}  // namespace
#endif

extern "C" {

// run_batch's prompts: starts [batch + 1] row offsets; lse [num_heads, starts[batch]] or null.
// Returns 0, or -1 for a head size it does not cover.
int64_t flash_prefill_batch_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                                 const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride,
                                 const int64_t* starts, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_size, float scale, int64_t causal, float* lse) {
#if defined(__AVX512BF16__)
  if (head_size == 64) {
    run_batch<64>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, batch, num_heads, num_kv_heads,
                  scale, causal != 0, lse);
    return 0;
  }
  if (head_size == 128) {
    run_batch<128>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, batch, num_heads, num_kv_heads,
                   scale, causal != 0, lse);
    return 0;
  }
#endif
  return -1;
}


// 1 when this build has the kernel (the CPU has AVX512-BF16), else 0.
// 0: not built for this CPU; 1: AVX512-BF16 dot products; 3: AMX tiles as well.
int64_t flash_prefill_available() {
#if defined(__AVX512BF16__)
  return amx_ready() ? 3 : 1;
#else
  return 0;
#endif
}

// Head sizes 64 and 128; returns 0 when done, -1 for a head size (or CPU) it does not cover.
int64_t flash_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                           const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride, int64_t tq, int64_t tk,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_size, float scale, int64_t q_offset,
                           int64_t causal, float* lse) {
#if defined(__AVX512BF16__)
  if (head_size == 64) {
    run<64>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, tq, tk, num_heads, num_kv_heads, scale, q_offset,
            causal != 0, lse);
    return 0;
  }
  if (head_size == 128) {
    run<128>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, tq, tk, num_heads, num_kv_heads, scale, q_offset,
             causal != 0, lse);
    return 0;
  }
#endif
  return -1;
}

}  // extern "C"
