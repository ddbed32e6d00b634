// Causal (or full) attention of a prompt chunk for the cpu_sdpa backend
// (attention_backends/cpu_flash_prefill.py), bf16 in and out, on AVX512-BF16 dot products: flash attention with an online softmax against a lazy base-2
// maximum, float32 scores and accumulators, the probabilities rounded to bf16 for P.V (as GPU
// flash kernels do). The tiles (attend_tile, attend_tile_amx) live in flash_tiles.h, shared
// with the decode kernel's cascade prefix.
//
// torch's CPU flash kernel runs its small per-block GEMMs far below the core's bf16 peak on a
// long prompt of small heads (SmolLM2: 9 heads of 64); here K and V are first re-laid out once per call into
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
// no torch headers, built by platforms/native_build.py like paged_decode.cpp. A build target
// without AVX512-BF16 gets no library: tokenmill_cpu.h refuses the build, and native_build
// reports "this CPU has no AVX512-BF16" (cpu_sdpa keeps torch's SDPA).
#define TOKENMILL_REQUIRES_AVX512_BF16 1
#include "tokenmill_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "flash_tiles.h"

extern "C" int tokenmill_kernels_abi_version() { return 3; }


namespace {
using namespace tokenmill_flash;

template <int D>
void run(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride, const uint16_t* v,
         int64_t v_stride, uint16_t* out,
         int64_t out_stride, int64_t tq, int64_t tk, int64_t num_heads, int64_t num_kv_heads, float scale,
         int64_t q_offset, bool causal, float* lse, int64_t window) {
  const int64_t blocks = (tk + kKeys - 1) / kKeys;
  const int64_t head = blocks * kKeys * D;    // both packed per KV head in whole blocks of keys
  static thread_local std::vector<uint16_t> kp, vp;
  kp.assign(num_kv_heads * head + kKeys * D, 0);     // + a zero block: AMX passes read two blocks
  vp.assign(num_kv_heads * head + kKeys * D, 0);
  pack_kv(k, k_stride, v, v_stride, tk, num_kv_heads, D, kp.data(), vp.data());
  const bool amx = tokenmill_cpu::amx_usable();
  const int64_t tile_rows = amx ? kAmxRows : kRows;
  const int64_t group = num_heads / num_kv_heads, tiles = (tq + tile_rows - 1) / tile_rows;
  const uint16_t* kpd = kp.data();
  const uint16_t* vpd = vp.data();
  // Later tiles of a causal chunk see more keys: hand them out first, one at a time.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_heads * tiles; ++item) {
    const int64_t tile = tiles - 1 - item / num_heads, h = item % num_heads, g = h / group;
    const int64_t i0 = tile * tile_rows;
    tile_kernel<D>(amx)(q, q_stride, kpd + g * head, vpd + g * head, out, out_stride, h, i0,
                        std::min(tile_rows, tq - i0), tk, scale, q_offset, causal, lse, tq, window);
  }
}

// Whole prompts back to back (prompt p: rows starts[p] .. starts[p + 1] - 1 of q, k, v and out,
// each attending to its own keys only, from position 0): one pass packs every prompt's K/V,
// one parallel loop runs every (prompt, head, tile) item, longest prompts' last tiles first.
template <int D>
void run_batch(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride, const uint16_t* v,
               int64_t v_stride, uint16_t* out, int64_t out_stride, const int64_t* starts, int64_t batch,
               int64_t num_heads, int64_t num_kv_heads, float scale, bool causal, float* lse, int64_t window) {
  std::vector<int64_t> packed(batch + 1, 0);        // offset of each prompt's packed heads
  std::vector<int64_t> first_item(batch + 1, 0);
  const int64_t group = num_heads / num_kv_heads;
  const bool amx = tokenmill_cpu::amx_usable();
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
    tile_kernel<D>(amx)(
        q + starts[p] * q_stride, q_stride, kpd + packed[p] + g * head, vpd + packed[p] + g * head,
        out + starts[p] * out_stride, out_stride, h, i0, std::min(tile_rows, len - i0), len, scale, 0, causal,
        lse ? lse + starts[p] : nullptr, starts[batch], window);
  }
}

}  // namespace

extern "C" {

// run_batch's prompts: starts [batch + 1] row offsets; lse [num_heads, starts[batch]] or null.
// Returns 0, or -1 for a head size it does not cover.
int64_t flash_prefill_batch_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                                 const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride,
                                 const int64_t* starts, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_size, float scale, int64_t causal, float* lse, int64_t window) {
  if (head_size == 64) {
    run_batch<64>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, batch, num_heads, num_kv_heads,
                  scale, causal != 0, lse, window);
    return 0;
  }
  if (head_size == 128) {
    run_batch<128>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, batch, num_heads, num_kv_heads,
                   scale, causal != 0, lse, window);
    return 0;
  }
  return -1;
}


// 1: AVX512-BF16 dot products; 3: AMX tiles as well. (Never 0 now: a target without
// AVX512-BF16 gets no library at all; the Python side still treats 0 as "not here".)
int64_t flash_prefill_available() { return tokenmill_cpu::amx_usable() ? 3 : 1; }

// Head sizes 64 and 128; returns 0 when done, -1 for a head size it does not cover.
int64_t flash_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                           const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride, int64_t tq, int64_t tk,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_size, float scale, int64_t q_offset,
                           int64_t causal, float* lse, int64_t window) {
  if (head_size == 64) {
    run<64>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, tq, tk, num_heads, num_kv_heads, scale, q_offset,
            causal != 0, lse, window);
    return 0;
  }
  if (head_size == 128) {
    run<128>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, tq, tk, num_heads, num_kv_heads, scale, q_offset,
             causal != 0, lse, window);
    return 0;
  }
  return -1;
}

}  // extern "C"
