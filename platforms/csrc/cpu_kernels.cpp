// Native CPU kernels of the cpu platform:
//  * the small per-layer ops of a decode step (residual add + RMSNorm, rotary embedding,
//    SiLU- and GELU-tanh-and-multiply), each one call instead of 3-8 torch ops, whose dispatch overhead is what
//    a one-token step spends its time on after the matmuls;
//  * the two ends of an int8 x int8 GEMM with per-token activation scales (quantize the rows,
//    taking out the outlier channels; dequantize the int32 result), each one pass over memory
//    instead of the ~12 small torch ops they replace.
// (cpu_sdpa's paged decode attention is paged_decode.cpp, in this folder too.)
//
// Plain C++ with OpenMP, no torch headers: it compiles in about a second and is called through
// ctypes (platforms/cpu_kernels.py, built by platforms/native_build.py). libgomp.so.1 resolves to
// the runtime torch has already loaded, so torch.set_num_threads governs these threads too.
// Builds for any target: dequantize_int32's AVX-512 tiles (TM_AVX512F) leave the columns they do
// not cover, or all of them elsewhere, to its portable loop.
#include "tokenmill_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

using tokenmill_cpu::bf16_to_f32;
using tokenmill_cpu::f32_to_bf16;
using tokenmill_cpu::round_to_bf16;

namespace {

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// GELU with the tanh approximation as 0.5 * (1 + tanh(z)) = 1 / (1 + exp(-2z)): the form whose exp
// loop vectorizes like SiLU's.
inline float gelu_tanh(float g) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return g / (1.0f + std::exp(-2.0f * kSqrt2OverPi * (g + 0.044715f * g * g * g)));
}

// out [rows, inter] = act(x[:, :inter]) * x[:, inter:2 * inter], x rows contiguous (2 * inter).
template <float (*Act)(float)>
void gated_mul_f32(const float* x, float* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * 2 * inter;
    const float* up = gate + inter;
    float* orow = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) orow[i] = Act(gate[i]) * up[i];
  }
}

// bf16: out = round(round(act(gate)) * up), as torch's bf16 ops round. Through a float buffer of a
// row at a time, so the exp loop vectorizes (glibc's vector expf) without the bf16 conversions in it.
template <float (*Act)(float)>
void gated_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t inter) {
#pragma omp parallel if (rows >= 16)
  {
    std::vector<float> buffer(inter);
    float* __restrict g = buffer.data();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* gate = x + r * 2 * inter;
      const uint16_t* up = gate + inter;
      uint16_t* orow = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) g[i] = bf16_to_f32(gate[i]);
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) g[i] = Act(g[i]);
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) orow[i] = f32_to_bf16(round_to_bf16(g[i]) * bf16_to_f32(up[i]));
    }
  }
}

}  // namespace

extern "C" {

int tokenmill_kernels_abi_version() { return 10; }

// out = rmsnorm(x (+ residual)) * (offset + weight); with residual non-null, residual_out = x +
// residual. offset is Gemma's 1 in (1 + w), else 0. Rows are contiguous; threads only for batches
// big enough to pay for waking them.
void rms_norm_f32(const float* x, const float* residual, const float* weight, float eps, float offset, float* out,
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
    for (int64_t c = 0; c < cols; ++c) orow[c] = src[c] * inv * (offset + weight[c]);
  }
}

// Rotary embedding of the leading rotary_dim dims of each head (the rest copied: Phi-3's and GLM's
// partial rotary): for each token t and head h of x (row stride x_row_stride, heads contiguous
// inside a row), HF's "rotate half" layout out[t, h] = (x1 cos - x2 sin, x2 cos + x1 sin) over the
// two halves, or with `interleaved` (GPT-J's, GLM's) the same over adjacent pairs (x[2i], x[2i+1]);
// cos | sin = cos_sin[positions[t]] (each rotary_dim / 2 wide). out is contiguous.
void rope_f32(const float* x, int64_t x_row_stride, const float* cos_sin, const int64_t* positions,
              float* out, int64_t tokens, int64_t heads, int64_t head_size, int64_t rotary_dim, int64_t interleaved) {
  const int64_t half = rotary_dim / 2;
#pragma omp parallel for schedule(static) if (tokens >= 16)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cs = cos_sin + positions[t] * rotary_dim;
    const float* sn = cs + half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xh = x + t * x_row_stride + h * head_size;
      float* oh = out + (t * heads + h) * head_size;
      if (interleaved) {
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = xh[2 * i], x2 = xh[2 * i + 1];
          oh[2 * i] = x1 * cs[i] - x2 * sn[i];
          oh[2 * i + 1] = x2 * cs[i] + x1 * sn[i];
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          oh[i] = xh[i] * cs[i] - xh[half + i] * sn[i];
          oh[half + i] = xh[half + i] * cs[i] + xh[i] * sn[i];
        }
      }
      for (int64_t i = rotary_dim; i < head_size; ++i) oh[i] = xh[i];
    }
  }
}

// out [rows, inter] = silu(x[:, :inter]) * x[:, inter:2 * inter], x rows contiguous (2 * inter).
void silu_mul_f32(const float* x, float* out, int64_t rows, int64_t inter) { gated_mul_f32<silu>(x, out, rows, inter); }

// bf16 versions of the three (bf16 activations, as --dtype bfloat16 runs prompts): float32 math
// rounded to bf16 (nearest even) wherever torch's bf16 ops round, so the results are torch's to
// within the float32 rounding of the reductions and exp (conversions: tokenmill_cpu.h).

// out = round(round(norm(s)) * weight), s = x or round(x + residual) (also written to residual_out);
// with an offset (Gemma's 1 + w, scaled in float32 as Gemma's norm does) out = round(norm(s) * (offset + w)).
void rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, float eps, float offset,
                   uint16_t* out, uint16_t* residual_out, int64_t rows, int64_t cols) {
#pragma omp parallel if (rows >= 16)
  {
    std::vector<float> buffer(cols);
    float* __restrict src = buffer.data();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* xr = x + r * cols;
      if (residual) {
        const uint16_t* res = residual + r * cols;
        uint16_t* rr = residual_out + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t sum = f32_to_bf16(bf16_to_f32(xr[c]) + bf16_to_f32(res[c]));
          rr[c] = sum;
          src[c] = bf16_to_f32(sum);
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) src[c] = bf16_to_f32(xr[c]);
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < cols; ++c) ss += src[c] * src[c];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
      uint16_t* orow = out + r * cols;
      if (offset != 0.0f) {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) orow[c] = f32_to_bf16(src[c] * inv * (offset + bf16_to_f32(weight[c])));
      } else {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) orow[c] = f32_to_bf16(round_to_bf16(src[c] * inv) * bf16_to_f32(weight[c]));
      }
    }
  }
}

// rope_f32's rotation, each product and sum rounded as torch's bf16 ops round them.
void rope_bf16(const uint16_t* x, int64_t x_row_stride, const uint16_t* cos_sin, const int64_t* positions,
               uint16_t* out, int64_t tokens, int64_t heads, int64_t head_size, int64_t rotary_dim,
               int64_t interleaved) {
  const int64_t half = rotary_dim / 2;
  // (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), each product and the sum rounded to bf16.
  auto rotate = [](uint16_t a, uint16_t b, uint16_t cu, uint16_t su, uint16_t* oa, uint16_t* ob) {
    const float x1 = bf16_to_f32(a), x2 = bf16_to_f32(b), c = bf16_to_f32(cu), s = bf16_to_f32(su);
    *oa = f32_to_bf16(round_to_bf16(x1 * c) - round_to_bf16(x2 * s));
    *ob = f32_to_bf16(round_to_bf16(x2 * c) + round_to_bf16(x1 * s));
  };
#pragma omp parallel for schedule(static) if (tokens >= 16)
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* cs = cos_sin + positions[t] * rotary_dim;
    const uint16_t* sn = cs + half;
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* xh = x + t * x_row_stride + h * head_size;
      uint16_t* oh = out + (t * heads + h) * head_size;
      if (interleaved) {
        for (int64_t i = 0; i < half; ++i) rotate(xh[2 * i], xh[2 * i + 1], cs[i], sn[i], oh + 2 * i, oh + 2 * i + 1);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) rotate(xh[i], xh[half + i], cs[i], sn[i], oh + i, oh + half + i);
      }
      for (int64_t i = rotary_dim; i < head_size; ++i) oh[i] = xh[i];
    }
  }
}

void silu_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t inter) {
  gated_mul_bf16<silu>(x, out, rows, inter);
}

// out [rows, inter] = gelu_tanh(x[:, :inter]) * x[:, inter:] (Gemma's GeGLU), x rows contiguous.
void gelu_tanh_mul_f32(const float* x, float* out, int64_t rows, int64_t inter) {
  gated_mul_f32<gelu_tanh>(x, out, rows, inter);
}

void gelu_tanh_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t inter) {
  gated_mul_bf16<gelu_tanh>(x, out, rows, inter);
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
                      const float* extra, const float* bias, float* out, int64_t rows, int64_t cols,
                      const float* outlier_values, const float* outlier_weight, int64_t num_outliers) {
  // outlier_values [rows, num_outliers] x outlier_weight [num_outliers, cols]: the input channels
  // the int8 product left out, multiplied here in float32 while the output is in registers (a
  // separate K = 16 GEMM wrote and re-read a float32 [rows, cols] tensor for them). Tiles of 4
  // rows x 64 columns: each outlier weight vector loaded once for 4 rows (a row at a time
  // re-read and re-wrote its output once per outlier, several times slower).
#if TM_AVX512F
  const int64_t chunks = cols / 64, row_tiles = (rows + 3) / 4;
#pragma omp parallel for schedule(static) collapse(2)
  for (int64_t rt = 0; rt < row_tiles; ++rt)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t r0 = rt * 4, nr = std::min<int64_t>(4, rows - r0), c0 = ch * 64;
      __m512 o[4][4];
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t r = r0 + std::min<int64_t>(i, nr - 1);
        const __m512 ts = _mm512_set1_ps(token_scale[r]);
        for (int v = 0; v < 4; ++v) {
          const int64_t c = c0 + 16 * v;
          __m512 x = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + r * cols + c)), ts),
                                   _mm512_loadu_ps(channel_scale + c));
          if (extra) x = _mm512_add_ps(x, _mm512_loadu_ps(extra + r * cols + c));
          if (bias) x = _mm512_add_ps(x, _mm512_loadu_ps(bias + c));
          o[i][v] = x;
        }
      }
      if (outlier_values)
        for (int64_t j = 0; j < num_outliers; ++j) {
          __m512 wv[4];
          for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_ps(outlier_weight + j * cols + c0 + 16 * v);
          for (int64_t i = 0; i < 4; ++i) {
            const __m512 xv = _mm512_set1_ps(outlier_values[(r0 + std::min<int64_t>(i, nr - 1)) * num_outliers + j]);
            for (int v = 0; v < 4; ++v) o[i][v] = _mm512_fmadd_ps(xv, wv[v], o[i][v]);
          }
        }
      for (int64_t i = 0; i < nr; ++i)
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + (r0 + i) * cols + c0 + 16 * v, o[i][v]);
    }
  const int64_t done = chunks * 64;
#else
  const int64_t done = 0;
#endif
  if (done == cols) return;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* ar = acc + r * cols;
    const float ts = token_scale[r];
    float* orow = out + r * cols;
    const float* er = extra ? extra + r * cols : nullptr;
    const float* vr = outlier_values ? outlier_values + r * num_outliers : nullptr;
#pragma omp simd
    for (int64_t c = done; c < cols; ++c) {
      float v = static_cast<float>(ar[c]) * ts * channel_scale[c];
      if (er) v += er[c];
      if (bias) v += bias[c];
      orow[c] = v;
    }
    if (vr) {
      for (int64_t j = 0; j < num_outliers; ++j) {
        const float x = vr[j];
        const float* wr = outlier_weight + j * cols;
#pragma omp simd
        for (int64_t c = done; c < cols; ++c) orow[c] += x * wr[c];
      }
    }
  }
}

}  // extern "C"
