// The one header every CPU kernel source includes (platforms/csrc/*.cpp, each built into its own
// library by platforms/native_build.py, which hashes this header into every library's build key):
//  * what the build target (-march=native) has, as 0/1 macros: TM_AVX512F, TM_AVX512BW,
//    TM_AVX512_VNNI, TM_AVX512_BF16, TM_AMX_BF16. Code that needs one exists only under
//    `#if TM_...`; no source compiles a do-nothing stand-in for it;
//  * the refusal of a library whose kernels need an instruction set the target lacks: such a
//    source defines TOKENMILL_REQUIRES_AVX512_VNNI or TOKENMILL_REQUIRES_AVX512_BF16 before
//    including this header (first), and its build stops here with
//    `#error "tokenmill-refused: <ISA>"`; native_build reports that as the library's reason
//    ("this CPU has no <ISA>") and its callers run their torch path. Optional instruction sets
//    inside a library are capabilities its entries report (fused_decode_caps,
//    flash_prefill_available), checked by the Python side before it calls;
//  * bf16 <-> float32 conversions, rounding to nearest even as torch's .to(bfloat16) does;
//  * the AMX tile helpers: the tile configuration every thread loads before its tile
//    instructions, and the once-per-process request Linux needs before it hands out the AMX
//    register state.
#pragma once

// ---- What the build target has ---------------------------------------------------------------
#if defined(__AVX512F__)
#define TM_AVX512F 1
#else
#define TM_AVX512F 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TM_AVX512BW 1
#else
#define TM_AVX512BW 0
#endif
// int8 dot products (vpdpbusd) with the byte shuffles the quantized matmuls use.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_AVX512_VNNI 1
#else
#define TM_AVX512_VNNI 0
#endif
#if defined(__AVX512BF16__)
#define TM_AVX512_BF16 1
#else
#define TM_AVX512_BF16 0
#endif
// AMX bf16 tiles; the code around them converts with AVX512-BF16, so both are needed.
#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define TM_AMX_BF16 1
#else
#define TM_AMX_BF16 0
#endif

// ---- Refusal: a library that cannot run on this target is not built ---------------------------
// The marker "tokenmill-refused: " is what platforms/native_build.py looks for in the compiler's
// output (it builds with -Wfatal-errors, so this is the only error printed).
#if defined(TOKENMILL_REQUIRES_AVX512_VNNI) && !TM_AVX512_VNNI
#error "tokenmill-refused: AVX512-VNNI"
#elif defined(TOKENMILL_REQUIRES_AVX512_BF16) && !TM_AVX512_BF16
#error "tokenmill-refused: AVX512-BF16"
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if TM_AMX_BF16
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tokenmill_cpu {

// ---- bf16 <-> float32 ---------------------------------------------------------------------------
// bf16 bits -> float32 (exact: a bf16 value is a float32's top half).
inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// float32 -> bf16 bits, round to nearest even, as torch rounds finite values (NaN is not
// special-cased: the kernels that use this never see one).
inline uint16_t f32_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// f32_to_bf16, but NaN stays NaN (quieted), as vcvtneps2bf16 and torch keep it.
inline uint16_t f32_to_bf16_keep_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return f32_to_bf16(x);
}

// x rounded to the nearest bf16 value, as float32 (where torch's bf16 ops round a result).
inline float round_to_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#if TM_AVX512F
// 16 bf16 values (bits) -> 16 float32 lanes.
inline __m512 bf16x16_to_f32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 float32 lanes -> 16 bf16 values (bits), round to nearest even: vcvtneps2bf16 where the
// target has AVX512-BF16, else f32_to_bf16's integer rounding (the two differ on NaN only).
inline __m256i f32x16_to_bf16(__m512 v) {
#if TM_AVX512_BF16
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}
#endif  // TM_AVX512F

// ---- A call the build cannot serve ---------------------------------------------------------------
// For an entry whose caller skipped the capability check the library offers (e.g. a bf16 weight
// handed to a build without AVX512-BF16): stop loudly instead of returning untouched outputs.
[[noreturn]] inline void refuse_call(const char* why) {
  std::fprintf(stderr, "tokenmill native kernels: %s\n", why);
  std::abort();
}

// ---- AMX tiles -----------------------------------------------------------------------------------
#if TM_AMX_BF16
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Palette 1 with the first `tiles` registers at 16 rows x 64 bytes (the only shape used here).
inline void configure_tiles(int tiles = 8) {
  TileConfig config = {};
  config.palette = 1;
  for (int i = 0; i < tiles; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = 16;
  }
  _tile_loadconfig(&config);
}

// Whether Linux granted this process the AMX tile state (asked once).
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;   // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}
#endif  // TM_AMX_BF16

// Whether code on AMX tiles can run here: the build target has them and Linux granted them. A
// capability query (the tile code itself exists only under #if TM_AMX_BF16); a constant where the
// target has none, so a `const bool amx = amx_usable();` folds away.
#if TM_AMX_BF16
inline bool amx_usable() { return amx_ready(); }
#else
constexpr bool amx_usable() { return false; }
#endif

}  // namespace tokenmill_cpu
