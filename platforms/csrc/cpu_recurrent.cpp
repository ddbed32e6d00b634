// The cpu platform's Gated DeltaNet decode step (platforms/cpu_recurrent.py, offered as the
// `gated_delta_rule` layer kernel): the recurrent form of core/layers/gated_deltanet.py for a batch
// of sequences, a few tokens each (a decode step: one), in one call instead of the ~15 torch ops per
// token of `_recurrent` plus `_prepare`'s repeat, cast and L2 normalization.
//
// Per (sequence, value head), the state S [k_dim, v_dim] float32, per token:
//   q, k of the head's key head (GQA: value head h reads key head h / (Hv / Hk)), L2-normalized
//   (x * rsqrt(sum(x^2) + 1e-6)), q scaled by 1/sqrt(k_dim);
//   S = exp(g) S;  kv_mem = k^T S;  delta = (v - kv_mem) beta;  S += k delta^T;  o = q^T S.
// Every column j of S evolves on its own (kv_mem[j], delta[j], o[j] read only column j), so the
// state is walked in column tiles of 64 floats (four 512-bit registers), each tile twice per token
// (decay + k^T S, then the rank-one update + q^T S) while it is in L1, and updated in place.
// Threads: OpenMP over the (sequence, head) pairs; each pair's state is read and written once.
//
// AVX-512 float32 throughout; a target without AVX512F refuses the build (the marker
// native_build.py reports as "this CPU has no AVX512F") and the layer keeps its torch path.
#if !defined(__AVX512F__)
#error "tokenmill-refused: AVX512F"
#endif
#include "tokenmill_cpu.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

using tokenmill_cpu::bf16_to_f32;
using tokenmill_cpu::f32_to_bf16;

namespace {

constexpr int64_t kMaxKeyDim = 512;      // the normalized q, k of one head live on the stack
constexpr int kTileVectors = 4;          // 64 columns of S per tile

// Element loads of the activation dtypes the wrapper passes (float32 or bf16 bits).
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

// x (dim values) -> float32 x * rsqrt(sum(x^2) + eps) * scale: transformers' l2norm, then q's scale.
template <typename T>
void normalize(const T* x, int64_t dim, float scale, float* out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < dim; ++i) {
    out[i] = load(x, i);
    sum += out[i] * out[i];
  }
  const float factor = 1.0f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < dim; ++i) out[i] = out[i] * factor * scale;
}

// One token on columns [col, col + 16 * V) of S (rows of v_dim floats): the decay and k^T S, then
// delta, the rank-one update and q^T S. `v` holds those columns' values (float32), `o` gets theirs.
template <int V>
void step_tile(float* S, int64_t k_dim, int64_t v_dim, int64_t col, const float* q, const float* k,
               const float* v, float decay, float beta, float* o) {
  const __m512 vdecay = _mm512_set1_ps(decay);
  __m512 acc[V];
  for (int u = 0; u < V; ++u) acc[u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k_dim; ++i) {
    float* row = S + i * v_dim + col;
    const __m512 ki = _mm512_set1_ps(k[i]);
    for (int u = 0; u < V; ++u) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * u), vdecay);
      _mm512_storeu_ps(row + 16 * u, s);
      acc[u] = _mm512_fmadd_ps(s, ki, acc[u]);
    }
  }
  __m512 delta[V];
  const __m512 vbeta = _mm512_set1_ps(beta);
  for (int u = 0; u < V; ++u) {
    delta[u] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + 16 * u), acc[u]), vbeta);
    acc[u] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < k_dim; ++i) {
    float* row = S + i * v_dim + col;
    const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
    for (int u = 0; u < V; ++u) {
      const __m512 s = _mm512_fmadd_ps(ki, delta[u], _mm512_loadu_ps(row + 16 * u));
      _mm512_storeu_ps(row + 16 * u, s);
      acc[u] = _mm512_fmadd_ps(s, qi, acc[u]);
    }
  }
  for (int u = 0; u < V; ++u) _mm512_storeu_ps(o + 16 * u, acc[u]);
}

// The sequence and token strides (in elements) of the inputs, whose rows of heads are contiguous.
struct Strides {
  int64_t q_seq, q_token, k_seq, k_token, v_seq, v_token, g_seq, g_token, beta_seq, beta_token;
};

template <typename T>
void delta_rule(const T* q, const T* k, const T* v, const float* g, const T* beta, float* state, T* out,
                int64_t batch, int64_t tokens, int64_t key_heads, int64_t value_heads, int64_t k_dim,
                int64_t v_dim, const Strides& st) {
  const int64_t group = value_heads / key_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(k_dim));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < value_heads; ++h) {
      float qn[kMaxKeyDim], kn[kMaxKeyDim];
      alignas(64) float vf[16 * kTileVectors], of[16 * kTileVectors];
      float* S = state + (b * value_heads + h) * k_dim * v_dim;
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t key_head = (h / group) * k_dim;
        normalize(q + b * st.q_seq + t * st.q_token + key_head, k_dim, scale, qn);
        normalize(k + b * st.k_seq + t * st.k_token + key_head, k_dim, 1.0f, kn);
        const float decay = std::exp(g[b * st.g_seq + t * st.g_token + h]);
        const float strength = load(beta, b * st.beta_seq + t * st.beta_token + h);
        const T* vrow = v + b * st.v_seq + t * st.v_token + h * v_dim;
        T* orow = out + ((b * tokens + t) * value_heads + h) * v_dim;
        for (int64_t col = 0; col < v_dim;) {
          const int width = v_dim - col >= 16 * kTileVectors ? kTileVectors : 1;
          for (int64_t j = 0; j < 16 * width; ++j) vf[j] = load(vrow, col + j);
          if (width == kTileVectors)
            step_tile<kTileVectors>(S, k_dim, v_dim, col, qn, kn, vf, decay, strength, of);
          else
            step_tile<1>(S, k_dim, v_dim, col, qn, kn, vf, decay, strength, of);
          for (int64_t j = 0; j < 16 * width; ++j) store(orow, col + j, of[j]);
          col += 16 * width;
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int tokenmill_kernels_abi_version() { return 1; }

int64_t gated_delta_max_key_dim() { return kMaxKeyDim; }

// q, k [B, n, Hk, Dk], v [B, n, Hv, Dv] (float32 when bf16 == 0, else bf16 bits), g [B, n, Hv]
// float32, beta [B, n, Hv] in v's dtype, each with its sequence and token strides in `strides`
// (q, k, v, g, beta; elements) and contiguous heads; state [B, Hv, Dk, Dv] float32, contiguous, updated in place; out [B, n, Hv, Dv]
// contiguous in v's dtype. Dv a multiple of 16, Dk <= gated_delta_max_key_dim(), Hv % Hk == 0
// (the Python wrapper checks).
void gated_delta_recurrent(const void* q, const void* k, const void* v, const float* g, const void* beta,
                           float* state, void* out, int64_t bf16, int64_t batch, int64_t tokens, int64_t key_heads,
                           int64_t value_heads, int64_t k_dim, int64_t v_dim, const int64_t* strides) {
  Strides st;
  std::memcpy(&st, strides, sizeof st);
  if (bf16)
    delta_rule(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), g,
               static_cast<const uint16_t*>(beta), state, static_cast<uint16_t*>(out), batch, tokens, key_heads,
               value_heads, k_dim, v_dim, st);
  else
    delta_rule(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v), g,
               static_cast<const float*>(beta), state, static_cast<float*>(out), batch, tokens, key_heads,
               value_heads, k_dim, v_dim, st);
}

}  // extern "C"
