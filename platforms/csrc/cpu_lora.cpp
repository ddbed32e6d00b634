// The cpu platform's batched multi-LoRA op (platforms/cpu_lora.py): shrink + expand for every
// adapter group of a step in one call, instead of a gather, two bmm and an index_add per adapted
// linear (core/lora/punica.py's torch op), whose per-op overhead is most of its time here.
//
// Plain C++ with OpenMP and AVX-512 intrinsics (TM_AVX512BW; the same tiles as plain loops
// without), no torch headers; built by platforms/native_build.py and called through ctypes.
// libgomp.so.1 resolves to the runtime torch has loaded, so torch.set_num_threads governs these
// threads too.
#include "tokenmill_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

extern "C" int tokenmill_kernels_abi_version() { return 1; }

// y[row] += (x[row] A[slot]) B[slot] for every adapted row.
// The rows come grouped by adapter slot (core/lora/punica.py's LoRAMapping): token_indices lists
// the adapted rows, group g's at [group_starts[g], group_starts[g] + group_lens[g]), on slot
// slots[g]. A = lora_a[slot] is [k_in, width], B = lora_b[slot] is [width, n_out] (A^T and B^T of
// the adapter, row-major). A fused layer (qkv, gate_up) stacks num_shards shards: shard i's
// output columns (shard_sizes[i] wide) depend only on rank rows [i * R, (i + 1) * R) of B
// (R = width / num_shards; B is block-diagonal), so the expand skips the zero blocks.
// Two phases in one parallel region: shrink s = x A (float32, all rows of a group together so
// A stays in cache), then expand y += s B, split over (row tile, column chunk) units. Base rows
// are never touched.
namespace {

using bf16_t = uint16_t;

inline float scalar_f(float v) { return v; }
inline float scalar_f(bf16_t v) { return tokenmill_cpu::bf16_to_f32(v); }
inline void scalar_store(float* p, float v) { *p = v; }
inline void scalar_store(bf16_t* p, float v) { *p = tokenmill_cpu::f32_to_bf16_keep_nan(v); }

// Shrink tiles: up to 3 vectors of rank columns (a q/k/v layer's 3 x 16) by as many rows as
// keep ~16-24 accumulators, so that one pass reads whole lines of A (row-major, width wide)
// in order; kShrinkMaxRows is the most rows a tile takes (rank 16: one decode group in one pass).
constexpr int kShrinkVectors = 3;
constexpr int kShrinkMaxRows = 16;
inline int shrink_rows(int vectors) { return vectors == 1 ? 16 : vectors == 2 ? 12 : 8; }
constexpr int kExpandRows = 6;     // row tile x 4 vectors of B: 24 accumulators
constexpr int kExpandVectors = 4;

#if TM_AVX512BW
inline __m512 vload(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 vload(const bf16_t* p, __mmask16 m) { return tokenmill_cpu::bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p)); }
inline void vstore(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void vstore(bf16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, tokenmill_cpu::f32x16_to_bf16(v));
}

// acc[m][v] = sum_k rows[m][k] * w[k * ld + 16 v + lane], k < depth; the last vector masked by tail.
template <int MR, int NV, typename TI, typename TW>
inline void tile_product(const TI* const* rows, int64_t depth, const TW* w, int64_t ld, __mmask16 tail,
                         __m512 (&acc)[MR][NV]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    // The weights stream from memory once per call (each adapter is read by its group only):
    // fetch a few rows ahead, which the hardware prefetchers do not do for the strided rows.
    for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(w + (k + 8) * ld + 16 * v), _MM_HINT_T0);
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = vload(w + k * ld + 16 * v, v == NV - 1 ? tail : __mmask16(0xffff));
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(scalar_f(rows[m][k]));
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(xb, wv[v], acc[m][v]);
    }
  }
}

// s rows [nrows, cols] (row stride s_ld) = x rows [nrows, depth] A[:, 0:cols] (row stride a_ld).
template <int MR, int NV, typename T>
void shrink_tile(const T* const* xrows, int nrows, const T* a, int64_t depth, int64_t a_ld, int64_t cols,
                 float* s, int64_t s_ld) {
  __m512 acc[MR][NV];
  const int last = static_cast<int>(cols - 16 * (NV - 1));
  const __mmask16 tail = static_cast<__mmask16>((1u << last) - 1);
  tile_product<MR, NV>(xrows, depth, a, a_ld, tail, acc);
  for (int m = 0; m < nrows; ++m)
    for (int v = 0; v < NV; ++v) vstore(s + m * s_ld + 16 * v, acc[m][v], v == NV - 1 ? tail : __mmask16(0xffff));
}

// y rows[:, 0:cols] += s rows [nrows, depth] B[0:depth, 0:cols] (row stride b_ld).
template <int NV, typename T>
void expand_tile(const float* const* srows, int nrows, const T* b, int64_t depth, int64_t b_ld, int64_t cols,
                 T* const* yrows) {
  __m512 acc[kExpandRows][NV];
  const int last = static_cast<int>(cols - 16 * (NV - 1));
  const __mmask16 tail = static_cast<__mmask16>((1u << last) - 1);
  tile_product<kExpandRows, NV>(srows, depth, b, b_ld, tail, acc);
  for (int m = 0; m < nrows; ++m)
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : __mmask16(0xffff);
      vstore(yrows[m] + 16 * v, _mm512_add_ps(vload(yrows[m] + 16 * v, mask), acc[m][v]), mask);
    }
}

// tile_rows: shrink_rows() of the call's widest chunk; a narrower last chunk keeps the tiling.
template <typename T>
void shrink(const T* const* xrows, int tile_rows, int nrows, const T* a, int64_t depth, int64_t a_ld, int64_t cols,
            float* s, int64_t s_ld) {
  const int vectors = static_cast<int>((cols + 15) / 16);
  if (tile_rows == 16) {
    shrink_tile<16, 1>(xrows, nrows, a, depth, a_ld, cols, s, s_ld);
  } else if (tile_rows == 12) {
    if (vectors == 1) shrink_tile<12, 1>(xrows, nrows, a, depth, a_ld, cols, s, s_ld);
    else shrink_tile<12, 2>(xrows, nrows, a, depth, a_ld, cols, s, s_ld);
  } else {
    if (vectors == 1) shrink_tile<8, 1>(xrows, nrows, a, depth, a_ld, cols, s, s_ld);
    else if (vectors == 2) shrink_tile<8, 2>(xrows, nrows, a, depth, a_ld, cols, s, s_ld);
    else shrink_tile<8, 3>(xrows, nrows, a, depth, a_ld, cols, s, s_ld);
  }
}

template <typename T>
void expand(const float* const* srows, int nrows, const T* b, int64_t depth, int64_t b_ld, int64_t cols,
            T* const* yrows) {
  switch ((cols + 15) / 16) {
    case 1: expand_tile<1>(srows, nrows, b, depth, b_ld, cols, yrows); break;
    case 2: expand_tile<2>(srows, nrows, b, depth, b_ld, cols, yrows); break;
    case 3: expand_tile<3>(srows, nrows, b, depth, b_ld, cols, yrows); break;
    default: expand_tile<4>(srows, nrows, b, depth, b_ld, cols, yrows); break;
  }
}
#else   // portable fallback: the same tiles as plain loops
template <typename T>
void shrink(const T* const* xrows, int /*tile_rows*/, int nrows, const T* a, int64_t depth, int64_t a_ld,
            int64_t cols, float* s, int64_t s_ld) {
  for (int m = 0; m < nrows; ++m)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < depth; ++k) acc += scalar_f(xrows[m][k]) * scalar_f(a[k * a_ld + c]);
      s[m * s_ld + c] = acc;
    }
}

template <typename T>
void expand(const float* const* srows, int nrows, const T* b, int64_t depth, int64_t b_ld, int64_t cols,
            T* const* yrows) {
  for (int m = 0; m < nrows; ++m)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t r = 0; r < depth; ++r) acc += srows[m][r] * scalar_f(b[r * b_ld + c]);
      scalar_store(yrows[m] + c, scalar_f(yrows[m][c]) + acc);
    }
}
#endif

struct RowTile {
  int64_t group, first, count;   // rows [first, first + count) of token_indices, all of one group
};

struct ColumnChunk {
  int64_t shard, col, cols;      // output columns [col, col + cols) inside shard `shard`
};

inline void split_range(int64_t total, int64_t* lo, int64_t* hi) {
  const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
  *lo = total * tid / threads;
  *hi = total * (tid + 1) / threads;
}

template <typename T>
void lora_add_impl(T* y, int64_t y_ld, const T* x, int64_t x_ld, const T* lora_a, const T* lora_b,
                   const int64_t* token_indices, const int32_t* group_starts, const int32_t* group_lens,
                   const int64_t* slots, int64_t num_groups, int64_t k_in, int64_t width, int64_t n_out,
                   const int64_t* shard_sizes, int64_t num_shards) {
  const int64_t rank = width / num_shards;       // rank rows per shard (all of B when dense)
  std::vector<RowTile> shrink_tiles, expand_tiles;
  int64_t adapted = 0;
  const int64_t shrink_cols = 16 * kShrinkVectors;
  const int tile_rows = shrink_rows(static_cast<int>(std::min<int64_t>(kShrinkVectors, (width + 15) / 16)));
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t start = group_starts[g], len = group_lens[g];
    for (int64_t r = 0; r < len; r += tile_rows)
      shrink_tiles.push_back({g, start + r, std::min<int64_t>(tile_rows, len - r)});
    for (int64_t r = 0; r < len; r += kExpandRows)
      expand_tiles.push_back({g, start + r, std::min<int64_t>(kExpandRows, len - r)});
    adapted = std::max<int64_t>(adapted, start + len);
  }
  std::vector<ColumnChunk> chunks;
  for (int64_t i = 0, col = 0; i < num_shards; col += shard_sizes[i], ++i)
    for (int64_t c = 0; c < shard_sizes[i]; c += 16 * kExpandVectors)
      chunks.push_back({i, col + c, std::min<int64_t>(16 * kExpandVectors, shard_sizes[i] - c)});
  const int64_t shrink_chunks = (width + shrink_cols - 1) / shrink_cols;
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  std::vector<float> shrunk(static_cast<size_t>(adapted * width));
  float* s = shrunk.data();
  // Threads only when the work pays for waking them (~2 us a fork/join; this is multiply-adds).
  const int64_t work = adapted * (k_in * width + rank * n_out);
#pragma omp parallel if (work >= (1 << 17))
  {
    int64_t lo, hi;
    split_range(static_cast<int64_t>(shrink_tiles.size()) * shrink_chunks, &lo, &hi);
    for (int64_t u = lo; u < hi; ++u) {
      const RowTile& t = shrink_tiles[u / shrink_chunks];
      const int64_t c0 = (u % shrink_chunks) * shrink_cols;
      const T* xrows[kShrinkMaxRows];
      for (int m = 0; m < tile_rows; ++m)      // a short tile repeats its first row (results unused)
        xrows[m] = x + token_indices[t.first + (m < t.count ? m : 0)] * x_ld;
      shrink(xrows, tile_rows, static_cast<int>(t.count), lora_a + slots[t.group] * k_in * width + c0, k_in, width,
             std::min(shrink_cols, width - c0), s + t.first * width + c0, width);
    }
#pragma omp barrier
    // Expand units ordered (row tile, column chunk), a group's tiles together: a tile's rows of y
    // are read and written once, while its adapter's B (the nonzero blocks) stays in L2.
    split_range(static_cast<int64_t>(expand_tiles.size()) * num_chunks, &lo, &hi);
    for (int64_t u = lo; u < hi; ++u) {
      const RowTile& t = expand_tiles[u / num_chunks];
      const ColumnChunk& c = chunks[u % num_chunks];
      const int64_t g = t.group;
      const int64_t r0 = num_shards == 1 ? 0 : c.shard * rank;
      const float* srows[kExpandRows];
      T* yrows[kExpandRows];
      for (int m = 0; m < kExpandRows; ++m) {
        const int64_t i = t.first + (m < t.count ? m : 0);
        srows[m] = s + i * width + r0;
        yrows[m] = y + token_indices[i] * y_ld + c.col;
      }
      expand(srows, static_cast<int>(t.count), lora_b + slots[g] * width * n_out + r0 * n_out + c.col, rank,
             n_out, c.cols, yrows);
    }
  }
}

}  // namespace

extern "C" {

// The batched LoRA op above; is_bf16: x, y, lora_a and lora_b are all bfloat16 (else all float32).
// x and y rows have strides x_ld, y_ld (elements); lora_a [slots, k_in, width] and lora_b
// [slots, width, n_out] are contiguous. shard_sizes: num_shards output widths summing to n_out.
void lora_add(void* y, int64_t y_ld, const void* x, int64_t x_ld, const void* lora_a, const void* lora_b,
              int64_t is_bf16, const int64_t* token_indices, const int32_t* group_starts, const int32_t* group_lens,
              const int64_t* slots, int64_t num_groups, int64_t k_in, int64_t width, int64_t n_out,
              const int64_t* shard_sizes, int64_t num_shards) {
  if (is_bf16)
    lora_add_impl(static_cast<bf16_t*>(y), y_ld, static_cast<const bf16_t*>(x), x_ld,
                  static_cast<const bf16_t*>(lora_a), static_cast<const bf16_t*>(lora_b), token_indices, group_starts,
                  group_lens, slots, num_groups, k_in, width, n_out, shard_sizes, num_shards);
  else
    lora_add_impl(static_cast<float*>(y), y_ld, static_cast<const float*>(x), x_ld,
                  static_cast<const float*>(lora_a), static_cast<const float*>(lora_b), token_indices, group_starts,
                  group_lens, slots, num_groups, k_in, width, n_out, shard_sizes, num_shards);
}

}  // extern "C"
