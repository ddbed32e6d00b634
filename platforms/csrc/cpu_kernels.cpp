// Native CPU kernels of the cpu platform:
//  * paged decode attention: one query token per sequence, K/V read in place from the block
//    pool (no gather copy), grouped-query heads sharing each K/V row they read;
//  * the small per-layer ops of a decode step (residual add + RMSNorm, rotary embedding,
//    SiLU-and-multiply), each one call instead of 3-8 torch ops, whose dispatch overhead is what
//    a one-token step spends its time on after the matmuls;
//  * the two ends of an int8 x int8 GEMM with per-token activation scales (quantize the rows,
//    taking out the outlier channels; dequantize the int32 result), each one pass over memory
//    instead of the ~12 small torch ops they replace.
//
// Plain C++ with OpenMP, no torch headers: it compiles in about a second and is called through
// ctypes (attention_backends/cpu_kernels.py). libgomp.so.1 resolves to the runtime torch has
// already loaded, so torch.set_num_threads governs these threads too.
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

}  // namespace

extern "C" {

int tokenmill_kernels_abi_version() { return 4; }

// out = rmsnorm(x (+ residual)) * weight; with residual non-null, residual_out = x + residual.
// Rows are contiguous; threads only for batches big enough to pay for waking them.
void rms_norm_f32(const float* x, const float* residual, const float* weight, float eps, float* out,
                  float* residual_out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* orow = out + r * cols;
    const float* src = xr;
    if (residual) {
      float* rr = residual_out + r * cols;
      const float* res = residual + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) rr[c] = xr[c] + res[c];
      src = rr;
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < cols; ++c) ss += src[c] * src[c];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) orow[c] = src[c] * inv * weight[c];
  }
}

// Rotary embedding, HF "rotate half" layout: for each token t and head h of x (row stride
// x_row_stride, heads contiguous inside a row), out[t, h] = (x1 cos - x2 sin, x2 cos + x1 sin)
// with cos | sin = cos_sin[positions[t]] (each head_size / 2 wide). out is contiguous.
void rope_f32(const float* x, int64_t x_row_stride, const float* cos_sin, const int64_t* positions,
              float* out, int64_t tokens, int64_t heads, int64_t head_size) {
  const int64_t half = head_size / 2;
#pragma omp parallel for schedule(static) if (tokens >= 16)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cs = cos_sin + positions[t] * head_size;
    const float* sn = cs + half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xh = x + t * x_row_stride + h * head_size;
      float* oh = out + (t * heads + h) * head_size;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        oh[i] = xh[i] * cs[i] - xh[half + i] * sn[i];
        oh[half + i] = xh[half + i] * cs[i] + xh[i] * sn[i];
      }
    }
  }
}

// out [rows, inter] = silu(x[:, :inter]) * x[:, inter:2 * inter], x rows contiguous (2 * inter).
void silu_mul_f32(const float* x, float* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * 2 * inter;
    const float* up = gate + inter;
    float* orow = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) orow[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

// x [M, K] float32 -> q [M, K] int8 (outlier channels set to 0), token_scale [M],
// outliers [num_outliers] int64 (the channels with the largest |x| over all rows, descending),
// x_outliers [M, num_outliers] float32 (those channels' values, for a float32 matmul).
void quantize_rows_int8(const float* x, int64_t rows, int64_t cols, int64_t num_outliers, int8_t* q,
                        float* token_scale, int64_t* outliers, float* x_outliers) {
  std::vector<float> col_max(cols, 0.0f);
  if (num_outliers > 0) {
    float* __restrict cm = col_max.data();
    for (int64_t r = 0; r < rows; ++r) {
      const float* __restrict xr = x + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) cm[c] = std::max(cm[c], std::fabs(xr[c]));
    }
  }
  std::vector<float> keep(cols, 1.0f);   // 0 for outlier channels: branch-free, so it vectorizes
  if (num_outliers > 0) {
    std::vector<int64_t> order(cols);
    for (int64_t c = 0; c < cols; ++c) order[c] = c;
    const int64_t k = std::min(num_outliers, cols);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return col_max[a] > col_max[b] || (col_max[a] == col_max[b] && a < b);
    });
    for (int64_t i = 0; i < k; ++i) {
      outliers[i] = order[i];
      keep[order[i]] = 0.0f;
    }
  }
  const float* kp = keep.data();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict xr = x + r * cols;
    float mx = 0.0f;
#pragma omp simd reduction(max : mx)
    for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, std::fabs(xr[c]) * kp[c]);
    const float scale = mx > 0.0f ? mx / 127.0f : 1.0f;
    const float inv = 1.0f / scale;
    token_scale[r] = scale;
    int8_t* __restrict qr = q + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
      // rint: round half to even, as torch.round; |x * inv| <= 127 for kept channels.
      const int32_t v = static_cast<int32_t>(__builtin_rintf(xr[c] * inv * kp[c]));
      qr[c] = static_cast<int8_t>(v > 127 ? 127 : (v < -127 ? -127 : v));
    }
    for (int64_t i = 0; i < num_outliers; ++i) x_outliers[r * num_outliers + i] = xr[outliers[i]];
  }
}

// out[m, n] = acc[m, n] * token_scale[m] * channel_scale[n] (+ extra[m, n]) (+ bias[n]).
// extra and bias may be null; out may alias extra.
void dequantize_int32(const int32_t* acc, const float* token_scale, const float* channel_scale,
                      const float* extra, const float* bias, float* out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* ar = acc + r * cols;
    const float ts = token_scale[r];
    float* orow = out + r * cols;
    const float* er = extra ? extra + r * cols : nullptr;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
      float v = static_cast<float>(ar[c]) * ts * channel_scale[c];
      if (er) v += er[c];
      if (bias) v += bias[c];
      orow[c] = v;
    }
  }
}

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

}  // extern "C"
