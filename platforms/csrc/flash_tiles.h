// bf16 flash-attention tiles shared by flash_prefill.cpp (prompt chunks) and paged_decode.cpp
// (a cascade's shared prefix, prompt chunks over the cache): K/V re-laid out into the pair
// layouts AVX512-BF16 and AMX read, and a tile of queries attending over them: 8 on AVX512-BF16
// dot products (attend_tile), 16 on AMX tiles where the build and the CPU have them
// (attend_tile_amx; tile_kernel picks). Included after tokenmill_cpu.h, only where TM_AVX512_BF16;
// platforms/native_build.py hashes quoted includes into each library's build key.
#pragma once

#include "tokenmill_cpu.h"

#if !TM_AVX512_BF16
#error "flash_tiles.h needs AVX512-BF16: include it under #if TM_AVX512_BF16"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tokenmill_flash {

constexpr int64_t kKeys = 16;   // keys per block: one 512-bit register of float32 scores
// The running maximum before any score: finite, since -ffast-math assumes no infinities.
constexpr float kNone = -1e30f;

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

inline void pack_kv(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int64_t tk, int64_t num_kv_heads, int64_t d,
             uint16_t* kp, uint16_t* vp) {
  const int64_t blocks = (tk + kKeys - 1) / kKeys;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < num_kv_heads; ++g)
    for (int64_t b = 0; b < blocks; ++b)
      pack_kv_block(k, k_stride, v, v_stride, tk, d, g, b, kp, vp);
}

// How far a score may pass a row's lazy reference maximum (base 2) before the reference moves.
constexpr float kLazyLog2 = 8.0f;

// 2^t for t <= kLazyLog2 (below -120: 2^-120): 2^(n + f), f in [-1/2, 1/2], a degree-4
// polynomial for 2^f (relative error < 5e-5, far below P's bf16 rounding), scaled by 2^n.
inline __m512 exp2_bounded(__m512 t) {
  const __m512 x = _mm512_max_ps(t, _mm512_set1_ps(-120.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291076284772e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// e^x for x <= 0 (down to kNone: ~0).
inline __m512 exp_nonpositive(__m512 x) { return exp2_bounded(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f))); }

// Rows [0, rows) of a finished tile: acc * out_scale / (the sum of the row's lsum lanes) to out
// (float32, or bf16 rounded to nearest even), and each row's log-sum-exp, its reference maximum
// m counted in units of m_unit (1: natural log, ln 2: base 2).
template <int D, typename Out>
inline void store_rows(const float (*acc)[D], const float (*lsum)[kKeys], const float* m, float m_unit, int64_t rows,
                       Out* out, int64_t out_stride, int64_t h, int64_t i0, float* lse, int64_t tq,
                       float out_scale = 1.0f) {
  for (int64_t r = 0; r < rows; ++r) {
    const float total = _mm512_reduce_add_ps(_mm512_load_ps(lsum[r]));
    const float inv = out_scale / total;
    Out* dst = out + (i0 + r) * out_stride + h * D;
    for (int c = 0; c < D; ++c) {
      if constexpr (std::is_same<Out, float>::value)
        dst[c] = acc[r][c] * inv;
      else
        dst[c] = tokenmill_cpu::f32_to_bf16(acc[r][c] * inv);
    }
    if (lse) lse[h * tq + i0 + r] = m[r] * m_unit + std::log(total);
  }
}

// A tile of up to kRows queries on AVX512-BF16 dot products (any CPU this file builds for):
// flash attention with an online softmax, float32 scores and accumulators, P rounded to bf16 for
// P.V. A tile's keys may come from several packed K/V spans (a cascade's shared prefix, then a
// chunk's own positions): attend_keys folds each into the same running softmax, so nothing is
// merged afterwards.
constexpr int64_t kRows = 8;    // query rows per tile: 8 score accumulators + the K pair
template <int D>
struct Tile {
  alignas(64) float acc[kRows][D];
  alignas(64) float prob[kRows][2 * kKeys];
  alignas(64) float lsum[kRows][kKeys];   // each row's probability sums, 16 lanes (added up at the end)
  float m[kRows];                         // each row's reference maximum, base 2, a whole number
  const int32_t* qrow[kRows];             // bf16 query pairs
  int64_t rows;
  // q: row 0's D bf16 values (rows q_stride apart); rows past `rows` repeat the last and keep
  // probability 0 throughout.
  Tile(const uint16_t* q, int64_t q_stride, int64_t rows_) : rows(rows_) {
    for (int r = 0; r < kRows; ++r) {
      m[r] = kNone;
      for (int c = 0; c < D; ++c) acc[r][c] = 0.0f;
      for (int j = 0; j < 2 * kKeys; ++j) prob[r][j] = 0.0f;
      for (int j = 0; j < kKeys; ++j) lsum[r][j] = 0.0f;
      qrow[r] = reinterpret_cast<const int32_t*>(q + std::min<int64_t>(r, rows - 1) * q_stride);
    }
  }
};

// Keys [0, tk) of one KV head's packed K/V into the tile's softmax. Causal: row r sees keys
// <= row0_pos + r (row0_pos: row 0's position counted from this span's first key); else all.
// A sliding window (causal only; 0 = none): row r sees keys > row0_pos + r - window as well.
template <int D>
void attend_keys(Tile<D>& t, const uint16_t* kp, const uint16_t* vp, int64_t tk, float scale, bool causal,
                 int64_t row0_pos, int64_t window = 0) {
  constexpr int C = D / 16, P = D / 2;
  const int64_t rows = t.rows;
  const int64_t last = causal ? std::min(tk, row0_pos + rows) : tk;     // keys [0, last) can be seen
  const bool windowed = causal && window > 0;
  // Keys before row 0's window are seen by no row: passes start at its block.
  const int64_t first = windowed ? std::max<int64_t>(0, row0_pos - window + 1) : 0;
  // Scores in base 2 (t = s * scale * log2(e)) against a lazy reference maximum, as
  // attend_tile_amx64 keeps it: a row's reference moves (to the ceiling of its visible maximum,
  // rescaling its accumulators and sums by an exact power of two) only when a score passes it
  // by kLazyLog2, so probabilities stay <= 2^8 and a pass needs no horizontal max or sum.
  const __m512 vscale = _mm512_set1_ps(scale * 1.4426950408889634f);
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
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(t.qrow[r][p]);
        for (int n = 0; n < NB; ++n) s[r][n] = _mm512_dpbf16_ps(s[r][n], qp, kz[n]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t limit = causal ? std::min(tk, row0_pos + r + 1) : tk;   // keys < limit
      const int64_t lowest = windowed ? row0_pos + r - window + 1 : 0;         // keys >= lowest
      __mmask16 visible[NB];
      __m512 t2[NB];
      const __m512 bound = _mm512_set1_ps(t.m[r] + kLazyLog2);
      bool moves = false;
      for (int n = 0; n < NB; ++n) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>((b + n) * kKeys)));
        visible[n] = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(limit)));
        if (windowed)
          visible[n] &= _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(lowest)));
        t2[n] = _mm512_mul_ps(s[r][n], vscale);
        moves |= _mm512_mask_cmp_ps_mask(visible[n], t2[n], bound, _CMP_GT_OQ) != 0;
      }
      if (moves) {      // rare after a row's first keys; 2^(kNone - top) ~ 0 on the first pass
        float top = t.m[r];
        for (int n = 0; n < NB; ++n)
          if (visible[n]) top = std::max(top, _mm512_mask_reduce_max_ps(visible[n], t2[n]));
        top = std::ceil(top);
        const __m512 factor = exp2_bounded(_mm512_set1_ps(t.m[r] - top));
        for (int c = 0; c < C; ++c)
          _mm512_store_ps(t.acc[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(t.acc[r] + 16 * c), factor));
        _mm512_store_ps(t.lsum[r], _mm512_mul_ps(_mm512_load_ps(t.lsum[r]), factor));
        t.m[r] = top;
      }
      const __m512 ref = _mm512_set1_ps(t.m[r]);
      __m512 total = _mm512_load_ps(t.lsum[r]);
      for (int n = 0; n < NB; ++n) {
        const __m512 pr = _mm512_maskz_mov_ps(visible[n], exp2_bounded(_mm512_sub_ps(t2[n], ref)));
        total = _mm512_add_ps(total, pr);
        _mm512_store_ps(t.prob[r] + n * kKeys, pr);
      }
      _mm512_store_ps(t.lsum[r], total);
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
                             (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(t.prob[r0 + i] + n * kKeys)));
      __m512 o[4][C];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < C; ++c) o[i][c] = _mm512_load_ps(t.acc[r0 + i] + 16 * c);
      for (int64_t jp = 0; jp < pairs; ++jp) {
        __m512bh vv[C];
        for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vb + (jp * D + 16 * c) * 2);
        for (int i = 0; i < 4; ++i) {
          const __m512bh pj = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(pb[i])[jp]);
          for (int c = 0; c < C; ++c) o[i][c] = _mm512_dpbf16_ps(o[i][c], pj, vv[c]);
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < C; ++c) _mm512_store_ps(t.acc[r0 + i] + 16 * c, o[i][c]);
    }
  };
  int64_t b = first / kKeys;
  for (; (b + 1) * kKeys < last; b += 2) pass(std::integral_constant<int, 2>(), b);
  if (b * kKeys < last) pass(std::integral_constant<int, 1>(), b);
}

// A tile of up to kRows queries of head h (rows i0 .. i0 + rows - 1, at positions q_offset + i)
// over one prompt's packed K/V of its KV head. Out: bf16 (rounded to nearest even) or float32.
// A sliding window (causal only; 0 = none): the row at position p sees keys (p - window, p].
template <int D, typename Out = uint16_t>
void attend_tile(const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp, Out* out,
                 int64_t out_stride, int64_t h, int64_t i0, int64_t rows, int64_t tk, float scale, int64_t q_offset,
                 bool causal, float* lse, int64_t tq, int64_t window) {
  Tile<D> t(q + i0 * q_stride + h * D, q_stride, rows);
  attend_keys<D>(t, kp, vp, tk, scale, causal, q_offset + i0, window);
  store_rows<D, Out>(t.acc, t.lsum, t.m, 0.6931471805599453f, rows, out, out_stride, h, i0, lse, tq);
}

constexpr int64_t kAmxRows = 16;   // query rows per AMX tile

// A sliding window over a tile of `rows` queries, row 0 at position row0_pos (causal; 0 = none):
// row r sees keys >= lowest(r); no row sees the key blocks before first_block, and every row
// sees the keys from seen_by_all_from on (up to its causal limit).
struct WindowSpan {
  int64_t row0_pos, window, first_block, seen_by_all_from;
  WindowSpan(bool causal, int64_t window_, int64_t row0_pos_, int64_t rows) {
    row0_pos = row0_pos_;
    window = causal && window_ > 0 ? window_ : 0;
    first_block = window ? std::max<int64_t>(0, row0_pos_ - window + 1) / kKeys : 0;
    seen_by_all_from = window ? row0_pos_ + rows - window : 0;
  }
  int64_t lowest(int64_t r) const { return window ? row0_pos + r - window + 1 : 0; }
};

#if TM_AMX_BF16
// AMX tiles (Sapphire Rapids and later): 16 queries a tile, two key blocks (32 keys) a pass.
// S = Q.K^T as two 16 x 16 float32 tiles (the packed K block's D/2 pairs x 16 keys x 2 is the
// tile's B layout already), the online softmax on vectors (exp by exp2 polynomial: glibc's vector
// expf and torch's Sleef exp were half of torch's flash time), P rounded to bf16 as one 16 x 32
// A tile, P.V into fresh tiles (V's key pairs x D x 2 is B's layout), added to the float32
// accumulators after their rescale. torch's own flash runs on AMX too, its Sleef exp half its
// time (`tokenmill bench attention` compares them).

// attend_tile_amx for D = 64, with P.V accumulated in four resident tiles (4-7: 16 rows x 64
// dims of float32) instead of stored, rescaled and added on vectors every pass, and a lazy
// running maximum (FlashAttention-3's trick): a row's reference maximum moves only when a score
// exceeds it by kLazyLog2 in base 2 (the probabilities then reach at most 2^8 = 256, well inside
// float32 sums and bf16's range), so the rescale — tiles stored, rows scaled, tiles reloaded — is
// rare, and no pass needs a horizontal max. Scores stay in base 2: t = s * scale * log2(e).
// (D = 128 would need all eight tiles as accumulators: it stays on attend_tile_amx's loop.)

// The query tile as AMX loads it: in place when all 16 rows are real, else copied into `pad`
// with zero rows. Returns its first byte; *stride_bytes its row stride.
template <int D>
inline const uint8_t* query_tile(const uint16_t* q, int64_t q_stride, int64_t h, int64_t i0, int64_t rows,
                                 uint16_t (*pad)[D], int64_t* stride_bytes) {
  if (rows == kAmxRows) {
    *stride_bytes = q_stride * 2;
    return reinterpret_cast<const uint8_t*>(q + i0 * q_stride + h * D);
  }
  for (int r = 0; r < kAmxRows; ++r)
    for (int c = 0; c < D; ++c) pad[r][c] = r < rows ? q[(i0 + r) * q_stride + h * D + c] : 0;
  *stride_bytes = D * 2;
  return reinterpret_cast<const uint8_t*>(&pad[0][0]);
}

// S = Q.K^T of a pass, key blocks b and b + 1 (packed K), into out[block][row][key]; tiles 0-3.
template <int D>
inline void score_pass(const uint8_t* qbase, int64_t qstride, const uint8_t* kb8, int64_t b,
                       float (*out)[kAmxRows][kKeys]) {
  _tile_zero(0);
  _tile_zero(1);
  for (int c = 0; c < D / 32; ++c) {
    _tile_loadd(2, qbase + c * 64, qstride);
    _tile_loadd(3, kb8 + (b * kKeys * D + c * 512) * 2, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(3, kb8 + ((b + 1) * kKeys * D + c * 512) * 2, 64);
    _tile_dpbf16ps(1, 2, 3);
  }
  _tile_stored(0, &out[0][0][0], 64);
  _tile_stored(1, &out[1][0][0], 64);
}

template <typename Out>
void attend_tile_amx64(const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp, Out* out,
                       int64_t out_stride, int64_t h, int64_t i0, int64_t rows, int64_t tk, float scale,
                       int64_t q_offset, bool causal, float* lse, int64_t tq, int64_t window) {
  constexpr int D = 64;
  tokenmill_cpu::configure_tiles();
  alignas(64) float acc[kAmxRows][D];
  alignas(64) float s[2][2][kAmxRows][kKeys];     // [buffer][key block][row][key]
  alignas(64) uint16_t prob[kAmxRows][2 * kKeys];
  alignas(64) uint16_t qpad[kAmxRows][D];
  alignas(64) float lsum[kAmxRows][16];           // row sums 16 lanes wide until the end
  alignas(64) float esum[kAmxRows][16];           // the same of P unrounded, for the lse
  float m[kAmxRows], rescale[kAmxRows];           // reference maxima (base 2), their pending rescale
  for (int r = 0; r < kAmxRows; ++r) {
    m[r] = kNone;
    _mm512_store_ps(lsum[r], _mm512_setzero_ps());
    _mm512_store_ps(esum[r], _mm512_setzero_ps());
  }
  int64_t qstride;
  const uint8_t* qbase = query_tile<D>(q, q_stride, h, i0, rows, qpad, &qstride);
  const uint8_t* kb8 = reinterpret_cast<const uint8_t*>(kp);
  const uint8_t* vb8 = reinterpret_cast<const uint8_t*>(vp);
  const int64_t last = causal ? std::min(tk, q_offset + i0 + rows) : tk;
  // Keys every real row sees: before the first row's causal limit, and before tk; with a window,
  // from the last row's window start on. Passes start at row 0's window's block.
  const int64_t seen_by_all = causal ? std::min(tk, q_offset + i0 + 1) : tk;
  const WindowSpan span(causal, window, q_offset + i0, rows);
  const __m512 log2_scale = _mm512_set1_ps(scale * 1.4426950408889634f);
  const __m512 none = _mm512_set1_ps(kNone), lazy = _mm512_set1_ps(kLazyLog2);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);     // bf16 1.0
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  auto scores = [&](int64_t b, int buf) { score_pass<D>(qbase, qstride, kb8, b, s[buf]); };
  auto store_acc = [&] {     // the resident accumulators (tiles 4-7) into acc
    _tile_stored(4, &acc[0][0], D * 4);
    _tile_stored(5, &acc[0][16], D * 4);
    _tile_stored(6, &acc[0][32], D * 4);
    _tile_stored(7, &acc[0][48], D * 4);
  };
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  scores(span.first_block, 0);
  int buf = 0;
  for (int64_t b = span.first_block; b * kKeys < last; b += 2, buf ^= 1) {
    const bool whole = rows == kAmxRows && (b + 2) * kKeys <= seen_by_all && b * kKeys >= span.seen_by_all_from;
    const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(b * kKeys)));
    const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(static_cast<int32_t>(kKeys)));
    bool moved = false;
    // One row of the pass: t = s * scale * log2(e) - reference in one FMA; the reference moves
    // (rarely) when a visible score passes it by kLazyLog2. `masked`: some keys of the pass are
    // hidden from some row (the causal diagonal, the prompt's end, padding rows).
    auto row = [&](int r, __mmask16 vis0, __mmask16 vis1, auto masked) {
      const __m512 s0 = _mm512_load_ps(s[buf][0][r]), s1 = _mm512_load_ps(s[buf][1][r]);
      __m512 ref = _mm512_set1_ps(m[r]);
      __m512 t0 = _mm512_fmsub_ps(s0, log2_scale, ref), t1 = _mm512_fmsub_ps(s1, log2_scale, ref);
      rescale[r] = 1.0f;
      if (_mm512_mask_cmp_ps_mask(vis0, t0, lazy, _CMP_GT_OQ) | _mm512_mask_cmp_ps_mask(vis1, t1, lazy, _CMP_GT_OQ)) {
        const __m512 raw0 = _mm512_mask_mul_ps(none, vis0, s0, log2_scale);
        const __m512 raw1 = _mm512_mask_mul_ps(none, vis1, s1, log2_scale);
        // A whole number: rescales are then exact powers of two, and P's bf16 rounding does not
        // depend on when they happen (a prompt's keys in one call or split by lse round alike).
        const float top = std::ceil(_mm512_reduce_max_ps(_mm512_max_ps(raw0, raw1)));   // > m[r] + kLazyLog2
        const __m512 factor = exp2_bounded(_mm512_set1_ps(m[r] - top));
        rescale[r] = _mm512_cvtss_f32(factor);
        _mm512_store_ps(lsum[r], _mm512_mul_ps(_mm512_load_ps(lsum[r]), factor));
        _mm512_store_ps(esum[r], _mm512_mul_ps(_mm512_load_ps(esum[r]), factor));
        m[r] = top;
        moved = true;
        ref = _mm512_set1_ps(top);
        t0 = _mm512_fmsub_ps(s0, log2_scale, ref);
        t1 = _mm512_fmsub_ps(s1, log2_scale, ref);
      }
      __m512 p0 = exp2_bounded(t0), p1 = exp2_bounded(t1);
      if constexpr (decltype(masked)::value) {    // hidden keys' t is meaningless: their P is 0
        p0 = _mm512_maskz_mov_ps(vis0, p0);
        p1 = _mm512_maskz_mov_ps(vis1, p1);
      }
      // The row sum adds P as rounded for P.V (a dot product with bf16 ones sums the rounded
      // pairs exactly): with a reference that is not the row's maximum the dominant key's
      // probability is rounded too, and normalizing by the same rounded weights keeps its error
      // out of the output (relative error 2.2e-3 -> 1.8e-3 on SmolLM2's prompt attention,
      // torch's flash kernel 1.8e-3).
      const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);
      _mm512_store_ps(lsum[r], _mm512_dpbf16_ps(_mm512_load_ps(lsum[r]), pb, ones));
      // The lse weighs this part against others in a merge: the mass of the exact probabilities.
      if (lse) _mm512_store_ps(esum[r], _mm512_add_ps(_mm512_load_ps(esum[r]), _mm512_add_ps(p0, p1)));
      _mm512_store_si512(prob[r], (__m512i)pb);
    };
    if (whole) {
      for (int r = 0; r < kAmxRows; ++r) row(r, 0xFFFF, 0xFFFF, std::false_type());
    } else {
      for (int r = 0; r < kAmxRows; ++r) {    // padding rows see no key: P 0, reference never moved
        const int64_t limit = r >= rows ? 0 : causal ? std::min(tk, q_offset + i0 + r + 1) : tk;
        const __m512i lim = _mm512_set1_epi32(static_cast<int32_t>(limit));
        const __m512i low = _mm512_set1_epi32(static_cast<int32_t>(span.lowest(r)));
        row(r, _mm512_cmplt_epi32_mask(key0, lim) & _mm512_cmpge_epi32_mask(key0, low),
            _mm512_cmplt_epi32_mask(key1, lim) & _mm512_cmpge_epi32_mask(key1, low), std::true_type());
      }
    }
    // The next pass's scores while P's stores reach L1 (a tile load waits for them).
    if ((b + 2) * kKeys < last) scores(b + 2, buf ^ 1);
    if (moved) {      // bring the accumulated rows to their new reference before adding this pass
      store_acc();
      for (int r = 0; r < kAmxRows; ++r) {
        const __m512 rs = _mm512_set1_ps(rescale[r]);
        for (int c = 0; c < D; c += 16) _mm512_store_ps(acc[r] + c, _mm512_mul_ps(_mm512_load_ps(acc[r] + c), rs));
      }
      _tile_loadd(4, &acc[0][0], D * 4);
      _tile_loadd(5, &acc[0][16], D * 4);
      _tile_loadd(6, &acc[0][32], D * 4);
      _tile_loadd(7, &acc[0][48], D * 4);
    }
    // P.V for the 32 keys (16 key pairs from pair 8b) into the resident tiles.
    _tile_loadd(0, &prob[0][0], 64);
    const uint8_t* vpass = vb8 + b * (kKeys / 2) * 2 * D * 2;
    _tile_loadd(1, vpass + 0 * 4, D * 4);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, vpass + 16 * 4, D * 4);
    _tile_dpbf16ps(5, 0, 2);
    _tile_loadd(3, vpass + 32 * 4, D * 4);
    _tile_dpbf16ps(6, 0, 3);
    _tile_loadd(1, vpass + 48 * 4, D * 4);
    _tile_dpbf16ps(7, 0, 1);
  }
  store_acc();
  for (int64_t r = 0; r < rows; ++r) {
    const float total = _mm512_reduce_add_ps(_mm512_load_ps(lsum[r]));
    const __m512 inv = _mm512_set1_ps(1.0f / total);
    Out* dst = out + (i0 + r) * out_stride + h * D;
    for (int c = 0; c < D; c += 16) {
      const __m512 o = _mm512_mul_ps(_mm512_load_ps(acc[r] + c), inv);
      if constexpr (std::is_same<Out, float>::value)
        _mm512_storeu_ps(dst + c, o);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(o));
    }
    if (lse) {
      const float mass = _mm512_reduce_add_ps(_mm512_load_ps(esum[r]));
      lse[h * tq + i0 + r] = (m[r] + std::log2(mass)) * 0.6931471805599453f;
    }
  }
}

// attend_tile's contract for up to 16 rows. kp/vp must be readable one key block past the
// head's last (the caller pads the buffers): a pass always loads two blocks, masking the second.
template <int D, typename Out = uint16_t>
void attend_tile_amx(const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp, Out* out,
                     int64_t out_stride, int64_t h, int64_t i0, int64_t rows, int64_t tk, float scale,
                     int64_t q_offset, bool causal, float* lse, int64_t tq, int64_t window) {
  static_assert(D % 64 == 0, "head size in whole 64-wide tile groups");
  if constexpr (D == 64) {
    attend_tile_amx64<Out>(q, q_stride, kp, vp, out, out_stride, h, i0, rows, tk, scale, q_offset, causal, lse, tq,
                           window);
    return;
  }
  tokenmill_cpu::configure_tiles();
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
  int64_t qstride;
  const uint8_t* qbase = query_tile<D>(q, q_stride, h, i0, rows, qpad, &qstride);
  const uint8_t* kb8 = reinterpret_cast<const uint8_t*>(kp);
  const uint8_t* vb8 = reinterpret_cast<const uint8_t*>(vp);
  const int64_t last = causal ? std::min(tk, q_offset + i0 + rows) : tk;
  const WindowSpan span(causal, window, q_offset + i0, rows);
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  auto scores = [&](int64_t b, int buf) { score_pass<D>(qbase, qstride, kb8, b, s[buf]); };
  // Row sums stay 16 lanes wide until the end (no horizontal add per pass).
  alignas(64) float lsum[kAmxRows][16];
  for (int r = 0; r < kAmxRows; ++r) _mm512_store_ps(lsum[r], _mm512_setzero_ps());
  scores(span.first_block, 0);
  int buf = 0;
  for (int64_t b = span.first_block; b * kKeys < last; b += 2, buf ^= 1) {
    const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(b * kKeys)));
    const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(static_cast<int32_t>(kKeys)));
    for (int r = 0; r < kAmxRows; ++r) {
      // Padding rows see no key (their probabilities stay 0; nothing of them is stored).
      const int64_t limit = r >= rows ? 0 : causal ? std::min(tk, q_offset + i0 + r + 1) : tk;
      const __m512i lim = _mm512_set1_epi32(static_cast<int32_t>(limit));
      const __m512i low = _mm512_set1_epi32(static_cast<int32_t>(span.lowest(r)));
      const __mmask16 vis0 = _mm512_cmplt_epi32_mask(key0, lim) & _mm512_cmpge_epi32_mask(key0, low);
      const __mmask16 vis1 = _mm512_cmplt_epi32_mask(key1, lim) & _mm512_cmpge_epi32_mask(key1, low);
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
  store_rows<D, Out>(acc, lsum, m, 1.0f, rows, out, out_stride, h, i0, lse, tq);
}
#endif  // TM_AMX_BF16

// The tile a host runs (amx: tokenmill_cpu::amx_usable(), asked once per call): attend_tile_amx
// (kAmxRows queries) where the build has AMX and amx is true, else attend_tile (kRows).
template <int D, typename Out = uint16_t>
inline auto tile_kernel(bool amx) -> decltype(&attend_tile<D, Out>) {
#if TM_AMX_BF16
  return amx ? attend_tile_amx<D, Out> : attend_tile<D, Out>;
#else
  (void)amx;
  return attend_tile<D, Out>;
#endif
}


}  // namespace tokenmill_flash
